"""The Prometheus endpoint: vLLM's metric names and labels, per-request observations, the
engine's state at each scrape, promtool's lint."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from megainfer import Engine, SamplingParams
from megainfer.disagg.latency import LatencyHistogram, merge
from megainfer.engine_config import EngineConfig
from megainfer.messages import ErrorCode, FinishReason, HistogramSnapshot, RequestDelta, RequestMetrics
from megainfer.server.client import Client
from megainfer.server.engine_backend import EngineBackend
from megainfer.server.metrics import MetricsSnapshot, ServingMetrics
from megainfer.server.service import Server
from tests.helpers import scrape

MODEL = "tiny-demo"


class Snapshots:
    """A backend's metrics source with a fixed state."""

    def __init__(self, **fields) -> None:
        self.snapshot = MetricsSnapshot(**{"running": 0, "waiting": 0, "kv_cache_usage": 0.0,
                                           "expert_bytes_read": 0, **fields})

    def metrics_snapshot(self) -> MetricsSnapshot:
        return self.snapshot


def series(metrics: ServingMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """(sample name, sorted labels) -> value, read back through the text exposition format."""
    text = generate_latest(metrics.registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(table, name: str, **labels: str) -> float:
    return table[(name, tuple(sorted({"model_name": MODEL, **labels}.items())))]


def last(request_id: str, reason: FinishReason, metrics: RequestMetrics | None) -> RequestDelta:
    return RequestDelta(request_id, [7], "", True, reason, metrics=metrics)


@pytest.fixture()
def served():
    backend = EngineBackend(Engine("tiny-mixtral", EngineConfig(num_kv_blocks=64)))
    server = Server(backend, port=0, metrics_port=0).start()
    yield server
    server.stop(0)
    backend.close()


def test_observed_requests_fill_vllms_series():
    metrics = ServingMetrics(Snapshots(running=2, waiting=3, kv_cache_usage=0.25, expert_bytes_read=4096,
                                       num_preemptions=5, replicas=2), MODEL)
    metrics.observe_request(last("a", FinishReason.LENGTH, RequestMetrics(3, 4, 0.002, 0.02, 0.06, 0.082)),
                            0.022, 0.02, 0.082)
    metrics.observe_request(last("b", FinishReason.STOP, RequestMetrics(40, 1, 0.5, 0.03, 0.0, 0.53)),
                            0.53, None, 0.53)
    metrics.observe_request(last("c", FinishReason.ABORT, None), None, None, 0.2)  # cancelled while queued
    metrics.observe_request(RequestDelta.failure("d", "the deployment is re-wiring"), None, None, 1.0)
    metrics.observe_request(RequestDelta.failure("e", "bug", ErrorCode.INTERNAL), None, None, 1.0)
    for gap in (0.02, 0.02, 0.02):
        metrics.observe_token_gap(gap)
    m = series(metrics)

    assert {dict(labels)["model_name"] for _, labels in m} == {MODEL}  # every series names the model
    for reason, count in (("stop", 1), ("length", 1), ("abort", 1)):
        assert value(m, "megainfer:request_success_total", finished_reason=reason) == count
    assert value(m, "megainfer:request_failure_total", error_code="unavailable") == 1
    assert value(m, "megainfer:request_failure_total", error_code="internal") == 1
    assert value(m, "megainfer:prompt_tokens_total") == 43
    assert value(m, "megainfer:generation_tokens_total") == 5
    # Latencies: the served requests only; TTFT and TPOT where tokens came.
    assert value(m, "megainfer:e2e_request_latency_seconds_count") == 3
    assert value(m, "megainfer:e2e_request_latency_seconds_sum") == pytest.approx(0.812)
    assert value(m, "megainfer:time_to_first_token_seconds_count") == 2
    assert value(m, "megainfer:time_to_first_token_seconds_bucket", le="0.04") == 1
    assert value(m, "megainfer:request_time_per_output_token_seconds_count") == 1
    assert value(m, "megainfer:request_time_per_output_token_seconds_sum") == pytest.approx(0.02)
    assert value(m, "megainfer:inter_token_latency_seconds_count") == 3
    # The engine's own timings, from the requests that ran.
    for name, total in (("queue", 0.502), ("prefill", 0.05), ("decode", 0.06)):
        assert value(m, f"megainfer:request_{name}_time_seconds_count") == 2
        assert value(m, f"megainfer:request_{name}_time_seconds_sum") == pytest.approx(total)
    assert value(m, "megainfer:request_prompt_tokens_bucket", le="5.0") == 1
    assert value(m, "megainfer:request_prompt_tokens_bucket", le="50.0") == 2
    assert value(m, "megainfer:request_generation_tokens_sum") == 5
    # The backend's state at the scrape.
    assert value(m, "megainfer:num_requests_running") == 2 and value(m, "megainfer:num_requests_waiting") == 3
    assert value(m, "megainfer:kv_cache_usage_perc") == 0.25 and value(m, "megainfer:num_replicas") == 2
    assert value(m, "megainfer:num_preemptions_total") == 5
    assert value(m, "megainfer:expert_load_bytes_total") == 4096
    names = {name for name, _ in m}
    assert "megainfer:time_per_output_token_seconds_count" not in names  # vLLM's deprecated per-token name
    assert not any(name.startswith(("megainfer:m2n", "megainfer:router")) for name in names)  # none kept here


def test_every_label_value_exists_before_any_request():
    m = series(ServingMetrics(Snapshots(), MODEL))
    for reason in ("stop", "length", "abort"):
        assert value(m, "megainfer:request_success_total", finished_reason=reason) == 0
    for code in ErrorCode:
        assert value(m, "megainfer:request_failure_total", error_code=code.value) == 0


def test_observe_request_takes_the_last_delta():
    metrics = ServingMetrics(Snapshots(), MODEL)
    with pytest.raises(ValueError, match="not finished"):
        metrics.observe_request(RequestDelta("a", [1], "x"), 0.1, None, 0.1)


def _deployment_metrics() -> ServingMetrics:
    """Every family a deployment exports, with a sample in each."""
    wire = HistogramSnapshot([1e-4, 1e-3], [1, 2, 0], 0.0021)
    metrics = ServingMetrics(Snapshots(running=1, waiting=1, kv_cache_usage=0.5, expert_bytes_read=10,
                                       m2n_send=wire, m2n_receive_wait=wire, router_ttft_error=wire,
                                       num_preemptions=1), MODEL)
    metrics.observe_request(last("a", FinishReason.LENGTH, RequestMetrics(3, 4, 0.002, 0.02, 0.06, 0.082)),
                            0.022, 0.02, 0.082)
    metrics.observe_request(RequestDelta.failure("b", "gone"), None, None, 0.5)
    metrics.observe_token_gap(0.02)
    return metrics


@pytest.mark.skipif(shutil.which("promtool") is None,
                    reason="promtool is not on PATH (Debian's prometheus package ships it)")
def test_exposition_passes_promtool():
    text = generate_latest(_deployment_metrics().registry)
    out = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, timeout=60)
    problems = [line for line in (out.stdout + out.stderr).decode().splitlines() if line.strip()]
    # vLLM's `system:metric` names draw this note and nothing else may.
    assert all(line.endswith("metric names should not contain ':'") for line in problems), problems
    assert out.returncode == (3 if problems else 0), problems
    flagged = {line.split()[0] for line in problems}
    assert {"megainfer:prompt_tokens_total", "megainfer:m2n_send_latency_seconds"} <= flagged  # promtool read them
    # Without the colon, promtool has nothing to say.
    clean = subprocess.run(["promtool", "check", "metrics"], input=text.replace(b"megainfer:", b"megainfer_"),
                           capture_output=True, timeout=60)
    assert clean.returncode == 0 and not clean.stdout.strip() and not clean.stderr.strip(), clean


def test_metrics_of_a_served_engine_over_http():
    backend = EngineBackend(Engine("tiny-mixtral", EngineConfig(num_kv_blocks=64)))
    metrics = ServingMetrics(backend, "tiny-mixtral")
    port = metrics.serve("127.0.0.1", 0)
    try:
        params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
        for rid, prompt in (("a", [1, 2, 3]), ("b", [4, 5, 6, 7, 8])):
            stream = backend.submit(rid, prompt, params)
            first = prev = None
            while True:  # what a frontend does: time the deltas, observe the last
                delta = stream.get(30)
                assert delta is not None, "the engine stalled"
                now = time.monotonic()
                if delta.new_token_ids:
                    if prev is not None:
                        metrics.observe_token_gap(now - prev)
                    first, prev = first or now, now
                if delta.finished:
                    break
            metrics.observe_request(delta, first - stream.arrival, (prev - first) / 4, now - stream.arrival)
            assert delta.metrics is not None and delta.metrics.generation_tokens == 5
        m = scrape(port)
    finally:
        metrics.close()
        backend.close()
    label = '{model_name="tiny-mixtral"}'
    assert m['megainfer:request_success_total{finished_reason="length",model_name="tiny-mixtral"}'] == 2
    assert m[f"megainfer:prompt_tokens_total{label}"] == 8 and m[f"megainfer:generation_tokens_total{label}"] == 10
    assert m[f"megainfer:inter_token_latency_seconds_count{label}"] == 8
    assert m[f"megainfer:request_decode_time_seconds_count{label}"] == 2
    e2e, ttft = (m[f"megainfer:{name}_seconds_sum{label}"] for name in ("e2e_request_latency", "time_to_first_token"))
    assert e2e >= ttft
    assert m[f"megainfer:num_requests_running{label}"] == 0 and m[f"megainfer:num_requests_waiting{label}"] == 0
    assert m[f"megainfer:kv_cache_usage_perc{label}"] == 0  # both finished: their blocks are free
    assert m[f"megainfer:expert_load_bytes_total{label}"] > 0
    assert m[f"megainfer:num_preemptions_total{label}"] == 0  # 64 blocks hold both
    assert not any(k.startswith("megainfer:m2n") for k in m)  # a colocated engine has no M2N links


def test_grpc_requests_reach_the_metrics(served):
    client = Client(served.address)
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    for prompt in ([1, 2, 3], [4, 5, 6, 7, 8]):
        assert sum(len(r.token_ids) for r in client.generate(prompt, params)) == 5
    client.close()
    m = scrape(served.metrics_port)
    models = {k.split('model_name="')[1].split('"')[0] for k in m if 'model_name="' in k}
    assert len(models) == 1  # the served model's name, on every series
    label = f'{{model_name="{models.pop()}"}}'
    for name in ("time_to_first_token_seconds", "request_time_per_output_token_seconds",
                 "e2e_request_latency_seconds", "request_queue_time_seconds"):
        assert m[f"megainfer:{name}_count{label}"] == 2
    assert m[f"megainfer:generation_tokens_total{label}"] == 10


def test_metrics_port_in_use_is_a_clear_error(served):
    from megainfer.errors import ConfigError

    other = Server(served.backend, port=0, metrics_port=served.metrics_port)
    with pytest.raises(ConfigError, match="--metrics-port"):
        other.start()
    other.grpc.stop(0)


def test_latency_histograms_bucket_and_merge():
    a, b = LatencyHistogram((0.001, 0.01)), LatencyHistogram((0.001, 0.01))
    for s in (0.0005, 0.001, 0.005, 2.0):
        a.observe(s)
    b.observe(0.02)
    assert a.snapshot().buckets == [2, 1, 1]
    merged = merge([a.snapshot(), b.snapshot()])
    assert merged.buckets == [2, 1, 2] and merged.sum == pytest.approx(2.0265)


def test_router_prediction_error_histogram_is_exported():
    errors = LatencyHistogram((0.01, 0.1, 1.0))
    for s in (0.005, 0.05, 0.5, 3.0):
        errors.observe(s)
    source = Snapshots(running=1, waiting=2, kv_cache_usage=0.25, expert_bytes_read=10,
                       router_ttft_error=errors.snapshot())
    text = generate_latest(ServingMetrics(source, MODEL).registry).decode()
    name = "megainfer:router_ttft_prediction_error_seconds"
    assert f'{name}_bucket{{le="0.1",model_name="{MODEL}"}} 2.0' in text
    assert f'{name}_bucket{{le="+Inf",model_name="{MODEL}"}} 4.0' in text
    assert f'{name}_sum{{model_name="{MODEL}"}} 3.555' in text
    assert f'megainfer:num_requests_waiting{{model_name="{MODEL}"}} 2.0' in text


def test_bench_routing_needs_two_attention_nodes():
    out = subprocess.run([sys.executable, "-m", "megainfer", "bench", "routing", "deploy/plans/tiny-cpu.yaml"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "at least 2 attention nodes" in out.stderr and "Traceback" not in out.stderr


def test_expert_load_per_node_and_imbalance_per_layer_are_exposed():
    metrics = ServingMetrics(Snapshots(expert_node_pairs=[300.0, 100.0], expert_layer_imbalance=[1.5, 1.0]), MODEL)
    m = series(metrics)
    assert value(m, "megainfer:expert_node_load", expert_node="0") == 300
    assert value(m, "megainfer:expert_node_load", expert_node="1") == 100
    assert value(m, "megainfer:expert_layer_imbalance", layer="0") == 1.5
    assert value(m, "megainfer:expert_layer_imbalance", layer="1") == 1.0


def test_the_colocated_engine_reports_its_skewed_experts_imbalance_per_layer():
    """skewed-mixtral routes ~92% of its pairs to experts 0-3 of 8: its busiest expert stands
    well above the mean in every layer, from the engine's own window of routed tokens."""
    backend = EngineBackend(Engine("skewed-mixtral", EngineConfig(num_kv_blocks=64)))
    try:
        stream = backend.submit("r", [1, 2, 3, 4, 5, 6], SamplingParams(max_tokens=24, temperature=0.0))
        while not stream.get(10).finished:
            pass
        snap = backend.metrics_snapshot()
    finally:
        backend.close()
    assert len(snap.expert_layer_imbalance) == 4 and min(snap.expert_layer_imbalance) > 2.0
    assert snap.expert_node_pairs == []  # no expert nodes in a colocated engine
