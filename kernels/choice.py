"""On a GPU, per shape, the faster of a Triton kernel and its torch reference, decided before
serving.

A shape key is the op, what the model fixes (dtype, heads, expert dims: `static`) and the sizes
that decide the work (`dims`), each rounded up to a power of two (`bucket`). A node decides its
shapes at start (`kernels.startup` calls every operator on a grid of the shapes it will meet):
the first call of a key runs both implementations (warm-up, which absorbs Triton's compile, then
a few reps timed), keeps the faster, and records the decision with both times. Time is wall
time between two device synchronisations, so a reference that synchronises the host itself
(a `.tolist()`, a `nonzero`) pays for it.

Once `freeze()`d (the node is serving), nothing is timed any more: a key met for the first time
takes the decision of the nearest decided shape of its op and static part (nearest in log2 of
each size), else Triton. So no serving step stops to time, and which implementation runs where
is fixed and reported (`decisions`) before the node says it is ready.

Nothing falls back silently: a Triton kernel that fails to build or run raises `KernelFailed`,
naming the kernel, the shape and the cause (at start-up, where the warm-up calls it first); a
reference that fails (out of memory gathering a large batch's pages, say) loses to Triton, and
that decision says so.
While a CUDA graph is being captured nothing is timed (timing synchronises): the reference
runs and nothing is decided.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger("kernels")

TRITON, REFERENCE = "triton", "reference"


class KernelFailed(RuntimeError):
    """A Triton kernel failed to build or run at a shape: the message names both and the cause."""


def bucket(n: int) -> int:
    """n rounded up to a power of two (0 stays 0): calls within 2x of each other share a choice."""
    return 0 if n <= 0 else 1 << (int(n) - 1).bit_length()


@dataclass(frozen=True)
class ShapeKey:
    op: str  # the dispatch operator: "paged_attention", "fused_gating", "grouped_expert_gemm"
    static: tuple  # what the model fixes: dtype, heads, expert dims
    dims: tuple[int, ...]  # bucketed sizes that decide the work
    dim_names: tuple[str, ...] = ()  # what each of `dims` counts, for reports

    def __str__(self) -> str:
        static = " ".join(str(s).removeprefix("torch.") for s in self.static)
        dims = " ".join(f"{n}={d}" for n, d in zip(self.dim_names, self.dims)) if self.dim_names else \
            "x".join(map(str, self.dims))
        return f"{self.op}[{static}; {dims}]"

    def distance(self, other: "ShapeKey") -> float:
        return sum(abs(math.log2(a + 1) - math.log2(b + 1)) for a, b in zip(self.dims, other.dims))


@dataclass(frozen=True)
class Decision:
    """Which implementation a shape runs, and why (crosses processes: node start-up reports)."""

    key: str  # str(ShapeKey)
    op: str
    implementation: str  # TRITON or REFERENCE
    triton_ms: float | None  # per call, where timed
    reference_ms: float | None
    reason: str  # "faster", "forced by MEGAINFER_KERNELS", "not timed: ...", "reference out of memory"


def cuda_time_ms(fn: Callable[[], Any], reps: int, warmup: int) -> tuple[float, Any]:
    """(mean milliseconds per call over `reps` after `warmup` calls, the last call's output):
    wall time from an idle device to the last call's end, host stalls included."""
    out = None
    for _ in range(warmup):
        out = fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        out = fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3 / reps, out


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _failed(key: ShapeKey, exc: Exception) -> KernelFailed:
    return KernelFailed(f"Triton kernel {key.op} failed at {key}: {type(exc).__name__}: {exc}. MEGAINFER_KERNELS="
                        "reference runs the torch references instead (slower), by choice")


class ShapeChoice:
    """Which implementation each shape takes, decided by timing once, before serving."""

    def __init__(self, timer: Callable[[Callable[[], Any], int, int], tuple[float, Any]] = cuda_time_ms,
                 reps: int = 5, warmup: int = 2):
        self.timer, self.reps, self.warmup = timer, reps, warmup
        self.choices: dict[ShapeKey, str] = {}  # TRITON or REFERENCE
        self.decisions: dict[ShapeKey, Decision] = {}  # the shapes decided by timing or by rule
        self.frozen = False
        self.met_while_serving = 0  # keys first met after freeze(): given the nearest decision

    def run(self, key: ShapeKey, triton_fn: Callable[[], Any], reference_fn: Callable[[], Any]) -> Any:
        choice = self.choices.get(key)
        if choice is None and self.frozen:
            choice = self._nearest(key)
        if choice == TRITON:
            return self._triton(key, triton_fn)
        if choice == REFERENCE or _capturing():
            return reference_fn()
        return self._decide(key, triton_fn, reference_fn)

    def fixed(self, key: ShapeKey, triton_fn: Callable[[], Any], reason: str) -> Any:
        """The Triton kernel without timing (ops whose choice must not vary between processes)."""
        if key not in self.choices:
            self.choices[key] = TRITON
            self.decisions[key] = Decision(str(key), key.op, TRITON, None, None, reason)
        return self._triton(key, triton_fn)

    def reference_only(self, key: ShapeKey, reference_fn: Callable[[], Any], reason: str) -> Any:
        """The torch reference without timing, where no Triton kernel serves the shape: recorded
        (logged once, in the node's kernel report) with `reason`."""
        if key not in self.choices:
            self._record(key, REFERENCE, None, None, reason)
        return reference_fn()

    def _triton(self, key: ShapeKey, triton_fn: Callable[[], Any]) -> Any:
        try:
            return triton_fn()
        except Exception as exc:
            raise _failed(key, exc) from exc

    def _nearest(self, key: ShapeKey) -> str:
        self.met_while_serving += 1
        same = [k for k in self.decisions if k.op == key.op and k.static == key.static]
        choice = min(same, key=key.distance, default=None)
        self.choices[key] = self.choices[choice] if choice is not None else TRITON
        return self.choices[key]

    def _decide(self, key: ShapeKey, triton_fn: Callable[[], Any], reference_fn: Callable[[], Any]) -> Any:
        try:
            triton_ms, triton_out = self.timer(triton_fn, self.reps, self.warmup)
        except Exception as exc:
            raise _failed(key, exc) from exc
        try:
            reference_ms, reference_out = self.timer(reference_fn, self.reps, self.warmup)
        except torch.cuda.OutOfMemoryError as exc:  # a large batch's gathered pages: Triton pages in place
            self._record(key, TRITON, triton_ms, None, f"the torch reference ran out of memory ({exc})")
            return triton_out
        except Exception as exc:  # the reference only competes: its failure decides for Triton, said so
            self._record(key, TRITON, triton_ms, None, f"the torch reference failed ({type(exc).__name__}: {exc})")
            return triton_out
        choice = TRITON if triton_ms <= reference_ms else REFERENCE
        self._record(key, choice, triton_ms, reference_ms, "faster")
        return triton_out if choice == TRITON else reference_out

    def _record(self, key: ShapeKey, choice: str, triton_ms: float | None, reference_ms: float | None,
                reason: str) -> None:
        self.choices[key] = choice
        self.decisions[key] = Decision(str(key), key.op, choice, triton_ms, reference_ms, reason)
        log.info("kernels %s: %s (Triton %s, torch reference %s per call; %s)", key, choice, _ms(triton_ms),
                 _ms(reference_ms), reason)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f} ms"
