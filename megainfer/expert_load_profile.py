"""A measured expert-load profile as a file: the (token, expert) pairs each (layer, expert) took
over a serving engine's or deployment's window, decode steps and steps with prompt tokens apart.

A running server hands it out (`GET /admin/experts/load`, the window the expert rebalancer reads:
on a deployment the expert nodes' own counts, on a colocated engine its gating kernel's), and
`megainfer plan --expert-load` / `megainfer simulate --plan ... --expert-load` price a deployment
against it instead of the fitted popularity law: which experts are hot, layer by layer, as this
model served this traffic. The file is JSON with named fields (`to_dict`), read back with every
field checked (`load`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from megainfer.errors import ConfigError
from megainfer.messages import ExpertLoadReport

PHASES = ("decode", "prefill", "all")


@dataclass
class ExpertLoadProfile:
    model: str  # the served model's name, as the server reports it
    decode: np.ndarray  # [layers, experts] int64 pairs of the window's decode-only steps
    prefill: np.ndarray  # [layers, experts] int64 pairs of its steps with prompt tokens
    decode_steps: int
    prefill_steps: int

    @classmethod
    def of(cls, model: str, report: ExpertLoadReport) -> "ExpertLoadProfile":
        return cls(model, np.asarray(report.decode, dtype=np.int64), np.asarray(report.prefill, dtype=np.int64),
                   int(report.decode_steps), int(report.prefill_steps))

    @property
    def num_layers(self) -> int:
        return int(self.decode.shape[0])

    @property
    def num_experts(self) -> int:
        return int(self.decode.shape[1])

    def counts(self, phase: str) -> np.ndarray:
        """[layers, experts] pairs of `phase`: "decode", "prefill" or "all"."""
        return _of_phase(phase, self.decode, self.prefill)

    def steps(self, phase: str) -> int:
        """The window's steps of `phase` (as `counts`)."""
        return _of_phase(phase, self.decode_steps, self.prefill_steps)

    def to_dict(self) -> dict:
        return {"model": self.model, "num_layers": self.num_layers, "num_experts": self.num_experts,
                "decode_steps": self.decode_steps, "prefill_steps": self.prefill_steps,
                "decode": self.decode.tolist(), "prefill": self.prefill.tolist()}

    @classmethod
    def from_dict(cls, data: object, source: str = "the profile") -> "ExpertLoadProfile":
        fix = "write it with `curl <server>/admin/experts/load` from a server that has served traffic"
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: an expert-load profile is a JSON object, got {type(data).__name__}; {fix}")
        missing = [k for k in ("model", "decode", "prefill", "decode_steps", "prefill_steps") if k not in data]
        if missing:
            raise ConfigError(f"{source}: missing {', '.join(missing)}; {fix}")
        arrays = {}
        for name in ("decode", "prefill"):
            try:
                arrays[name] = np.asarray(data[name], dtype=np.int64)
            except (TypeError, ValueError, OverflowError):
                raise ConfigError(f"{source}: {name} must be a [layers][experts] table of whole numbers; {fix}") \
                    from None
            if arrays[name].ndim != 2 or arrays[name].size == 0:
                raise ConfigError(f"{source}: {name} must be a [layers][experts] table, got shape "
                                  f"{list(arrays[name].shape)}; {fix}")
            if (arrays[name] < 0).any():
                raise ConfigError(f"{source}: {name} holds negative counts; {fix}")
        if arrays["decode"].shape != arrays["prefill"].shape:
            raise ConfigError(f"{source}: decode is {list(arrays['decode'].shape)} but prefill is "
                              f"{list(arrays['prefill'].shape)} (both [layers][experts]); {fix}")
        steps = {}
        for name in ("decode_steps", "prefill_steps"):
            if not isinstance(data[name], int) or isinstance(data[name], bool) or data[name] < 0:
                raise ConfigError(f"{source}: {name} must be a whole number >= 0, got {data[name]!r}")
            steps[name] = data[name]
        if not isinstance(data["model"], str) or not data["model"]:
            raise ConfigError(f"{source}: model must name the model the profile was measured on, got {data['model']!r}")
        return cls(data["model"], arrays["decode"], arrays["prefill"], steps["decode_steps"], steps["prefill_steps"])

    @classmethod
    def load(cls, path: str | Path) -> "ExpertLoadProfile":
        try:
            data = json.loads(Path(path).read_text())
        except OSError as exc:
            raise ConfigError(f"--expert-load {path}: cannot read it ({exc.strerror or exc})") from None
        except ValueError as exc:
            raise ConfigError(f"--expert-load {path}: not JSON ({exc})") from None
        return cls.from_dict(data, f"--expert-load {path}")

    def check_model(self, num_layers: int, num_experts: int, model_name: str, phase: str) -> None:
        """Refuse a profile of another shape than the model priced, or with no pairs in `phase`."""
        if (self.num_layers, self.num_experts) != (num_layers, num_experts):
            raise ConfigError(
                f"the expert-load profile was measured on {self.model} ({self.num_layers} layers x "
                f"{self.num_experts} experts), but {model_name} has {num_layers} x {num_experts}: a "
                f"profile prices only the model it was measured on (or use --expert-skew)")
        if not self.counts(phase).any():
            raise ConfigError(f"the expert-load profile of {self.model} holds no {phase} pairs (decode steps "
                              f"{self.decode_steps}, prefill steps {self.prefill_steps}): serve traffic of that "
                              f"phase before taking it, or choose --expert-load-phase")


def _of_phase(phase: str, decode, prefill):
    """`decode`, `prefill` or their sum, as `phase` names ("decode", "prefill" or "all")."""
    if phase not in PHASES:
        raise ConfigError(f"expert-load phase {phase!r} is not one of {', '.join(PHASES)}")
    if phase == "decode":
        return decode
    return prefill if phase == "prefill" else decode + prefill
