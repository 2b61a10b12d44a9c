"""`megainfer bench soak`: the report's figures on synthetic records (windows, percentiles, RSS
baselines across a restarted process, a fault's in-flight requests), the --duration parse, and
a one-minute soak with one fault (two minutes with two: -m slow) of deploy/plans/tiny-cpu-2a.yaml:
every request ends, nothing leaks, no status outside the allowed set, the JSON has every key and
the plot is written."""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import pytest

from megainfer.tools.bench import soak_report
from megainfer.tools.bench.soak_report import Fault, ResourceSample, SoakRun
from megainfer.tools.bench.soak_traffic import (CLEAN, Ending, Frontend, PromptPool, RequestRecord, SoakTraffic, Status,
                                          TrafficMix, TrafficSpec, draw_shape, http_status)
from megainfer.cli.bench import duration_s
from megainfer.messages import NodeResources, NodeRole
from tests.helpers import ROOT

MIB = 1 << 20
API_KEY = "soak-test-key-0123456789"


def record(start: float, end: float | None, status: Status = Status.OK, tokens: list[float] = (),
           n: int = 1) -> RequestRecord:
    r = RequestRecord(f"r{start}", Frontend.GRPC, Ending.NORMAL, "short-text", True, n, start)
    for t in tokens:
        r.token(0, t)
    if end is not None or status is Status.UNENDED:
        r.finish(status, end)
    return r


def node(name: str, pid: int, rss_mib: float, used: int = 0, held: int = 0, unreleased: int = 0) -> NodeResources:
    return NodeResources(name, NodeRole.ATTENTION, 0, pid, int(rss_mib * MIB), kv_blocks_total=100,
                         kv_blocks_free=100 - used, slots_held=held, slots_unreleased=unreleased)


# -- the report --------------------------------------------------------------------------------
def test_windows_place_requests_by_start_and_gaps_by_end():
    records = [record(0.5, 3.0, tokens=[1.0, 1.5, 2.0]),  # TTFT 0.5 s, gaps 0.5 and 0.5 (ending at 1.5, 2.0)
               record(1.0, 12.0, tokens=[3.0, 11.0]),  # TTFT 2 s; its 8 s gap ends in window 1
               record(12.0, 13.0, Status.UNAVAILABLE),
               record(19.0, 25.0, tokens=[19.5, 24.0])]  # ended in the drain: its gap counts in the last window
    out = soak_report.windows(records, 20.0, [Fault("kill_expert", "expert0", 11.0, 2.0, 30.0)], count=2)
    assert [w.t_s for w in out] == [0.0, 10.0]
    assert [w.requests for w in out] == [2, 2]
    assert [w.failed for w in out] == [0, 1]
    assert out[0].p99_ttft_ms == pytest.approx(np.percentile([500.0, 2000.0], 99))
    assert out[0].p99_tbt_ms == pytest.approx(500.0)
    assert out[1].p99_tbt_ms == pytest.approx(np.percentile([8000.0, 4500.0], 99))
    assert [w.fault for w in out] == [False, True]


def test_p99_and_the_fault_window_ratio():
    assert soak_report.p99_ms([i / 1000 for i in range(1, 101)]) == pytest.approx(np.percentile(range(1, 101), 99))
    assert soak_report.p99_ms([]) is None
    calm = [record(t, t + 1, tokens=[t + 0.1]) for t in (1.0, 2.0, 3.0)]  # TTFT 100 ms
    hit = [record(t, t + 5, tokens=[t + 0.4]) for t in (11.0, 12.0)]  # TTFT 400 ms
    marks = soak_report.windows(calm + hit, 20.0, [Fault("stop_node", "attention0", 10.5, 3.0, 40.0)], count=2)
    assert soak_report.fault_ttft_ratio(calm + hit, marks, 20.0) == pytest.approx(4.0)


def test_late_vs_early_leaves_out_the_warm_up_and_fault_windows():
    warm = [record(0.5, 1.0, tokens=[0.5 + 5.0])]  # 5 s TTFT in the warm-up: left out
    early = [record(t, t + 1, tokens=[t + 0.1]) for t in (3.0, 6.0, 9.0)]  # 100 ms
    late = [record(t, t + 1, tokens=[t + 0.3]) for t in (21.0, 25.0, 29.0)]  # 300 ms
    hit = [record(35.0, 40.0, tokens=[35.0 + 9.0])]  # 9 s TTFT under a fault: left out
    records = warm + early + late + hit
    marks = soak_report.windows(records, 40.0, [Fault("drop_connection", "expert0", 34.0, 2.0, 30.0)], count=8)
    assert soak_report.late_vs_early_ttft_ratio(records, marks, 40.0, warm_s=2.0) == pytest.approx(3.0)


