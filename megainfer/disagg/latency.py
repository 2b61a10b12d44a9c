"""Latency histograms kept where the latencies happen (an attention node's step loop, in its
own process) as plain bucket counts, merged by the serving process when Prometheus scrapes."""

from __future__ import annotations

# M2N messages: tens of microseconds on shared memory up to milliseconds over TCP/RDMA.
M2N_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1, 1.0)


class LatencyHistogram:
    def __init__(self, bounds: tuple[float, ...] = M2N_BUCKETS) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last: above every bound
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        for i, bound in enumerate(self.bounds):
            if seconds <= bound:
                self.counts[i] += 1
                break
        else:
            self.counts[-1] += 1
        self.sum += seconds

    def snapshot(self) -> dict:
        return {"bounds": list(self.bounds), "buckets": list(self.counts), "sum": self.sum}


def merge(snapshots: list[dict]) -> dict:
    """Sum snapshots of histograms with the same bounds (one per node)."""
    if not snapshots:
        return {"bounds": list(M2N_BUCKETS), "buckets": [0] * (len(M2N_BUCKETS) + 1), "sum": 0.0}
    return {"bounds": snapshots[0]["bounds"], "buckets": [sum(c) for c in zip(*(s["buckets"] for s in snapshots))],
            "sum": sum(s["sum"] for s in snapshots)}
