"""On a GPU, per shape bucket, the faster of a Triton kernel and its torch reference.

A bucket is the op, the dtype and the sizes that decide the work, each rounded up to a power
of two. The first call in a bucket runs both implementations (warm-up, which absorbs
Triton's compile, then a few reps timed with CUDA events), keeps the faster for the rest of
the process, logs the choice with both times, and returns the winner's output. That first
call synchronises once; later calls in the bucket cost a dict lookup. A Triton kernel that
fails to build for this GPU (a tile over its shared memory, say) loses, and the log says why.
While a CUDA graph is being captured nothing is timed (timing synchronises): the reference
runs and nothing is decided.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable
from typing import Any

import torch

log = logging.getLogger("kernels")

TRITON, REFERENCE = "triton", "reference"


def bucket(n: int) -> int:
    """n rounded up to a power of two (0 stays 0): calls within 2x of each other share a choice."""
    return 0 if n <= 0 else 1 << (int(n) - 1).bit_length()


def cuda_time_ms(fn: Callable[[], Any], reps: int, warmup: int) -> tuple[float, Any]:
    """(mean milliseconds per call over `reps` after `warmup` calls, the last call's output)."""
    out = None
    for _ in range(warmup):
        out = fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        out = fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps, out


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class ShapeChoice:
    """Which implementation each shape bucket takes, decided by timing once."""

    def __init__(self, timer: Callable[[Callable[[], Any], int, int], tuple[float, Any]] = cuda_time_ms,
                 reps: int = 5, warmup: int = 2):
        self.timer, self.reps, self.warmup = timer, reps, warmup
        self.choices: dict[Hashable, str] = {}  # bucket -> TRITON or REFERENCE

    def run(self, key: Hashable, triton_fn: Callable[[], Any], reference_fn: Callable[[], Any]) -> Any:
        choice = self.choices.get(key)
        if choice == TRITON:
            return triton_fn()
        if choice == REFERENCE or _capturing():
            return reference_fn()
        return self._decide(key, triton_fn, reference_fn)

    def _decide(self, key: Hashable, triton_fn: Callable[[], Any], reference_fn: Callable[[], Any]) -> Any:
        reference_ms, reference_out = self.timer(reference_fn, self.reps, self.warmup)
        try:
            triton_ms, triton_out = self.timer(triton_fn, self.reps, self.warmup)
        except Exception as exc:  # compile or launch failures on this GPU: the reference stays correct
            self.choices[key] = REFERENCE
            log.warning("kernels %s: the Triton kernel failed (%s: %s); the torch reference runs instead", key,
                        type(exc).__name__, exc)
            return reference_out
        choice = TRITON if triton_ms < reference_ms else REFERENCE
        self.choices[key] = choice
        log.info("kernels %s: %s (Triton %.3f ms, torch reference %.3f ms per call)", key, choice, triton_ms,
                 reference_ms)
        return triton_out if choice == TRITON else reference_out
