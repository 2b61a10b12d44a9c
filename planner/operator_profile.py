"""Operator profiles: seconds measured on one device for one model shape (`megainfer profile`
writes them, the step model reads them).

A profile is a JSON file holding, per operator, a table of seconds over a grid of problem
sizes, plus what it was measured on: the device, the model's shape, the dtype and the
tensor-parallel size. Lookups inside a table's grid interpolate linearly in log(1 + x) of
each axis (operator times are close to linear in work, and the grid is geometric); a point
outside the grid is not covered, and the caller prices it another way.

The operators and what one table entry times (per layer unless it says per step):

- `dense[tokens]`: the attention node's dense work on `tokens` rows: input norm, QKV
  projection, q/k norms, RoPE, the KV-cache write, output projection, residual,
  post-attention norm, router and top-k gating (everything of the attention half but the
  attention kernel).
- `attention_decode[seqs, context]`: the attention kernel for `seqs` decoding sequences, each
  attending over `context` cached tokens.
- `attention_prefill[tokens, cached]`: the attention kernel for one sequence's prompt chunk of
  `tokens` tokens after `cached` tokens already in the cache (causal inside the chunk).
- `moe[tokens_per_expert, experts]`: the expert half (dispatch, grouped expert GEMMs,
  weighted combine) with `experts` experts active, each receiving `tokens_per_expert`
  (token, expert) pairs.
- `allreduce[bytes]`: one tensor-parallel all-reduce of a tensor of `bytes` (tp > 1 only).
- `lm_head[tokens]` (per step): final norm and LM-head logits for `tokens` rows.
- `sampling[seqs]` (per step): the sampler over `seqs` rows of logits.
- `step_overhead[seqs]` (per step): the engine's cost of a step outside the operators above
  (scheduling, batch preparation, embedding, output processing, framework dispatch) with
  `seqs` sequences in the step, measured by running the engine's steps and subtracting the
  operators' share.
"""

from __future__ import annotations

import bisect
import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from megainfer.config import ModelConfig
from megainfer.errors import PlanError
from planner.json_file import read_json_file

FORMAT_VERSION = 1

# Operator -> its table's axes, in order.
OPERATOR_AXES: dict[str, tuple[str, ...]] = {
    "dense": ("tokens",),
    "attention_decode": ("seqs", "context"),
    "attention_prefill": ("tokens", "cached"),
    "moe": ("tokens_per_expert", "experts"),
    "allreduce": ("bytes",),
    "lm_head": ("tokens",),
    "sampling": ("seqs",),
    "step_overhead": ("seqs",),
}

# The ModelConfig fields that decide every operator's cost: a profile applies to a model only
# where these agree (the layer count is not among them: tables are per layer or per step).
SHAPE_FIELDS = ("hidden_size", "num_heads", "num_kv_heads", "head_dim", "num_experts", "top_k",
                "expert_intermediate_size", "vocab_size", "qk_norm")


@dataclass(frozen=True)
class OperatorTable:
    """Seconds over a grid: `axes[i]` ascending values of the i-th axis, `seconds` nested lists
    (axis 0 outermost)."""

    axes: tuple[tuple[float, ...], ...]
    seconds: np.ndarray

    def __post_init__(self) -> None:
        shape = tuple(len(a) for a in self.axes)
        if self.seconds.shape != shape:
            raise ValueError(f"seconds has shape {self.seconds.shape}, the axes give {shape}")
        for values in self.axes:
            if not values or any(b <= a for a, b in zip(values, values[1:])) or values[0] < 0:
                raise ValueError("axis values must be non-negative and strictly increasing")
        if not np.all(np.isfinite(self.seconds)) or np.any(self.seconds < 0):
            raise ValueError("seconds must be finite and non-negative")

    def covers(self, *point: float) -> bool:
        return all(values[0] <= x <= values[-1] for values, x in zip(self.axes, point))

    def __call__(self, *point: float) -> float:
        """Seconds at `point` (inside the grid): multilinear in log(1 + x) of each axis."""
        corners = [_bracket(values, x) for values, x in zip(self.axes, point)]
        total = 0.0
        for offsets in np.ndindex(*(2,) * len(corners)):
            weight, index = 1.0, []
            for (lo, frac), o in zip(corners, offsets):
                weight *= frac if o else 1.0 - frac
                index.append(min(lo + o, len(self.axes[len(index)]) - 1))
            if weight:
                total += weight * float(self.seconds[tuple(index)])
        return total

    def to_json(self, names: tuple[str, ...]) -> dict:
        return {"axes": {name: list(values) for name, values in zip(names, self.axes)},
                "seconds": self.seconds.tolist()}


