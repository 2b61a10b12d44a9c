"""What a check is handed in its process: the device, where results go, and its deadline."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from megainfer.tools.gpucheck.records import Case, RecordLog


@dataclass
class CheckContext:
    name: str  # the check's name: every record it writes carries it
    device: torch.device  # cuda: real shapes, compiled kernels; cpu: small shapes, Triton's interpreter
    out: Path
    deadline: float  # time.time() by which the check must have stopped (the runner kills it then)

    @property
    def on_gpu(self) -> bool:
        return self.device.type == "cuda"

    @property
    def log(self) -> RecordLog:
        return RecordLog(self.out)

    def seconds_left(self) -> float:
        return self.deadline - time.time()

    def case(self, name: str) -> Case:
        """A timed case whose record lands in gpucheck.jsonl when its `with` block ends."""
        print(f"[{self.name}] {name} ...", flush=True)
        return Case(self.log, self.name, name)