def test_replicas_repeating_node_names_are_told_apart():
    names = [name for name, _ in soak_report.keyed([node("attention0", 1, 1), node("expert0", 2, 1),
                                                    node("attention0", 3, 1), node("expert0", 4, 1)])]
    assert names == ["attention0@0", "expert0@0", "attention0@1", "expert0@1"]
    assert [name for name, _ in soak_report.keyed([node("attention0", 1, 1)])] == ["attention0"]


def test_rss_baseline_is_warm_and_a_restarted_process_is_measured_from_its_own_incarnation():
    samples = [ResourceSample(t, [node("attention0", 10, 100 + t), node("expert0", 20 if t < 30 else 21,
                                                                         (200 + t) if t < 30 else 50 + (t - 30))])
               for t in range(0, 60, 5)]
    final = ResourceSample(62.0, [node("attention0", 10, 170), node("expert0", 21, 66)])
    memory = soak_report.node_memory(samples, final, warm_s=10.0)
    a, e = memory["attention0"], memory["expert0"]
    assert (a.baseline_t_s, a.baseline_bytes, a.baseline_warm) == (10, 110 * MIB, True)
    assert a.growth == pytest.approx(60 / 110)
    assert e.pid == 21 and e.pid_changes == [{"t_s": 30, "old_pid": 20, "new_pid": 21}]
    assert (e.baseline_t_s, e.baseline_bytes) == (40, 60 * MIB)  # 10 s into the new process, not the old one's
    assert e.growth == pytest.approx(6 / 60)
    young = soak_report.node_memory(samples[:8], ResourceSample(40.0, [node("expert0", 22, 80)]), warm_s=10.0)
    assert not young["expert0"].baseline_warm and young["expert0"].growth == 0.0  # too young to judge


def test_a_faults_in_flight_requests_and_their_latest_end():
    records = [record(5.0, 12.0), record(8.0, 20.0, Status.UNAVAILABLE), record(11.0, 13.0), record(2.0, 9.0)]
    fault = Fault("kill_attention", "attention1", 10.0, 6.0, 30.0)
    [outcome] = soak_report.fault_outcomes([fault], records)
    assert outcome.in_flight == 2 and outcome.in_flight_by_status == {"OK": 1, "UNAVAILABLE": 1}
    assert outcome.in_flight_end_s == pytest.approx(10.0) and outcome.ok
    late = Fault("kill_attention", "attention1", 10.0, 6.0, 8.0)  # the in-flight end (10 s) is past its bound
    assert not soak_report.fault_outcomes([late], records)[0].ok
    [stuck] = soak_report.fault_outcomes([fault], records + [record(9.0, None, Status.UNENDED)])
    assert stuck.in_flight_end_s is None and not stuck.ok
    unrecovered = Fault("kill_expert", "expert0", 10.0, None, 30.0)
    assert not soak_report.fault_outcomes([unrecovered], records)[0].ok


def test_summary_json_keys_verdict_table_and_plot(tmp_path):
    records = [record(1.0, 2.0, tokens=[1.2, 1.4]), record(3.0, None, Status.UNENDED),
               record(4.0, 4.5, Status.CANCELLED_BY_CLIENT)]
    run = SoakRun(plan="p.yaml", duration_s=10.0, concurrency=2, seed=0, chaos=True, records=records,
                  samples=[ResourceSample(t, [node("attention0", 1, 100)]) for t in (0.0, 5.0)],
                  final=ResourceSample(12.0, [node("attention0", 1, 101, used=3, held=1, unreleased=1)]),
                  faults=[Fault("drop_connection", "expert0", 3.5, 1.5, 30.0)], idle_after_s=None, idle_bound_s=60.0)
    summary = soak_report.summarize(run)
    out = summary.to_json()
    for key in ("requests_by_status", "unended_requests", "leaked_kv_blocks", "leaked_slots", "rss_growth", "windows",
                "faults", "requests_started", "requests_finished", "requests_failed", "fault_ttft_ratio", "passed"):
        assert key in out, key
    assert out["requests_by_status"] == {"OK": 1, "UNENDED": 1, "CANCELLED_BY_CLIENT": 1}
    assert (out["unended_requests"], out["leaked_kv_blocks"], out["leaked_slots"]) == (1, 3, 2)
    assert out["rss_growth"]["attention0"] == pytest.approx(0.01)
    fault = out["faults"][0]
    assert {"kind", "target", "at_s", "recovery_s", "bound_s", "in_flight_end_s", "ok"} <= set(fault)
    assert fault["in_flight_end_s"] is None and not fault["ok"]  # the unended request was in flight
    assert len(summary.failures) == 4 and not out["passed"]
    json.dumps(out)  # serialisable
    table = soak_report.format_report(summary)
    assert "FAIL (exit status 1)" in table and "1 request(s) without an end" in table
    soak_report.plot(summary, tmp_path / "soak.png")
    assert (tmp_path / "soak.png").read_bytes()[:4] == b"\x89PNG"