def _bracket(values: tuple[float, ...], x: float) -> tuple[int, float]:
    """(index of the grid point at or below x, fraction of the way to the next in log1p)."""
    i = bisect.bisect_right(values, x) - 1
    if i >= len(values) - 1:
        return len(values) - 1, 0.0
    lo, hi = math.log1p(values[i]), math.log1p(values[i + 1])
    return i, (math.log1p(x) - lo) / (hi - lo)


@dataclass(frozen=True)
class ProfiledDevice:
    kind: str  # "cuda" or "cpu"
    name: str  # e.g. "NVIDIA H100 80GB HBM3", or the CPU's model name
    count: int  # devices the profile used (the tensor-parallel size)
    catalog_name: str | None = None  # the GPU catalog's name for it, where one matches
    peak_flops: float = 0.0  # FLOP/s a large GEMM achieved in the profile's dtype, one device
    peak_bytes_per_s: float = 0.0  # bytes/s a large copy achieved, one device
    threads: int = 0  # CPU: torch's intra-op threads


@dataclass
class OperatorProfile:
    device: ProfiledDevice
    model: dict  # SHAPE_FIELDS -> value, plus "name" (informational)
    dtype: str  # torch dtype name, e.g. "bfloat16"
    tp: int
    operators: dict[str, OperatorTable]
    kv_cache_tokens: int | None = None  # KV-cache tokens the engine sizes on this device by default
    created: str = ""
    command: str = ""
    versions: dict = field(default_factory=dict)  # torch, triton, megainfer
    path: str = ""  # where it was read from (not written)

    @property
    def dtype_bytes(self) -> int:
        return {"float32": 4, "float16": 2, "bfloat16": 2}.get(self.dtype, 2)

    def table(self, operator: str) -> OperatorTable | None:
        return self.operators.get(operator)

    def check_applies(self, model: ModelConfig, tp: int) -> None:
        """A profile prices only the shape it measured: refuse another model's or another tp's."""
        where = self.path or "the profile"
        for name in SHAPE_FIELDS:
            mine, theirs = self.model.get(name), getattr(model, name)
            if mine != theirs:
                raise PlanError(f"{where} was measured for {self.model.get('name', 'another model')} with "
                                f"{name} = {mine}, but {model.name} has {theirs}; profile this model with "
                                f"`megainfer profile --model {model.name}`")
        if tp != self.tp:
            raise PlanError(f"{where} was measured at tensor parallelism {self.tp}, not {tp}; pass --tp {self.tp} "
                            f"or profile with --tp {tp}")

    # -- files -----------------------------------------------------------------------------
    def save(self, path: str | os.PathLike) -> None:
        data = {
            "format": FORMAT_VERSION,
            "device": asdict(self.device),
            "model": self.model,
            "dtype": self.dtype,
            "tp": self.tp,
            "kv_cache_tokens": self.kv_cache_tokens,
            "created": self.created,
            "command": self.command,
            "versions": self.versions,
            "operators": {op: t.to_json(OPERATOR_AXES[op]) for op, t in self.operators.items()},
        }
        Path(path).write_text(json.dumps(data, indent=1) + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike) -> "OperatorProfile":
        path = Path(path)
        data = read_json_file(path, f"--profile {str(path)!r}", "write one with `megainfer profile`")
        if data.get("format") != FORMAT_VERSION:
            raise PlanError(f"--profile {path}: not a format-{FORMAT_VERSION} profile from `megainfer profile`")
        try:
            device = ProfiledDevice(**data["device"])
            operators = {}
            for op, entry in (data.get("operators") or {}).items():
                if op not in OPERATOR_AXES:
                    raise PlanError(f"--profile {path}: unknown operator {op!r}; known: {', '.join(OPERATOR_AXES)}")
                names = OPERATOR_AXES[op]
                if set(entry["axes"]) != set(names):
                    raise PlanError(f"--profile {path}: operator {op} needs axes {', '.join(names)}")
                operators[op] = OperatorTable(tuple(tuple(float(v) for v in entry["axes"][n]) for n in names),
                                              np.asarray(entry["seconds"], dtype=np.float64))
            return cls(device=device, model=dict(data["model"]), dtype=str(data["dtype"]), tp=int(data["tp"]),
                       operators=operators, kv_cache_tokens=data.get("kv_cache_tokens"),
                       created=data.get("created", ""), command=data.get("command", ""),
                       versions=data.get("versions") or {}, path=str(path))
        except (KeyError, TypeError, ValueError) as exc:
            raise PlanError(f"--profile {path}: malformed profile ({type(exc).__name__}: {exc})") from None


def model_shape(model: ModelConfig) -> dict:
    """What a profile records of the model it measured."""
    return {"name": model.name, **{name: getattr(model, name) for name in SHAPE_FIELDS}}
