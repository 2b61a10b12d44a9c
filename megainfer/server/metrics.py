"""Prometheus metrics of a serving process: what each request did, observed once as it
finishes, and the engine's state read from the backend at each scrape. The HTTP frontend
serves `ServingMetrics.registry` at /metrics; `serve()` also exposes it on its own port
(`--metrics-port`).

Names are vLLM's with the `megainfer:` prefix, and every series carries vLLM's `model_name`
label (the served model name), so a vLLM Grafana dashboard charts megainfer once its
queries say `megainfer:` for `vllm:`. Times are in seconds, token counts in tokens.

Per request, observed by `observe_request` (the frontend calls it with the request's last delta;
a failed request counts in request_failure_total and the token counters only, never in a latency
histogram):
  megainfer:request_success_total{finished_reason}    counter: requests that ended with stop, length or abort
  megainfer:request_failure_total{error_code}         counter: requests that failed, by ErrorCode (unavailable,
                                                       internal); vLLM counts these as finished_reason="error"
  megainfer:prompt_tokens_total                        counter: prompt tokens prefilled
  megainfer:generation_tokens_total                    counter: tokens generated
  megainfer:time_to_first_token_seconds                histogram: arrival to the first generated token
  megainfer:request_time_per_output_token_seconds      histogram: a request's mean time between its tokens,
                                                       (last token - first token) / (tokens - 1)
  megainfer:e2e_request_latency_seconds                histogram: arrival to the last token
  megainfer:request_queue_time_seconds                 histogram: arrival to first scheduled (WAITING)
  megainfer:request_prefill_time_seconds               histogram: first scheduled to first token (PREFILL)
  megainfer:request_decode_time_seconds                histogram: first token to last token (DECODE)
  megainfer:request_prompt_tokens                      histogram: prompt length
  megainfer:request_generation_tokens                  histogram: tokens generated
Per token, observed by `observe_token_gap` (the frontend calls it for each delta after the first that
brings tokens):
  megainfer:inter_token_latency_seconds                histogram: time between two deltas of a request
At each scrape, from the backend's `MetricsSnapshot` (attention nodes summed in a deployment):
  megainfer:num_requests_running                       gauge: requests holding KV blocks and decoding
  megainfer:num_requests_waiting                       gauge: requests queued for admission
  megainfer:kv_cache_usage_perc                        gauge: fraction of KV blocks in use, 0..1
  megainfer:num_replicas                               gauge: model replicas serving (autoscaled deployments)
  megainfer:num_preemptions_total                      counter: requests preempted (recomputed later)
  megainfer:expert_load_bytes_total                    counter: expert-weight bytes read by the expert GEMMs
  megainfer:prefix_cache_queries_total                 counter: prompt tokens looked up in the prefix caches
  megainfer:prefix_cache_hits_total                    counter: of those, tokens found cached (vLLM's pair)
  megainfer:m2n_send_latency_seconds                   histogram: one M2N send (deployments)
  megainfer:m2n_receive_wait_seconds                   histogram: waiting for one expert node's answer
                                                       (deployments)
  megainfer:router_ttft_prediction_error_seconds       histogram: |predicted - measured| TTFT (predictive router)
  megainfer:kernel_mode{mode}                          gauge: nodes whose kernels run in each dispatch mode
                                                       (fastest: per shape, timed at start; triton, reference)
  megainfer:kernel_shapes{operator, implementation}    gauge: shapes decided at start, by the implementation
                                                       that runs them (kernels/startup.py)
  megainfer:kernel_compiles_while_serving_total        counter: Triton variants built after the warm-up (0)
  megainfer:expert_node_load{expert_node}              gauge: (token, expert) pairs each expert node computed
                                                       over the window of steps, its own count (deployments)
  megainfer:expert_layer_imbalance{layer}              gauge: busiest expert node (colocated: expert) over the
                                                       mean, per layer, over the window

`promtool check metrics` finds nothing in the exposition but "metric names should not contain
':'", which vLLM's names draw too (recording-rule style, kept for the dashboards). Each registry
is the server's own, so several servers in one process do not collide. prometheus_client adds a
`_created` gauge beside each counter and histogram unless PROMETHEUS_DISABLE_CREATED_SERIES=true
(the Dockerfile sets it, as vLLM's exposition has none).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from megainfer.messages import ErrorCode, FinishReason, HistogramSnapshot, RequestDelta
from megainfer.request_group import Completion, RequestGroup

if TYPE_CHECKING:
    from kernels.startup import KernelReport

MODEL_LABEL = "model_name"  # vLLM's label for the served model

# vLLM's bounds, widened downwards where a small MoE on one host answers in milliseconds.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                     2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                   50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# 1, 2, 5, 10, ... tokens (vLLM's 1-2-5 series), up to a million-token context.
TOKEN_COUNT_BUCKETS = tuple(m * 10 ** e for e in range(7) for m in (1, 2, 5) if m * 10 ** e <= 1_000_000)

SUCCESS_REASONS = (FinishReason.STOP, FinishReason.LENGTH, FinishReason.ABORT)


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
    num_preemptions: int = 0  # cumulative preemptions, summed over attention nodes (EngineStats.num_preemptions)
    kernels: list[KernelReport] = field(default_factory=list)  # per engine or attention node, decided at its start
    kernel_builds_while_serving: int = 0  # Triton variants built after start, summed (want 0)
    # Over the engines' windows of routed tokens (EngineConfig.expert_load_window steps): the
    # (token, expert) pairs each expert node takes under the placement serving now (deployments;
    # empty for the colocated engine), and per layer the busiest expert node (deployments) or
    # expert (colocated) over the mean.
    expert_node_pairs: list[float] = field(default_factory=list)
    expert_layer_imbalance: list[float] = field(default_factory=list)
    # Cumulative, summed over attention nodes: prompt tokens looked up in the prefix caches and
    # of those the tokens found cached (EngineStats.prefix_cache_queries/hits).
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0


def _expert_families(snap: MetricsSnapshot, labels: list[str]):
    """Expert load over the engines' windows: per expert node, and the imbalance per layer."""
    if snap.expert_node_pairs:
        load = GaugeMetricFamily("megainfer:expert_node_load", "(token, expert) pairs each expert node computed over "
                                 "the attention nodes' window of steps, as the expert nodes counted them.",
                                 labels=[MODEL_LABEL, "expert_node"])
        for node, pairs in enumerate(snap.expert_node_pairs):
            load.add_metric([*labels, str(node)], pairs)
        yield load
    if snap.expert_layer_imbalance:
        family = GaugeMetricFamily("megainfer:expert_layer_imbalance", "Per layer, the busiest expert node "
                                   "(deployments; the busiest expert in a colocated engine) over the mean, over the "
                                   "window of steps (1 is even).", labels=[MODEL_LABEL, "layer"])
        for layer, value in enumerate(snap.expert_layer_imbalance):
            family.add_metric([*labels, str(layer)], value)
        yield family


