"""`megainfer simulate`: the real scheduler priced by the step model, expert-activation draws,
workload generators, and the paper's chunked-versus-layered comparison."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import numpy as np
import pytest

from megainfer.tools.bench.workload import SimRequest, arrival_times, describe, generate, load_trace
from megainfer.engine_config import EngineConfig
from megainfer.errors import ConfigError, PlanError
from megainfer.presets import PRESETS
from megainfer.tools.simulator.experiment import SimulationSpec, rate_range, ratios
from megainfer.tools.simulator.expert_load import ExpertActivation
from megainfer.tools.simulator.routing_skew import FITTED_SKEW
from megainfer.tools.simulator.sim import Simulator
from planner.catalog import Catalog
from planner.step_cost_model import AttentionWork, ColocatedStepModel, LayerClass
from tests.helpers import ROOT

QWEN = PRESETS["qwen3-30b-a3b"]


@pytest.fixture(scope="module")
def h100x2():
    return ColocatedStepModel(QWEN, Catalog.load()["H100"], 2)


# -- expert activation ------------------------------------------------------------------------
def _monte_carlo_distinct(num_experts, top_k, tokens, trials, rng, weights=None):
    counts = []
    for _ in range(trials):
        if weights is None:
            picks = [rng.choice(num_experts, top_k, replace=False) for _ in range(tokens)]
        else:
            picks = [rng.choice(num_experts, top_k, replace=False, p=weights) for _ in range(tokens)]
        counts.append(len(set(np.concatenate(picks).tolist())))
    return float(np.mean(counts))


@pytest.mark.parametrize("tokens", [1, 3, 16, 40])
def test_uniform_activation_matches_per_token_routing(tokens):
    act = ExpertActivation(64, 4)
    mc = _monte_carlo_distinct(64, 4, tokens, 1500, np.random.default_rng(tokens))
    assert act.expected(tokens) == pytest.approx(mc, rel=0.02)
    draws = np.concatenate([np.atleast_1d(act.draw(tokens, 48)) for _ in range(40)])
    assert draws.mean() == pytest.approx(act.expected(tokens), rel=0.03)
    assert draws.min() >= 4 and draws.max() <= 64


def test_skewed_activation_matches_weighted_routing_and_activates_fewer():
    skewed, uniform = ExpertActivation(32, 4, skew=1.0), ExpertActivation(32, 4)
    weights = np.arange(1, 33, dtype=float) ** -1.0
    mc = _monte_carlo_distinct(32, 4, 8, 1500, np.random.default_rng(0), weights / weights.sum())
    assert skewed.expected(8) == pytest.approx(mc, rel=0.03)
    assert skewed.expected(8) < uniform.expected(8) - 3
    assert skewed.pick_probability.sum() == pytest.approx(4.0)


def test_activation_saturates_and_rejects_bad_input():
    act = ExpertActivation(16, 2)
    assert act.draw(0, 5) == 0
    assert act.draw(5000, 5) == 16 and act.expected(5000) == 16.0
    with pytest.raises(ConfigError, match="expert-skew"):
        ExpertActivation(16, 2, skew=-1)
    with pytest.raises(ConfigError, match="top_k"):
        ExpertActivation(4, 8)


# -- step model -----------------------------------------------------------------------------
def test_step_model_counts_expert_bytes_by_hand(h100x2):
    m = QWEN
    one_expert = m.expert_params * 2  # bf16
    decodes = AttentionWork(10, 10 * 100)
    cost = h100x2.step([LayerClass(3, 10, decodes, np.array([5, 7, 9])),
                        LayerClass(45, 2, AttentionWork(2, 200), 16)], sampled=2, seqs=10)
    assert cost.expert_bytes == pytest.approx((5 + 7 + 9 + 45 * 16) * one_expert)
    # Few tokens: the expert half is memory-bound, so 10 more experts in every one of the 45
    # layers cost exactly their bytes over the two GPUs' achieved bandwidth (the MoE curve's
    # bandwidth fraction at that read size).
    more = h100x2.step([LayerClass(3, 10, decodes, np.array([5, 7, 9])),
                        LayerClass(45, 2, AttentionWork(2, 200), 26)], sampled=2, seqs=10)
    per_gpu = one_expert / 2
    curve = h100x2.curves.moe.bandwidth

    def read_s(experts):
        return experts * per_gpu / (h100x2.gpu.hbm_bytes_per_s * curve(experts * per_gpu))

    assert more.seconds - cost.seconds == pytest.approx(45 * (read_s(26) - read_s(16)))
    assert more.operators["moe"] > cost.operators["moe"]
    assert cost.energy_j > cost.seconds * h100x2.idle_w
    # A layer class no token passes costs nothing but the step's fixed overhead.
    idle = h100x2.step([LayerClass(48, 0, AttentionWork(), 0)], sampled=0, seqs=0)
    assert idle.seconds == pytest.approx(h100x2.curves.step_overhead_s) and idle.expert_bytes == 0


def test_step_model_refuses_what_does_not_fit():
    with pytest.raises(PlanError, match="does not fit"):
        ColocatedStepModel(PRESETS["qwen3-235b-a22b"], Catalog.load()["H100"], 1).kv_capacity_tokens()


# -- the simulator drives the real scheduler ---------------------------------------------------
def test_single_request_timeline_is_the_sum_of_its_steps(h100x2, monkeypatch):
    """One 1,024-token prompt and 4 output tokens: chunked runs 2 prefill steps of 512 then 3
    decodes; layered runs G = 2 groups then 3 decodes. TTFT is the prefill steps' time."""
    from megainfer.scheduling import scheduler as scheduler_module

    calls = []
    real_schedule = scheduler_module.Scheduler.schedule
    monkeypatch.setattr(scheduler_module.Scheduler, "schedule",
                        lambda self: calls.append(1) or real_schedule(self))
    costs = []
    real_step = h100x2.step
    monkeypatch.setattr(h100x2, "step", lambda classes, **kw: costs.append(real_step(classes, **kw)) or costs[-1])
    for policy in ("chunked", "layered"):
        calls.clear()
        costs.clear()
        sim = Simulator(QWEN, h100x2, EngineConfig(prefill_policy=policy, max_num_batched_tokens=512))
        res = sim.run([SimRequest(0.0, 1024, 4)])
        assert len(calls) == res.steps == 5
        assert len(res.tbt_s) == 3
        assert res.ttft_s[0] == pytest.approx(costs[0].seconds + costs[1].seconds)
        assert res.duration_s == pytest.approx(sum(c.seconds for c in costs))
        assert res.tbt_s == pytest.approx([c.seconds for c in costs[2:]])