# -- the traffic and the CLI -------------------------------------------------------------------
@pytest.mark.parametrize("text, seconds", [("90", 90.0), ("120s", 120.0), ("10m", 600.0), ("1.5h", 5400.0),
                                           (" 2M ", 120.0)])
def test_duration_parses_seconds_and_units(text, seconds):
    assert duration_s(text) == seconds


@pytest.mark.parametrize("text", ["", "m", "10x", "-5", "0", "nan", "inf", "10 min"])
def test_a_bad_duration_names_the_value_and_the_fix(text):
    with pytest.raises(argparse.ArgumentTypeError, match="e.g. 90, 120s, 10m, 1h"):
        duration_s(text)


@pytest.mark.parametrize("field, value, flag", [("duration_s", 0.0, "--duration"), ("concurrency", 0, "--concurrency"),
                                               ("request_timeout_s", float("nan"), "--request-timeout")])
def test_a_bad_soak_setting_names_its_flag_before_anything_starts(field, value, flag):
    from deploy.bench_soak import SoakSpec
    from megainfer.errors import ConfigError

    with pytest.raises(ConfigError, match=flag):
        SoakSpec(**{"duration_s": 10.0, field: value})


def test_http_errors_map_onto_the_grpc_vocabulary():
    assert [http_status(c) for c in (400, 401, 403, 404, 418, 429, 499, 500, 503, 504)] == [
        Status.INVALID_ARGUMENT, Status.UNAUTHENTICATED, Status.PERMISSION_DENIED, Status.NOT_FOUND,
        Status.INVALID_ARGUMENT, Status.RESOURCE_EXHAUSTED, Status.CANCELLED_BY_CLIENT, Status.INTERNAL,
        Status.UNAVAILABLE, Status.DEADLINE_EXCEEDED]


def test_drawn_requests_fit_the_model_and_cover_the_mix():
    import random

    spec = TrafficSpec("", "", "m", max_model_len=256, vocab_size=300)
    rng = random.Random(0)
    shapes = [draw_shape(spec, PromptPool(spec, None, rng), rng) for _ in range(400)]
    for s in shapes:
        if isinstance(s.prompt, list):
            assert len(s.prompt) + s.max_tokens <= 256 and all(5 <= t < 300 for t in s.prompt)
        assert s.stream or s.frontend is Frontend.HTTP
    assert {s.frontend for s in shapes} == set(Frontend) and {s.ending for s in shapes} == set(Ending)
    assert {s.prompt_kind for s in shapes} == {"short-text", "short-ids", "long-text", "long-ids"}
    assert any(s.n == 2 for s in shapes) and any(s.stop for s in shapes) and not all(s.stream for s in shapes)


@pytest.fixture(scope="module")
def demo_endpoints():
    """The demo model's colocated engine behind both frontends (no Ray), with an API key: the traffic's peer."""
    from megainfer import Engine
    from megainfer.engine_config import EngineConfig
    from megainfer.server.access import AccessPolicy
    from megainfer.server.endpoints import Endpoints
    from megainfer.server.engine_backend import EngineBackend
    from megainfer.server.served_model import ServedModel

    backend = EngineBackend(Engine("megainfer-demo", EngineConfig(num_kv_blocks=512, max_model_len=1024)))
    served = ServedModel.load("megainfer-demo", max_model_len=1024)
    endpoints = Endpoints(backend, served, port=0, http_port=0, access=AccessPolicy.from_keys([API_KEY])).start()
    yield endpoints, backend, served
    endpoints.stop(0)
    backend.close()


# How the traffic test's requests must have ended, between them: by frontend and status.
ENDINGS = {(Frontend.GRPC, Status.OK), (Frontend.HTTP, Status.OK), (Frontend.GRPC, Status.ABORTED),
           (Frontend.GRPC, Status.CANCELLED_BY_CLIENT), (Frontend.HTTP, Status.CANCELLED_BY_CLIENT)}


