"""What a check reports, and the two files it lands in.

`gpucheck.jsonl`: one JSON object per line, appended and flushed as each result finishes (a
run killed at its budget keeps every line written before), in the shape of `CheckRecord`.
`gpucheck.md`: the summary, rewritten from the JSONL after every check."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path

JSONL, SUMMARY = "gpucheck.jsonl", "gpucheck.md"


class Status(str, Enum):
    PASSED = "passed"
    FAILED = "failed"
    SKIPPED = "skipped"  # could not run here; `detail` says why
    NOT_RUN = "not run"  # the budget ran out first


@dataclass
class CheckRecord:
    check: str  # the check ("kernels"), one of runner.CHECKS
    case: str  # what inside it ("decode qwen3-235b 64/4x128 bf16"); "" for the check as a whole
    status: Status
    seconds: float  # wall time of this case, compiles included
    figures: dict[str, float | int | str | bool | None] = field(default_factory=dict)  # named measurements
    detail: str = ""  # why it failed or was skipped; what it compared

    def to_json(self) -> str:
        return json.dumps(asdict(self) | {"status": self.status.value})

    @classmethod
    def from_json(cls, line: str) -> "CheckRecord":
        fields = json.loads(line)
        return cls(**fields | {"status": Status(fields["status"])})


class RecordLog:
    """Appends records to DIR/gpucheck.jsonl, one line each, flushed at once."""

    def __init__(self, out: Path) -> None:
        self.path = Path(out) / JSONL

    def append(self, record: CheckRecord) -> None:
        with self.path.open("a") as f:
            f.write(record.to_json() + "\n")
            f.flush()

    def read(self) -> list[CheckRecord]:
        if not self.path.exists():
            return []
        return [CheckRecord.from_json(line) for line in self.path.read_text().splitlines() if line.strip()]


class Case:
    """Times one case and appends its record: `with Case(log, "kernels", "decode ...") as case:
    case.figures[...] = ...`. An exception fails the case (its type and message are the detail)
    and is not raised further, so the next case runs; `case.skip(why)` records a skip."""

    def __init__(self, log: RecordLog, check: str, name: str) -> None:
        self.log, self.check, self.name = log, check, name
        self.figures: dict[str, float | int | str | bool | None] = {}
        self.detail = ""
        self._skipped = ""

    def skip(self, why: str) -> None:
        self._skipped = why

    def __enter__(self) -> "Case":
        self._start = time.perf_counter()
        return self

    def __exit__(self, kind, exc, tb) -> bool:
        seconds = round(time.perf_counter() - self._start, 3)
        if exc is not None:
            status, detail = Status.FAILED, f"{kind.__name__}: {exc}"[:2000]
        elif self._skipped:
            status, detail = Status.SKIPPED, self._skipped
        else:
            status, detail = Status.PASSED, self.detail
        self.log.append(CheckRecord(self.check, self.name, status, seconds, self.figures, detail))
        return kind is not None and issubclass(kind, Exception)


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def write_summary(out: Path, header: list[str], records: list[CheckRecord]) -> None:
    """DIR/gpucheck.md: the run's header lines, a count per status, then every record."""
    counts = {s: sum(1 for r in records if r.status is s) for s in Status}
    lines = ["# megainfer GPU check", "", *header, "",
             ", ".join(f"{n} {s.value}" for s, n in counts.items() if n) or "no results", "",
             "| check | case | status | s | figures | detail |", "|---|---|---|---|---|---|"]
    for r in records:
        figures = "; ".join(f"{k} {_cell(v)}" for k, v in r.figures.items())
        detail = r.detail.replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {r.check} | {r.case} | {r.status.value} | {r.seconds:.1f} | {figures} | {detail} |")
    (Path(out) / SUMMARY).write_text("\n".join(lines) + "\n")
