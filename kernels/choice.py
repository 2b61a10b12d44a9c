"""On a GPU, per shape bucket, the faster of a Triton kernel and its torch reference.

A bucket is the op, the dtype and the sizes that decide the work, each rounded up to a power
of two. The first call in a bucket runs both implementations (warm-up, which absorbs
Triton's compile, then a few reps timed), keeps the faster for the rest of the process, logs
the choice with both times, and returns the winner's output. Time is wall time between two
device synchronisations, so a reference that synchronises the host itself (a `.tolist()`, a
`nonzero`) pays for it. That first call synchronises; later calls in the bucket cost a dict
lookup. A Triton kernel that fails to build for this GPU (a tile over its shared memory,
say) loses, and the log says why; a reference that fails (out of memory gathering a large
batch's pages) loses the same way.
While a CUDA graph is being captured nothing is timed (timing synchronises): the reference
runs and nothing is decided.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable
from typing import Any

import torch

log = logging.getLogger("kernels")

TRITON, REFERENCE = "triton", "reference"


def bucket(n: int) -> int:
    """n rounded up to a power of two (0 stays 0): calls within 2x of each other share a choice."""
    return 0 if n <= 0 else 1 << (int(n) - 1).bit_length()


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

    def fixed(self, key: Hashable, triton_fn: Callable[[], Any], reference_fn: Callable[[], Any]) -> Any:
        """The Triton kernel without timing (ops whose choice must not vary between processes);
        the reference only where Triton cannot build for this GPU."""
        if self.choices.get(key) == REFERENCE:
            return reference_fn()
        try:
            out = triton_fn()
        except Exception as exc:
            self.choices[key] = REFERENCE
            log.warning("kernels %s: the Triton kernel failed (%s: %s); the torch reference runs instead", key,
                        type(exc).__name__, exc)
            return reference_fn()
        self.choices[key] = TRITON
        return out

    def _decide(self, key: Hashable, triton_fn: Callable[[], Any], reference_fn: Callable[[], Any]) -> Any:
        try:
            reference_ms, reference_out = self.timer(reference_fn, self.reps, self.warmup)
        except torch.cuda.OutOfMemoryError as exc:  # a large batch's gathered pages: Triton pages in place
            self.choices[key] = TRITON
            log.warning("kernels %s: the torch reference ran out of memory (%s); the Triton kernel runs", key, exc)
            return triton_fn()
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
