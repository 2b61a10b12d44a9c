"""Prometheus metrics of a serving process (`--metrics-port`): request latencies observed as
requests finish, and the engine's state read from the backend at each scrape.

Names follow the `<system>:<metric>` convention vLLM's users already chart:
  megainfer:time_to_first_token_seconds       histogram, per request
  megainfer:time_per_output_token_seconds     histogram, per request (mean time between its tokens)
  megainfer:e2e_request_latency_seconds       histogram, per request
  megainfer:num_requests_running              gauge
  megainfer:num_requests_waiting              gauge
  megainfer:kv_cache_usage_perc               gauge, 0..1 (the fraction of KV blocks in use)
  megainfer:expert_load_bytes_total           counter, expert-weight bytes read
  megainfer:m2n_send_latency_seconds          histogram, one M2N send (deployments)
  megainfer:m2n_receive_wait_seconds          histogram, waiting for one expert node's answer (deployments)
  megainfer:router_ttft_prediction_error_seconds  histogram, |predicted - measured| TTFT (predictive router)
Each registry is the server's own, so several servers in one process do not collide.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from prometheus_client import CollectorRegistry, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from megainfer.messages import HistogramSnapshot

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


@dataclass
class MetricsSnapshot:
    """What a backend reports at each scrape: the engine's state (attention nodes summed in a
    deployment) and, where they exist, the histograms kept in other processes."""

    running: int
    waiting: int
    kv_cache_usage: float  # fraction of KV blocks in use over all nodes, 0..1
    expert_bytes_read: int  # cumulative
    kv_blocks: int = 0  # blocks the usage is a fraction of (to weigh replicas when summing)
    m2n_send: HistogramSnapshot | None = None  # deployments: one M2N send
    m2n_receive_wait: HistogramSnapshot | None = None  # deployments: the wait for one expert node's answer
    router_ttft_error: HistogramSnapshot | None = None  # predictive router: |predicted - measured| TTFT
    replicas: int = 1


class MetricsSource(Protocol):
    def metrics_snapshot(self) -> MetricsSnapshot: ...


class _BackendCollector:
    def __init__(self, source: MetricsSource) -> None:
        self.source = source

    def describe(self):
        return []  # collected live: nothing to check at registration

    def collect(self):
        snap = self.source.metrics_snapshot()
        for name, doc, value in (
                ("megainfer:num_requests_running", "Requests holding KV blocks and decoding.", snap.running),
                ("megainfer:num_requests_waiting", "Requests queued for admission.", snap.waiting),
                ("megainfer:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0..1).", snap.kv_cache_usage)):
            yield GaugeMetricFamily(name, doc, value=value)
        yield CounterMetricFamily("megainfer:expert_load_bytes", "Expert-weight bytes read by the experts' GEMMs.",
                                  value=snap.expert_bytes_read)
        for h, name, doc in ((snap.m2n_send, "megainfer:m2n_send_latency_seconds", "One M2N send."),
                             (snap.m2n_receive_wait, "megainfer:m2n_receive_wait_seconds",
                              "Waiting for one expert node's answer over M2N."),
                             (snap.router_ttft_error, "megainfer:router_ttft_prediction_error_seconds",
                              "|predicted - measured| TTFT of requests the predictive router placed.")):
            if h is None:
                continue
            cumulative, running = [], 0
            for bound, count in zip([*map(str, h.bounds), "+Inf"], h.buckets):
                running += count
                cumulative.append((bound, running))
            yield HistogramMetricFamily(name, doc, buckets=cumulative, sum_value=h.sum)


class ServingMetrics:
    def __init__(self, source: MetricsSource) -> None:
        self.registry = CollectorRegistry()
        self.ttft = Histogram("megainfer:time_to_first_token_seconds", "Arrival to first generated token.",
                              buckets=LATENCY_BUCKETS, registry=self.registry)
        self.tpot = Histogram("megainfer:time_per_output_token_seconds",
                              "Mean time between a request's generated tokens.", buckets=TOKEN_BUCKETS,
                              registry=self.registry)
        self.e2e = Histogram("megainfer:e2e_request_latency_seconds", "Arrival to last token.",
                             buckets=LATENCY_BUCKETS, registry=self.registry)
        self.registry.register(_BackendCollector(source))
        self._http = None

    def observe_request(self, ttft_s: float, tpot_s: float | None, e2e_s: float) -> None:
        self.ttft.observe(ttft_s)
        if tpot_s is not None:
            self.tpot.observe(tpot_s)
        self.e2e.observe(e2e_s)

    def serve(self, host: str, port: int) -> int:
        """Expose /metrics over HTTP; returns the port (useful with port 0)."""
        server, _ = start_http_server(port, addr=host, registry=self.registry)
        self._http = server
        return server.server_address[1]

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
