"""The Prometheus endpoint: metric names, per-request latencies and the engine's state."""

from __future__ import annotations

import pytest

from megainfer import Engine, SamplingParams
from megainfer.config import EngineConfig
from megainfer.disagg.latency import LatencyHistogram, merge
from megainfer.server.client import Client
from megainfer.server.engine_backend import EngineBackend
from megainfer.server.service import Server
from tests.helpers import scrape


@pytest.fixture()
def served():
    backend = EngineBackend(Engine("tiny-mixtral", EngineConfig(num_kv_blocks=64)))
    server = Server(backend, port=0, metrics_port=0).start()
    yield server
    server.stop(0)
    backend.close()


def test_metrics_endpoint_names_and_values(served):
    client = Client(served.address)
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    for prompt in ([1, 2, 3], [4, 5, 6, 7, 8]):
        assert sum(len(r.token_ids) for r in client.generate(prompt, params)) == 5
    client.close()
    m = scrape(served.metrics_port)
    for name in ("time_to_first_token_seconds", "time_per_output_token_seconds", "e2e_request_latency_seconds"):
        assert m[f"megainfer:{name}_count"] == 2
        assert m[f"megainfer:{name}_sum"] > 0
    assert m['megainfer:time_to_first_token_seconds_bucket{le="+Inf"}'] == 2
    assert m["megainfer:e2e_request_latency_seconds_sum"] >= m["megainfer:time_to_first_token_seconds_sum"]
    assert m["megainfer:num_requests_running"] == 0 and m["megainfer:num_requests_waiting"] == 0
    assert m["megainfer:kv_cache_usage_perc"] == 0  # both finished: their blocks are free
    assert m["megainfer:expert_load_bytes_total"] > 0
    assert not any(k.startswith("megainfer:m2n") for k in m)  # a colocated engine has no M2N links


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


def _bench_serve(*args):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "megainfer", "bench", "serve", *args], capture_output=True,
                          text=True, timeout=300)


def test_bench_serve_prints_the_vllm_block_and_writes_json(served, tmp_path):
    import json

    out = _bench_serve("--server", served.address, "--num-prompts", "6", "--input-len", "16", "--output-len", "8",
                       "--request-rate", "20", "--goodput", "ttft:60000", "tbt:60000", "--json",
                       str(tmp_path / "s.json"))
    assert out.returncode == 0, out.stderr
    for line in ("Serving Benchmark Result", "Successful requests:", "Request goodput (req/s):", "Mean TTFT (ms):",
                 "P99 TPOT (ms):", "Median ITL (ms):", "P99 E2EL (ms):", "Peak concurrent requests:"):
        assert line in out.stdout
    data = json.loads((tmp_path / "s.json").read_text())
    assert data["successful_requests"] == 6 and data["failed_requests"] == 0
    assert data["total_generated_tokens"] == 6 * 8 and data["total_input_tokens"] == 6 * 16
    assert 0 < data["mean_ttft_ms"] <= data["mean_e2el_ms"] and data["request_goodput"] > 0
    assert 1 <= data["max_concurrent_requests"] <= 6
    # The served requests reached the metrics too.
    assert scrape(served.metrics_port)["megainfer:e2e_request_latency_seconds_count"] == 6


@pytest.mark.parametrize("args, message", [
    (("--goodput", "latency:5"), "--goodput"),
    (("--request-rate", "0"), "--request-rate"),
    (("--dataset", "nope.jsonl"), "neither a built-in workload"),
])
def test_bench_serve_errors_are_one_line(served, args, message):
    out = _bench_serve("--server", served.address, "--num-prompts", "2", *args)
    assert out.returncode == 2 and message in out.stderr and "Traceback" not in out.stderr


def test_bench_serve_without_a_server():
    out = _bench_serve("--server", "127.0.0.1:1", "--num-prompts", "1")
    assert out.returncode == 2 and "no megainfer server answers" in out.stderr and "Traceback" not in out.stderr


def test_router_prediction_error_histogram_is_exported():
    from prometheus_client import generate_latest

    from megainfer.server.metrics import MetricsSnapshot, ServingMetrics

    errors = LatencyHistogram((0.01, 0.1, 1.0))
    for s in (0.005, 0.05, 0.5, 3.0):
        errors.observe(s)

    class Source:
        def metrics_snapshot(self):
            return MetricsSnapshot(running=1, waiting=2, kv_cache_usage=0.25, expert_bytes_read=10,
                                   router_ttft_error=errors.snapshot())

    text = generate_latest(ServingMetrics(Source()).registry).decode()
    name = "megainfer:router_ttft_prediction_error_seconds"
    assert f'{name}_bucket{{le="0.1"}} 2.0' in text and f'{name}_bucket{{le="+Inf"}} 4.0' in text
    assert f"{name}_sum 3.555" in text and "megainfer:num_requests_waiting 2.0" in text


def test_bench_serve_random_range_ratio_mixes_lengths():
    from megainfer.bench.serve_bench import ServeBenchSpec, workload

    reqs = workload(ServeBenchSpec(server="", num_prompts=400, input_len=200, output_len=20, random_range_ratio=0.5,
                                   request_rate=5.0))
    ins = [r.input_len for r in reqs]
    assert min(ins) >= 100 and max(ins) <= 300 and len(set(ins)) > 50
    assert all(10 <= r.output_len <= 30 for r in reqs)
    with pytest.raises(Exception, match="random-range-ratio"):
        workload(ServeBenchSpec(server="", random_range_ratio=1.5))


def test_bench_serve_mixed_dataset_makes_a_share_of_prompts_long():
    from megainfer.bench.serve_bench import ServeBenchSpec, workload

    reqs = workload(ServeBenchSpec(server="", dataset="mixed", num_prompts=1000, input_len=48, long_input_len=1024,
                                   long_fraction=0.3, random_range_ratio=0.25, output_len=16, request_rate=5.0))
    long = [r.input_len for r in reqs if r.input_len > 60]
    short = [r.input_len for r in reqs if r.input_len <= 60]
    assert 0.25 < len(long) / len(reqs) < 0.35
    assert min(long) >= 768 and max(long) <= 1280 and min(short) >= 36
    with pytest.raises(Exception, match="long-fraction"):
        workload(ServeBenchSpec(server="", dataset="mixed", long_fraction=0.0))


def test_bench_routing_needs_two_attention_nodes():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "megainfer", "bench", "routing", "deploy/plans/tiny-cpu.yaml"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "at least 2 attention nodes" in out.stderr and "Traceback" not in out.stderr
