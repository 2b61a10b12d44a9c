"""The microbenchmark harness in real processes: every pattern, the floor and the baseline."""

from __future__ import annotations

import json
import math

import pytest

from tests.helpers import megainfer
from transport.bench import BenchSpec, measure


@pytest.mark.parametrize("backend, pattern, m, n", [
    ("shm", "m2n", 2, 2), ("tcp", "one-to-n", 1, 3), ("shm", "ping-pong", 1, 1), ("tcp", "ping-pong", 1, 1),
])
def test_patterns_run_for_m2n_and_its_floor(backend, pattern, m, n):
    spec = BenchSpec(backend=backend, senders=m, receivers=n, sizes=[4096, 65536], iters=30, warmup=5, pattern=pattern)
    for system in ("m2n", "floor"):
        results = measure(system, spec)
        assert [r.bytes for r in results] == [4096, 65536]
        for r in results:
            assert (r.system, r.pattern, r.senders, r.receivers) == (system, pattern, m, n)
            assert 0 < r.p50_us <= r.p99_us <= r.p999_us and math.isfinite(r.p999_us)
            assert r.gbps > 0 and r.msg_rate > 0


def test_torch_baseline_runs_the_same_exchange():
    spec = BenchSpec(backend="shm", senders=1, receivers=2, sizes=[8192], iters=20, warmup=3, pattern="m2n")
    (result,) = measure("torch", spec)
    assert result.system == "torch" and result.p50_us > 0 and result.gbps > 0


@pytest.mark.parametrize("kwargs, match", [
    (dict(pattern="ping-pong", senders=2), "ping-pong pattern runs 1 sender"),
    (dict(pattern="one-to-n", senders=2), "exactly one sender"),
    (dict(sizes=[4]), "at least 8 bytes"),
])
def test_bench_spec_validation(kwargs, match):
    base = dict(backend="shm", senders=1, receivers=1, sizes=[4096])
    with pytest.raises(ValueError, match=match):
        BenchSpec(**{**base, **kwargs})


def test_cli_writes_the_documented_json_and_plot(tmp_path):
    report, chart = tmp_path / "m2n.json", tmp_path / "m2n.png"
    out = megainfer("bench", "m2n", "--backend", "shm", "--senders", "1", "--receivers", "2", "--sizes", "4K,64K",
                    "--iters", "40", "--warmup", "5", "--baseline", "torch", "--json", str(report), "--plot", str(chart))
    assert out.returncode == 0, out.stderr
    assert "GB/s of floor" in out.stdout and "baseline (torch)" in out.stdout
    data = json.loads(report.read_text())
    assert data["backend"] == "shm" and data["machine"]["cores"] >= 1
    for key in ("results", "baseline", "floor"):
        assert [r["bytes"] for r in data[key]] == [4096, 65536]
        assert set(data[key][0]) == {"pattern", "senders", "receivers", "bytes", "p50_us", "p99_us", "p999_us",
                                     "gbps", "msg_rate"}
    assert chart.stat().st_size > 10_000


@pytest.mark.parametrize("args, message", [
    (["--sizes", "4K,huge"], "is not a size like"),
    (["--pattern", "ping-pong", "--senders", "2"], "ping-pong pattern runs 1 sender"),
    (["--backend", "rdma"], "--backend rdma: "),
])
def test_cli_bad_input_is_one_line(args, message):
    out = megainfer("bench", "m2n", *args)
    assert out.returncode == 2 and message in out.stderr and "Traceback" not in out.stderr
