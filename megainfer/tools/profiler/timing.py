"""Timing one operator call: warm-up, then calls timed one by one, the median.

Each call is timed by itself: CUDA events around it and a synchronize on CUDA, `perf_counter`
on the CPU. The median over calls shrugs off a neighbour's burst on a shared machine. What a
call finds in the caches is the caller's business: `operator_timing` rotates over as many
layers as a step would pass before coming back (see `layer_copies` there).
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

MIN_CALLS = 5  # calls timed at least, however slow one is
def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_call(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds of one call of fn, the device's queue drained."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    began = time.perf_counter()
    fn()
    return time.perf_counter() - began


def median_seconds(fn: Callable[[], object], device: torch.device, min_time_s: float, warmup: int = 2) -> float:
    """Median seconds of one call of fn: `warmup` untimed calls (kernel choice, JIT, allocator),
    then calls until at least `min_time_s` of calls and MIN_CALLS calls were timed."""
    for _ in range(warmup):
        fn()
    samples: list[float] = []
    while len(samples) < MIN_CALLS or sum(samples) < min_time_s:
        synchronize(device)
        samples.append(time_call(fn, device))
    return statistics.median(samples)
