"""The GPU catalog: a data file (planner/gpus.yaml by default) of per-GPU figures."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

import yaml

from megainfer.errors import PlanError

DEFAULT_CATALOG = Path(__file__).with_name("gpus.yaml")


@dataclass(frozen=True)
class GPU:
    name: str
    memory_gb: float
    hbm_gbps: float  # GB/s
    bf16_tflops: float  # dense
    nic_gbps: float  # Gbit/s per GPU
    link_gbps: float  # GB/s GPU-to-GPU inside a node
    gpus_per_node: int
    power_w: float
    price: float  # per GPU-hour, catalog units

    @property
    def memory_bytes(self) -> float:
        return self.memory_gb * 1e9

    @property
    def hbm_bytes_per_s(self) -> float:
        return self.hbm_gbps * 1e9

    @property
    def flops(self) -> float:
        return self.bf16_tflops * 1e12

    @property
    def nic_bytes_per_s(self) -> float:
        return self.nic_gbps * 1e9 / 8

    @property
    def link_bytes_per_s(self) -> float:
        return self.link_gbps * 1e9

    @property
    def roofline_batch(self) -> float:
        """Tokens per GEMM at which a bf16 weight GEMM turns compute-bound: FLOPs per
        weight byte of a b-token GEMM is b (2·b·P FLOPs over 2·P bytes)."""
        return self.flops / self.hbm_bytes_per_s


_FIELDS = [f for f in dataclasses.fields(GPU) if f.name != "name"]


class Catalog:
    def __init__(self, gpus: dict[str, GPU], price_unit: str = "") -> None:
        self.gpus = gpus
        self.price_unit = price_unit

    def __getitem__(self, name: str) -> GPU:
        gpu = self.gpus.get(name) or next((g for n, g in self.gpus.items() if n.lower() == name.lower()), None)
        if gpu is None:
            raise PlanError(f"unknown GPU {name!r}; the catalog knows {', '.join(self.gpus)} "
                            "(add others with --catalog FILE)")
        return gpu

    def __iter__(self):
        return iter(self.gpus.values())

    def names(self) -> list[str]:
        return list(self.gpus)

    def with_prices(self, prices: dict[str, float]) -> "Catalog":
        """A copy with some GPUs' prices replaced (the user's own $/hour)."""
        gpus = dict(self.gpus)
        for name, price in prices.items():
            if price <= 0:
                raise PlanError(f"--price {name}={price}: a price must be positive")
            gpus[self[name].name] = dataclasses.replace(self[name], price=price)
        return Catalog(gpus, "per hour (user prices)" if prices else self.price_unit)

    @classmethod
    def load(cls, path: str | os.PathLike | None = None) -> "Catalog":
        path = Path(path) if path else DEFAULT_CATALOG
        if not path.is_file():
            raise PlanError(f"GPU catalog {str(path)!r} does not exist")
        try:
            data = yaml.safe_load(path.read_text())
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            raise PlanError(f"{path}: not valid YAML{f' at line {mark.line + 1}' if mark else ''}") from None
        if not isinstance(data, dict) or not isinstance(data.get("gpus"), dict) or not data["gpus"]:
            raise PlanError(f"{path}: a catalog needs a non-empty 'gpus' mapping of name -> figures")
        gpus = {}
        for name, figures in data["gpus"].items():
            where = f"{path}: gpus.{name}"
            if not isinstance(figures, dict):
                raise PlanError(f"{where} must be a mapping of figures")
            unknown = sorted(set(figures) - {f.name for f in _FIELDS})
            if unknown:
                raise PlanError(f"{where}.{unknown[0]} is not a catalog field; fields: "
                                f"{', '.join(f.name for f in _FIELDS)}")
            values = {}
            for f in _FIELDS:
                if f.name not in figures:
                    raise PlanError(f"{where}.{f.name} is missing")
                value = figures[f.name]
                if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                    raise PlanError(f"{where}.{f.name} must be a positive number, got {value!r}")
                values[f.name] = int(value) if f.name == "gpus_per_node" else float(value)
            gpus[str(name)] = GPU(name=str(name), **values)
        return cls(gpus, str((data.get("units") or {}).get("price", "")))