def test_layered_reads_fewer_expert_bytes_for_one_long_prompt(h100x2):
    """Chunked: every one of the 8 chunks reads every expert of every layer. Layered: the cohort
    passes each layer once (8,192 tokens activate all experts), so a full read happens once.
    Uniform routing, where 512 tokens surely activate all 128 experts."""
    full_read = QWEN.num_layers * QWEN.num_experts * QWEN.expert_params * 2
    res = {p: Simulator(QWEN, h100x2, EngineConfig(prefill_policy=p, max_num_batched_tokens=512), expert_skew=0.0)
           .run([SimRequest(0.0, 4096, 1)]) for p in ("chunked", "layered")}
    assert res["chunked"].expert_bytes == pytest.approx(8 * full_read)
    assert res["layered"].expert_bytes == pytest.approx(full_read)
    assert res["layered"].steps == 8  # G = 4096 / 512 groups


def test_simulation_is_deterministic_and_counts_every_request(h100x2):
    reqs = generate("sharegpt", num_requests=60, rate=3.0, max_model_len=QWEN.max_position_embeddings, seed=3)
    a = Simulator(QWEN, h100x2, EngineConfig(prefill_policy="layered")).run(reqs)
    b = Simulator(QWEN, h100x2, EngineConfig(prefill_policy="layered")).run(reqs)
    assert a.summary(10, 0.125) | {"wall_s": 0} == b.summary(10, 0.125) | {"wall_s": 0}
    assert len(a.ttft_s) == 60 and (a.ttft_s > 0).all()
    assert len(a.tbt_s) == sum(r.output_len - 1 for r in reqs)