class MetricsSource(Protocol):
    def metrics_snapshot(self) -> MetricsSnapshot: ...


def _kernel_families(snap: MetricsSnapshot, labels: list[str]):
    """Which implementation the kernels run (decided at each node's start): the dispatch mode of
    each node, the shapes per operator and implementation, and the variants built while serving."""
    modes = GaugeMetricFamily("megainfer:kernel_mode", "Nodes whose kernels run in each dispatch mode (fastest: "
                              "per shape, timed at start; triton or reference: forced by MEGAINFER_KERNELS, or "
                              "the CPU's references).", labels=[MODEL_LABEL, "mode"])
    shapes = GaugeMetricFamily("megainfer:kernel_shapes", "Shapes decided at start, by operator and the implementation "
                               "that runs them.", labels=[MODEL_LABEL, "operator", "implementation"])
    mode_counts: dict[str, int] = {}
    shape_counts: dict[tuple[str, str], int] = {}
    for report in snap.kernels:
        mode_counts[report.mode] = mode_counts.get(report.mode, 0) + 1
        for op, counts in report.by_operator().items():
            for impl, n in counts.items():
                shape_counts[op, impl] = shape_counts.get((op, impl), 0) + n
    for mode, n in sorted(mode_counts.items()):
        modes.add_metric([*labels, mode], n)
    for (op, impl), n in sorted(shape_counts.items()):
        shapes.add_metric([*labels, op, impl], n)
    builds = CounterMetricFamily("megainfer:kernel_compiles_while_serving", "Triton kernel variants built after the "
                                 "start-up warm-up: each stalled a step (0 expected).", labels=[MODEL_LABEL])
    builds.add_metric(labels, snap.kernel_builds_while_serving)
    return [modes, shapes, builds]


