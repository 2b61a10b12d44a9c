"""The performance model's expected error, as its leave-one-out report measured it
(`megainfer simulate --validate`, megainfer/tools/simulator/validation.py): the mean absolute
error of mean TTFT and mean TBT over published rows, each predicted by curves fitted without it.
`megainfer simulate` prints it beside its predictions, and `megainfer plan` both prints it and
plans to the TBT SLO less it (a plan predicted at the SLO would miss it half the time)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

from megainfer.errors import PlanError

ERROR_FILE = Path(__file__).with_name("prediction_error.yaml")


@dataclass(frozen=True)
class PredictionError:
    ttft: float  # mean absolute relative error of mean TTFT, rows left out of the fit
    tbt: float  # the same of mean TBT
    rows: int  # published rows it was measured on
    source: str

    @classmethod
    def load(cls, path: str | Path | None = None) -> "PredictionError":
        path = Path(path) if path else ERROR_FILE
        try:
            data = yaml.safe_load(path.read_text())
            return cls(float(data["ttft"]), float(data["tbt"]), int(data["rows"]), str(data["source"]))
        except (OSError, yaml.YAMLError, KeyError, TypeError, ValueError) as exc:
            raise PlanError(f"{path}: the model's error band (ttft, tbt, rows, source) cannot be read: {exc}; "
                            "regenerate it with `megainfer simulate --validate --write-error`") from None

    def write(self, path: str | Path | None = None) -> None:
        text = ("# The performance model's mean absolute error, rows left out of the fit: written by\n"
                "# `megainfer simulate --validate --write-error` (docs/performance-model.md).\n")
        Path(path or ERROR_FILE).write_text(text + yaml.safe_dump(
            {"ttft": round(self.ttft, 4), "tbt": round(self.tbt, 4), "rows": self.rows, "source": self.source},
            sort_keys=False))

    def headroom_slo_s(self, tbt_slo_s: float) -> float:
        """The TBT a plan must be predicted under to meet `tbt_slo_s` at the model's usual error."""
        return tbt_slo_s / (1 + self.tbt)

    def line(self) -> str:
        return (f"expected error of these predictions: mean TTFT +/-{self.ttft:.0%}, mean TBT and throughput "
                f"+/-{self.tbt:.0%} (mean absolute error over {self.rows} published rows, each left out of the fit; "
                f"{self.source})")