# -- the paper's comparison ----------------------------------------------------------------------
def _compare(workload, rate, skew=0.0, n=300):
    spec = SimulationSpec(model=QWEN, step_model=ColocatedStepModel(QWEN, Catalog.load()["H100"], 2),
                          workload=workload, rate=rate, num_requests=n, expert_skew=skew)
    return spec.run(spec.requests())


def test_arxiv_at_1_3_req_s_matches_the_papers_direction_and_size():
    res = _compare("arxiv", 1.3)
    q = ratios(res)
    assert q["expert_bytes"] <= 0.70  # at least 30% fewer expert-weight bytes
    assert q["ttft_mean_s"] <= 0.60  # at least 40% lower mean TTFT
    assert res["chunked"]["tbt_p99_s"] <= 0.125 and res["layered"]["tbt_p99_s"] <= 0.125
    assert q["energy_per_output_token_j"] < 1.0


def test_sharegpt_at_4_4_req_s_saves_expert_bytes():
    uniform, skewed = ratios(_compare("sharegpt", 4.4)), ratios(_compare("sharegpt", 4.4, skew=FITTED_SKEW))
    assert uniform["expert_bytes"] < 0.98
    # Routing fitted to the measured coverage: decode batches read fewer experts, prefill chunks
    # still nearly all (the paper measured -12%).
    assert skewed["expert_bytes"] <= 0.92


# -- workloads -------------------------------------------------------------------------------
def test_generated_sharegpt_follows_the_trace_statistics():
    # arXiv, fitted to the paper's mean and std: tests/megainfer/test_sim_workload.py
    stats = describe(generate("sharegpt", num_requests=20000, rate=1.0, max_model_len=40960, seed=1))
    assert stats["input"]["median"] == pytest.approx(1730, rel=0.05)
    assert stats["input"]["p90"] == pytest.approx(5696, rel=0.08)
    assert stats["output"]["median"] == pytest.approx(415, rel=0.05)
    assert stats["output"]["p90"] == pytest.approx(834, rel=0.08)
    reqs = generate("sharegpt", num_requests=5000, rate=1.0, max_model_len=40960)
    assert max(r.input_len + r.output_len for r in reqs) <= 8192  # the trace's 8K filter


def test_arrivals_have_the_requested_rate_and_burstiness():
    rng = np.random.default_rng(0)
    for kind, cv in (("poisson", 1.0), ("bursty", 3.0)):
        t = arrival_times(rng, 50000, 2.0, kind, cv)
        gaps = np.diff(t)
        assert t[0] == 0 and gaps.mean() == pytest.approx(0.5, rel=0.05)
        assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.1)
    with pytest.raises(ConfigError, match="--rate"):
        arrival_times(rng, 5, 0.0, "poisson", 1.0)


def test_trace_files_load_and_bad_lines_name_their_line(tmp_path):
    good = tmp_path / "t.jsonl"
    good.write_text('{"arrival": 1.5, "input_len": 100, "output_len": 8}\n\n'
                    '{"arrival": 0.5, "input_len": 10, "output_len": 2}\n')
    assert [r.arrival_s for r in load_trace(good, max_model_len=4096)] == [0.5, 1.5]
    for text, message in (('{"arrival": 0}\n', "needs arrival"), ("nope\n", "not JSON"),
                          ('{"arrival": 0, "input_len": 0, "output_len": 1}\n', "input_len must be"),
                          ('{"arrival": 0, "input_len": 5000, "output_len": 1}\n', "exceeds")):
        bad = tmp_path / "bad.jsonl"
        bad.write_text(text)
        with pytest.raises(ConfigError, match=message) as info:
            load_trace(bad, max_model_len=4096)
        assert "bad.jsonl:1" in str(info.value)


