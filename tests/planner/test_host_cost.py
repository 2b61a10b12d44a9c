"""The planner charges the host's CPU time per M2N round (planner/round_host_cost.py), from a
`megainfer bench host --json` result, and refuses plans whose rounds the host cannot post
within the micro-batch's compute."""

from __future__ import annotations

import json
import math

import pytest

from megainfer.errors import PlanError
from megainfer.presets import PRESETS
from planner.catalog import Catalog
from planner.round_host_cost import HostCost
from planner.perf_model import PerfModel
from planner.search import evaluate_plan, search
from planner.timeline import explain
from tests.helpers import megainfer

CATALOG = Catalog.load()
GPUS = ["H20", "L40S"]
MODEL = PRESETS["qwen3-30b-a3b"]


def bench_result(path, attention=(1e-6, 1e-11), expert=(2e-6, 2e-11), peers=(32, 20), machine="test CPU") -> str:
    """A bench host JSON whose core rounds follow per-peer and per-byte costs exactly."""
    data = {"benchmark": "host", "plan": "x.yaml", "machine": machine}
    for side, (per_peer, per_byte), n in zip(("attention", "expert"), (attention, expert), peers):
        for suffix, size in (("", 4096), ("_plan_size", 231168)):
            us = (per_peer * n + per_byte * 2 * n * size) * 1e6
            data[f"{side}_round_cpu_us{suffix}"] = {
                "core": {"side": side, "path": "core", "peers": n, "message_bytes": size, "cpu_us": us, "wall_us": us},
                "python": None}
    path.write_text(json.dumps(data))
    return str(path)


def test_a_bench_host_result_gives_per_peer_and_per_byte_costs(tmp_path):
    host = HostCost.load(bench_result(tmp_path / "h.json"))
    assert math.isclose(host.attention.per_peer_s, 1e-6, rel_tol=1e-6)
    assert math.isclose(host.attention.per_byte_s, 1e-11, rel_tol=1e-6)
    assert math.isclose(host.expert.per_peer_s, 2e-6, rel_tol=1e-6)
    assert math.isclose(host.expert.round_s(10, 1000), 10 * 2e-6 + 2e-11 * 2 * 10 * 1000, rel_tol=1e-6)
    assert "test CPU" in host.source


@pytest.mark.parametrize("body, match", [
    (None, "no such file"), ("{", "not valid JSON"), ('{"benchmark": "m2n"}', "not a `megainfer bench host`"),
    ('{"benchmark": "host", "attention_round_cpu_us": {"core": null}}', "need a 'core' row")])
def test_a_bad_host_profile_says_what_and_how_to_make_one(tmp_path, body, match):
    path = tmp_path / "h.json"
    if body is not None:
        path.write_text(body)
    with pytest.raises(PlanError, match=match) as err:
        HostCost.load(path)
    assert "bench host" in str(err.value)


def test_a_cheap_host_changes_nothing_and_an_expensive_one_refuses_every_plan(tmp_path):
    plain = search(MODEL, CATALOG, GPUS, GPUS, tbt_slo_s=0.15, perf=PerfModel(MODEL, 730)).candidates
    cheap = HostCost.load(bench_result(tmp_path / "cheap.json", (1e-9, 1e-15), (1e-9, 1e-15)))
    charged = search(MODEL, CATALOG, GPUS, GPUS, tbt_slo_s=0.15, perf=PerfModel(MODEL, 730, host=cheap)).candidates
    assert [(c.attention_gpu, c.expert_gpu, c.tp_a, c.n_a, c.m) for c in charged[:3]] == \
        [(c.attention_gpu, c.expert_gpu, c.tp_a, c.n_a, c.m) for c in plain[:3]]
    assert all(0 < c.host_a < c.t_a and 0 < c.host_e < c.t_e for c in charged)
    slow = HostCost.load(bench_result(tmp_path / "slow.json", (0.1, 1e-15), (0.1, 1e-15)))  # 100 ms per peer
    refused = search(MODEL, CATALOG, GPUS, GPUS, tbt_slo_s=0.15, perf=PerfModel(MODEL, 730, host=slow))
    assert refused.candidates == []


def test_a_host_between_the_two_keeps_only_plans_it_can_feed(tmp_path):
    plain = search(MODEL, CATALOG, GPUS, GPUS, tbt_slo_s=0.15, perf=PerfModel(MODEL, 730)).candidates
    tight = min(c.t_a for c in plain[:5]) / 32  # a per-peer cost that some rows' rounds exceed
    host = HostCost.load(bench_result(tmp_path / "mid.json", (tight, 1e-15), (tight, 1e-15)))
    kept = search(MODEL, CATALOG, GPUS, GPUS, tbt_slo_s=0.15, perf=PerfModel(MODEL, 730, host=host)).candidates
    assert kept and all(not c.host_bound for c in kept)
    assert len(kept) < len(plain) or any(c.host_a > 0.5 * c.t_a for c in kept)


def test_a_fixed_plan_is_charged_where_its_host_sets_the_pace(tmp_path):
    kwargs = dict(attention_gpu="H20", tp_a=4, n_a=2, expert_gpu="L40S", tp_e=1, experts_per_node=4, m=4, batch=512)
    free = evaluate_plan(MODEL, PerfModel(MODEL, 730), CATALOG, **kwargs)
    host = HostCost.load(bench_result(tmp_path / "h.json", (free.t_a, 0.0), (1e-9, 0.0)))  # T_a per peer: host-bound
    bound = evaluate_plan(MODEL, PerfModel(MODEL, 730, host=host), CATALOG, **kwargs)
    assert bound.host_bound and bound.tbt > free.tbt
    text = explain(bound, MODEL.num_layers, host.source)
    assert "Host CPU per M2N round" in text and "the host sets the pace" in text
    assert "not charged" in explain(free, MODEL.num_layers)


def test_plan_explain_shows_the_host_cost(tmp_path):
    profile = bench_result(tmp_path / "h.json", (1e-7, 1e-13), (1e-7, 1e-13))
    out = megainfer("plan", "--model", "qwen3-30b-a3b", "--gpus", "H20,L40S", "--host-profile", profile, "--explain")
    assert out.returncode == 0, out.stderr
    assert "Host CPU per M2N round" in out.stdout and "test CPU" in out.stdout
    bad = megainfer("plan", "--model", "qwen3-30b-a3b", "--host-profile", str(tmp_path / "none.json"))
    assert bad.returncode != 0 and "Traceback" not in bad.stderr and "no such file" in bad.stderr
