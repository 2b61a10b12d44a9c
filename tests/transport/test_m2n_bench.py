"""The microbenchmark harness in real processes: every pattern, the floor and the baseline."""

from __future__ import annotations

import json
import math

import pytest

from tests.helpers import megainfer
from transport.bench import BenchSpec, measure
from transport.nixl import available as nixl_available

NIXL_OK, NIXL_REASON = nixl_available()


@pytest.mark.parametrize("backend, pattern, m, n", [
    ("shm", "m2n", 2, 2), ("tcp", "one-to-n", 1, 3), ("shm", "ping-pong", 1, 1), ("tcp", "ping-pong", 1, 1),
    # nixl's m2n pattern and duplex run with -m slow (~24 s): its ping-pong keeps the bench's nixl
    # path in the default run, and tests/transport covers the nixl exchange itself.
    pytest.param("nixl", "m2n", 2, 2, marks=[pytest.mark.skipif(not NIXL_OK, reason=NIXL_REASON), pytest.mark.slow]),
    pytest.param("nixl", "ping-pong", 1, 1, marks=pytest.mark.skipif(not NIXL_OK, reason=NIXL_REASON)),
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
    (dict(pattern="ping-pong", duplex=True), "--duplex runs the m2n pattern"),
])
def test_bench_spec_validation(kwargs, match):
    base = dict(backend="shm", senders=1, receivers=1, sizes=[4096])
    with pytest.raises(ValueError, match=match):
        BenchSpec(**{**base, **kwargs})


def test_cli_writes_the_documented_json_and_one_chart_for_every_backend(tmp_path):
    """Two backends in one invocation (nixl's own runs are the pattern and duplex tests')."""
    report, chart = tmp_path / "m2n.json", tmp_path / "m2n.png"
    backends = "shm,tcp"
    out = megainfer("bench", "m2n", "--backend", backends, "--senders", "1", "--receivers", "2", "--sizes", "4K,64K",
                    "--iters", "40", "--warmup", "5", "--baseline", "torch", "--json", str(report), "--plot", str(chart))
    assert out.returncode == 0, out.stderr
    assert "GB/s of floor" in out.stdout and "baseline (torch over gloo)" in out.stdout
    for backend in backends.split(","):
        assert f"M2N over {backend}:" in out.stdout and f"floor (floor over {backend})" in out.stdout
    data = json.loads(report.read_text())
    assert data["backend"] == backends and data["machine"]["cores"] >= 1
    assert sorted({r["backend"] for r in data["results"]}) == sorted(backends.split(","))
    assert [r["bytes"] for r in data["baseline"]] == [4096, 65536]
    for key in ("results", "floor"):
        assert [r["bytes"] for r in data[key]] == [4096, 65536] * len(backends.split(","))
    assert set(data["results"][0]) == {"backend", "pattern", "senders", "receivers", "bytes", "duplex", "iters",
                                       "p50_us", "p99_us", "p999_us", "gbps", "msg_rate"}
    assert chart.stat().st_size > 10_000


@pytest.mark.parametrize("backend", ["shm", "tcp", pytest.param("nixl", marks=[pytest.mark.skipif(
    not NIXL_OK, reason=NIXL_REASON), pytest.mark.slow])])
def test_duplex_moves_both_directions_for_m2n_floor_and_torch(backend):
    spec = BenchSpec(backend=backend, senders=2, receivers=2, sizes=[65536], iters=20, warmup=2, duplex=True)
    # torch's baseline is gloo over TCP whatever --backend says: measured once, beside shm.
    for system in ("m2n", "floor", "torch") if backend == "shm" else ("m2n", "floor"):
        (r,) = measure(system, spec)
        assert r.duplex and r.iters == 20 and 0 < r.p50_us <= r.p99_us
        # both directions of the four pairs every iteration
        assert r.msg_rate * 0.999 <= r.gbps * 1e9 / 65536 <= r.msg_rate * 1.001
    assert spec.messages_per_iteration() == 8


def test_large_sizes_move_the_same_bytes_not_the_same_count():
    spec = BenchSpec(backend="shm", senders=1, receivers=1, sizes=[1 << 20, 16 << 20], iters=2000, warmup=100)
    assert spec.iterations(1 << 20) == (100, 2000)
    assert spec.iterations(16 << 20) == (6, 125)
    assert BenchSpec(backend="shm", senders=1, receivers=1, sizes=[16 << 20], iters=200).iterations(16 << 20)[1] == 50


@pytest.mark.parametrize("args, message", [
    (["--sizes", "4K,huge"], "is not a size like"),
    (["--pattern", "ping-pong", "--senders", "2"], "ping-pong pattern runs 1 sender"),
    (["--backend", "rdma"], "--backend rdma: "),
    (["--backend", "shm,carrier-pigeon"], "choose from shm, tcp, rdma, nixl"),
    (["--backend", "torch,shm"], "--backend torch runs alone"),
    (["--pattern", "ping-pong", "--duplex"], "--duplex runs the m2n pattern"),
])
def test_cli_bad_input_is_one_line(args, message):
    out = megainfer("bench", "m2n", *args)
    assert out.returncode == 2 and message in out.stderr and "Traceback" not in out.stderr
