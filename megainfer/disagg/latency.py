"""Latency histograms kept where the latencies happen (an attention node's step loop, in its
own process) as plain bucket counts, merged by the serving process when Prometheus scrapes."""

from __future__ import annotations

from bisect import bisect_left

from megainfer.messages import HistogramSnapshot

# M2N messages: tens of microseconds on shared memory up to milliseconds over TCP/RDMA.
M2N_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1, 1.0)


class LatencyHistogram:
    def __init__(self, bounds: tuple[float, ...] = M2N_BUCKETS) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last: above every bound
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        # Twice per round on an attention rank (376 rounds a step at the shipped plan): the
        # bucket by bisection in C, the first bound at or above `seconds` (Prometheus' `le`).
        self.counts[bisect_left(self.bounds, seconds)] += 1
        self.sum += seconds

    def snapshot(self) -> HistogramSnapshot:
        return HistogramSnapshot(list(self.bounds), list(self.counts), self.sum)


def merge(snapshots: list[HistogramSnapshot]) -> HistogramSnapshot:
    """Sum snapshots of histograms with the same bounds (one per node)."""
    if not snapshots:
        return HistogramSnapshot(list(M2N_BUCKETS), [0] * (len(M2N_BUCKETS) + 1))
    return HistogramSnapshot(snapshots[0].bounds, [sum(c) for c in zip(*(s.buckets for s in snapshots))],
                             sum(s.sum for s in snapshots))