class _BackendCollector:
    """The backend's state, read at each scrape (nothing is stored between scrapes)."""

    def __init__(self, source: MetricsSource, model_name: str) -> None:
        self.source = source
        self.model_name = model_name

    def describe(self):
        return []  # collected live: nothing to check at registration

    def collect(self):
        snap = self.source.metrics_snapshot()
        labels = [self.model_name]
        for name, doc, value in (
                ("megainfer:num_requests_running", "Number of requests holding KV blocks and decoding.",
                 snap.running),
                ("megainfer:num_requests_waiting", "Number of requests queued for admission.", snap.waiting),
                ("megainfer:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 means 100 percent).",
                 snap.kv_cache_usage),
                ("megainfer:num_replicas", "Number of model replicas serving.", snap.replicas)):
            family = GaugeMetricFamily(name, doc, labels=[MODEL_LABEL])
            family.add_metric(labels, value)
            yield family
        for name, doc, value in (
                ("megainfer:num_preemptions", "Cumulative number of requests preempted by the schedulers.",
                 snap.num_preemptions),
                ("megainfer:expert_load_bytes", "Cumulative expert-weight bytes read by the experts' GEMMs.",
                 snap.expert_bytes_read),
                ("megainfer:prefix_cache_queries", "Prefix cache queries, in terms of prompt tokens looked up.",
                 snap.prefix_cache_queries),
                ("megainfer:prefix_cache_hits", "Prefix cache hits, in terms of prompt tokens found cached.",
                 snap.prefix_cache_hits)):
            family = CounterMetricFamily(name, doc, labels=[MODEL_LABEL])  # exposed with the _total suffix
            family.add_metric(labels, value)
            yield family
        yield from _kernel_families(snap, labels)
        yield from _expert_families(snap, labels)
        for h, name, doc in ((snap.m2n_send, "megainfer:m2n_send_latency_seconds",
                              "Time of one M2N send, in seconds."),
                             (snap.m2n_receive_wait, "megainfer:m2n_receive_wait_seconds",
                              "Time waiting for one expert node's answer over M2N, in seconds."),
                             (snap.router_ttft_error, "megainfer:router_ttft_prediction_error_seconds",
                              "Absolute error of the predictive router's TTFT prediction, in seconds.")):
            if h is None:
                continue
            cumulative, running = [], 0
            for bound, count in zip([*map(floatToGoString, h.bounds), "+Inf"], h.buckets):
                running += count
                cumulative.append((bound, running))
            family = HistogramMetricFamily(name, doc, labels=[MODEL_LABEL])
            family.add_metric(labels, cumulative, sum_value=h.sum)
            yield family