def saw_every_ending(records: list) -> bool:
    """Every ending of ENDINGS, a streamed n=2 request done with both its first tokens, and more
    than 10 requests ended."""
    ended = [r for r in records if r.status is not None]
    return (ENDINGS <= {(r.frontend, r.status) for r in ended} and len(ended) > 10
            and any(r.status is Status.OK and r.stream and r.n == 2 and len(r.token_times) == 2 for r in ended))


def test_traffic_ends_every_request_on_both_frontends_through_a_client_restart(demo_endpoints):
    endpoints, backend, served = demo_endpoints
    mix = TrafficMix(abort=0.3, disconnect=0.3, long=0.3, n2=0.3, max_tokens=(8, 32))
    traffic = SoakTraffic(TrafficSpec(endpoints.grpc.address, endpoints.http_url, served.name, 1024,
                                      served.tokenizer.vocab_size, concurrency=4, seed=1, request_timeout_s=60.0,
                                      api_key=API_KEY, mix=mix), served.tokenizer).start()
    try:
        time.sleep(4.0)
        in_flight = [r for r in traffic.records if r.status is None]
        traffic.restart_clients()
        # At least 4 s more, and on until every ending asserted below has been seen (a slow machine
        # finishes fewer requests in a fixed time), within a minute.
        time.sleep(4.0)
        deadline = time.monotonic() + 60
        while not saw_every_ending(traffic.records) and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        traffic.stop()
    records = traffic.records
    assert in_flight and all(r.status is Status.CANCELLED_BY_CLIENT for r in in_flight)
    assert all(r.status in CLEAN and r.end_s is not None and r.end_s >= r.start_s for r in records), \
        [(r.status, r.detail) for r in records if r.status not in CLEAN]
    assert ENDINGS <= {(r.frontend, r.status) for r in records}
    ok = [r for r in records if r.status is Status.OK and r.stream]
    assert ok and all(r.ttft_s is not None and 0 < r.ttft_s <= r.end_s - r.start_s for r in ok)
    assert any(r.tbt_gaps() for r in ok) and any(len(r.token_times) == 2 for r in ok if r.n == 2)
    assert traffic.restarts and len(records) > 10
    deadline = time.monotonic() + 10  # the server saw every abort and disconnect: nothing is held
    while (held := backend.resources()[0]).requests or held.kv_blocks_used:
        assert time.monotonic() < deadline, held
        time.sleep(0.1)


# -- a deployment under soak and chaos ---------------------------------------------------------
ALLOWED = {"OK", "ABORTED", "CANCELLED_BY_CLIENT", "UNAVAILABLE", "RESOURCE_EXHAUSTED"}


# deploy.chaos fits one episode per ~55 s: the default run soaks for one minute with one fault
# (~70 s with start and drain); two minutes with two (~2.5 min) run with -m slow.
@pytest.mark.parametrize("soak_s", [60.0, pytest.param(110.0, marks=pytest.mark.slow)])
def test_a_soak_with_chaos_ends_every_request_and_leaks_nothing(ray_session, tmp_path, soak_s):
    from deploy.bench_soak import SoakSpec, run

    path = tmp_path / "soak.json"
    rc = run(str(ROOT / "deploy/plans/tiny-cpu-2a.yaml"), SoakSpec(duration_s=soak_s, concurrency=8, chaos=True),
             str(path), show_progress=False)
    out = json.loads(path.read_text())
    for key in ("requests_by_status", "unended_requests", "leaked_kv_blocks", "leaked_slots", "rss_growth", "windows",
                "faults"):
        assert key in out, key
    assert out["unended_requests"] == 0
    assert (out["leaked_kv_blocks"], out["leaked_slots"]) == (0, 0), out["leaks_by_node"]
    assert set(out["requests_by_status"]) <= ALLOWED, out["requests_by_status"]
    assert out["requests_by_status"].get("OK", 0) > 50
    assert len(out["faults"]) == (1 if soak_s < 110 else 2), out["faults"]
    assert set(out["rss_growth"]) == {"attention0", "attention1", "expert0"}
    assert len(out["windows"]) == soak_report.WINDOWS
    assert out["faults"] and all(f["ok"] for f in out["faults"]), out["faults"]
    assert (tmp_path / "soak.png").read_bytes()[:4] == b"\x89PNG"
    assert rc == 0, out["failures"]