def test_a_trace_refuses_the_options_that_would_redraw_its_arrivals(tmp_path, h100x2):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"arrival": 0.5, "input_len": 100, "output_len": 8}\n')
    spec = SimulationSpec(model=QWEN, step_model=h100x2, workload=str(trace), rate=1.0, num_requests=1)
    assert [r.arrival_s for r in spec.requests()] == [0.5]
    with pytest.raises(ConfigError, match="--sweep-rates needs a built-in workload"):
        spec.requests(rate=2.0)
    with pytest.raises(ConfigError, match="--exact-rate scales a built-in workload"):
        SimulationSpec(model=QWEN, step_model=h100x2, workload=str(trace), rate=1.0, num_requests=1,
                       exact_rate=True).requests()


def test_rate_ranges():
    assert rate_range("0.5:2:0.5") == [0.5, 1.0, 1.5, 2.0]
    for bad in ("1:2", "2:1:0.5", "a:b:c", "0.001:100:0.001"):
        with pytest.raises(ConfigError):
            rate_range(bad)


# -- the command ------------------------------------------------------------------------------
def _cli(*args):
    return subprocess.run([sys.executable, "-m", "megainfer", "simulate", *args], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)


def test_simulate_command_prints_the_comparison_and_writes_json_and_plot(tmp_path):
    out = _cli("--workload", "arxiv", "--rate", "1.3", "--requests", "40", "--json", str(tmp_path / "r.json"))
    assert out.returncode == 0, out.stderr
    assert "layered vs chunked: expert bytes" in out.stdout and "TTFT mean s" in out.stdout
    data = json.loads((tmp_path / "r.json").read_text())
    assert set(data["results"]) == {"chunked", "layered"} and data["layered_vs_chunked"]["expert_bytes"] < 1
    assert data["workload_stats"]["input"]["mean"] > 1000
    out = _cli("--workload", "sharegpt", "--requests", "30", "--sweep-rates", "1:3:2", "--plot",
               str(tmp_path / "s.png"), "--json", str(tmp_path / "s.json"))
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "s.png").stat().st_size > 10000
    assert [row["rate"] for row in json.loads((tmp_path / "s.json").read_text())["sweep"]] == [1.0, 3.0]
    # The paper's engine's layered stages and filled cohorts, said in the header.
    out = _cli("--workload", "arxiv", "--requests", "20", "--policy", "layered", "--max-layer-groups", "16",
               "--layered-group-table", "512:1,1024:2,2048:4,4096:8", "--layered-fill-cohorts")
    assert out.returncode == 0, out.stderr
    assert "(at most 16 groups, by the table 512:1,1024:2,2048:4,4096:8), cohorts filled" in out.stdout


@pytest.mark.parametrize("args, message", [
    (("--workload", "nope"), "neither a built-in workload"),
    (("--gpu", "Z100"), "unknown GPU"),
    (("--tp", "9"), "--tp 9"),
    (("--rate", "-1"), "--rate"),
    (("--plot", "x.png"), "--sweep-rates"),
    (("--model", "qwen3-235b-a22b", "--tp", "1"), "does not fit"),
    (("--layered-group-table", "512"), "not a group table"),
    (("--layered-group-table", "512:1"), "needs 'max_layer_groups'"),
    (("--max-layer-groups", "12", "--layered-group-table", "512:20"), "at most max_layer_groups (12)"),
])
def test_simulate_command_errors_are_one_line(args, message):
    out = _cli(*args, "--requests", "5")
    assert out.returncode == 2 and message in out.stderr and "Traceback" not in out.stderr


@pytest.mark.slow
@pytest.mark.parametrize("workload, rate", [("sharegpt", 4.4), ("arxiv", 1.3)])
def test_ten_thousand_requests_simulate_in_under_30_s(workload, rate):
    """arXiv under layered prefill is the heaviest case: about 1.2 million steps."""
    spec = SimulationSpec(model=QWEN, step_model=ColocatedStepModel(QWEN, Catalog.load()["H100"], 2),
                          workload=workload, rate=rate, num_requests=10000, policies=("layered",))
    requests = spec.requests()
    started = time.perf_counter()
    spec.run(requests)
    assert time.perf_counter() - started < 30