class ServingMetrics:
    """One serving process's metrics (see the module docstring for what each one measures)."""

    def __init__(self, source: MetricsSource, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name

        def histogram(name: str, doc: str, buckets: tuple[float, ...]):
            return Histogram(name, doc, [MODEL_LABEL], buckets=buckets, registry=self.registry).labels(model_name)

        def counter(name: str, doc: str):
            return Counter(name, doc, [MODEL_LABEL], registry=self.registry).labels(model_name)

        self.prompt_tokens = counter("megainfer:prompt_tokens", "Number of prompt tokens prefilled.")
        self.generation_tokens = counter("megainfer:generation_tokens", "Number of tokens generated.")
        success = Counter("megainfer:request_success", "Count of requests that finished (stop, length or abort).",
                          [MODEL_LABEL, "finished_reason"], registry=self.registry)
        # Every label value exists from the start, so rate() sees 0 rather than no series.
        self.success = {reason: success.labels(model_name, reason.value) for reason in SUCCESS_REASONS}
        failure = Counter("megainfer:request_failure", "Count of requests that failed, by error code.",
                          [MODEL_LABEL, "error_code"], registry=self.registry)
        self.failure = {code: failure.labels(model_name, code.value) for code in ErrorCode}
        self.ttft = histogram("megainfer:time_to_first_token_seconds",
                              "Histogram of time from arrival to the first generated token, in seconds.",
                              TTFT_BUCKETS)
        self.tpot = histogram("megainfer:request_time_per_output_token_seconds",
                              "Histogram of each request's mean time between its generated tokens, in seconds.",
                              TOKEN_GAP_BUCKETS)
        self.itl = histogram("megainfer:inter_token_latency_seconds",
                             "Histogram of the time between two streamed token deltas of a request, in seconds.",
                             TOKEN_GAP_BUCKETS)
        self.e2e = histogram("megainfer:e2e_request_latency_seconds",
                             "Histogram of time from arrival to the last token, in seconds.", REQUEST_BUCKETS)
        self.queue = histogram("megainfer:request_queue_time_seconds",
                               "Histogram of time spent waiting to be scheduled (WAITING), in seconds.",
                               REQUEST_BUCKETS)
        self.prefill = histogram("megainfer:request_prefill_time_seconds",
                                 "Histogram of time from first scheduled to the first token (PREFILL), in seconds.",
                                 REQUEST_BUCKETS)
        self.decode = histogram("megainfer:request_decode_time_seconds",
                                "Histogram of time from the first token to the last (DECODE), in seconds.",
                                REQUEST_BUCKETS)
        self.request_prompt_tokens = histogram("megainfer:request_prompt_tokens",
                                               "Histogram of the number of prompt tokens per request.",
                                               TOKEN_COUNT_BUCKETS)
        self.request_generation_tokens = histogram("megainfer:request_generation_tokens",
                                                   "Histogram of the number of generated tokens per request.",
                                                   TOKEN_COUNT_BUCKETS)
        self.registry.register(_BackendCollector(source, model_name))
        self._http = None

    def observe_request(self, final: RequestDelta, ttft_s: float | None, tpot_s: float | None,
                        e2e_s: float) -> None:
        """One request, once, from its last delta. `ttft_s` is None when no token came, `tpot_s`
        when fewer than two did; `final.metrics` is None for a request that failed before it ran.
        A failed request is counted in request_failure_total and in no latency histogram (its
        times would blur the served requests'); the tokens any request computed count."""
        if not final.finished or final.finish_reason is None:
            raise ValueError(f"observe_request takes a request's last delta; {final.request_id}'s is not finished")
        m = final.metrics
        if m is not None:
            self.prompt_tokens.inc(m.prompt_tokens)
            self.generation_tokens.inc(m.generation_tokens)
        if final.finish_reason is FinishReason.ERROR:
            self.failure[final.error_code or ErrorCode.INTERNAL].inc()
            return
        self.success[final.finish_reason].inc()
        self.e2e.observe(e2e_s)
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
        if tpot_s is not None:
            self.tpot.observe(tpot_s)
        if m is not None:
            self.queue.observe(m.queued_s)
            self.prefill.observe(m.prefill_s)
            self.decode.observe(m.decode_s)
            self.request_prompt_tokens.observe(m.prompt_tokens)
            self.request_generation_tokens.observe(m.generation_tokens)

    def observe_token_gap(self, seconds: float) -> None:
        """The time between two deltas of one request that both brought tokens (inter-token latency)."""
        self.itl.observe(seconds)

    def observe_completion(self, c: Completion, final: RequestDelta, now: float) -> None:
        """A request group's completion as it ends (`observe_request` with its own timing)."""
        self.observe_request(final, c.ttft_s(), c.tpot_s(), now - c.started_at)

    def serve(self, host: str, port: int) -> int:
        """Expose /metrics over HTTP on a port of its own; returns the port (useful with port 0)."""
        server, _ = start_http_server(port, addr=host, registry=self.registry)
        self._http = server
        return server.server_address[1]

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None


def take_delta(metrics: ServingMetrics | None, group: RequestGroup, c: Completion, delta: RequestDelta,
               now: float) -> list[tuple[Completion, RequestDelta]]:
    """`group.arrived(c, delta)` as a server takes it: the token gap observed, and the
    completion's end, once (a delta passed over after its first last delta counts for nothing).
    Returns what to show now."""
    shown, gap = group.arrived(c, delta, now)
    if metrics is not None:
        if gap is not None:
            metrics.observe_token_gap(gap)
        if delta.finished and c.last is delta:
            metrics.observe_completion(c, delta, now)
    return shown
