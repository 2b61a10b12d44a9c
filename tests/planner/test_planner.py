"""The planner tied to MegaScale-Infer's numbers, its search, and its error messages."""

from __future__ import annotations

import dataclasses
import json
import random
import time

import numpy as np
import pytest

from megainfer.errors import PlanError
from megainfer.plan import Plan
from megainfer.presets import PRESETS
from planner.catalog import Catalog
from planner.colocated import best_colocated
from planner.perf_model import Calibration, PerfModel, min_micro_batches, roofline_utilization
from planner.search import evaluate_plan, search
from planner.timeline import explain, makespan, schedule

CATALOG = Catalog.load()
TABLE3 = ["L20", "H800", "A800", "H20", "L40S"]


def perf(name, seq_len=730, **kw):
    return PerfModel(PRESETS[name], seq_len, **kw)


def test_a100_roofline_batch_and_expert_mfu_for_mixtral_8x22b():
    """§2.3: an A100 needs ~156 tokens per GEMM to be compute-bound; at that decode batch each of
    Mixtral 8x22B's experts (top-2 of 8) sees a quarter of the tokens: 25% MFU."""
    a100 = CATALOG["A100"]
    assert a100.roofline_batch == pytest.approx(156, rel=0.03)
    model = PRESETS["mixtral-8x22b"]
    per_expert = 156 * model.top_k / model.num_experts
    assert roofline_utilization(per_expert, a100.flops, a100.hbm_bytes_per_s) == pytest.approx(0.25, rel=0.03)


def test_message_size_mixtral_8x22b_micro_batch_128_tp2():
    """§7.3: 196,608 bytes from one attention GPU to one expert GPU (micro-batch 128, tp_a=2)."""
    assert perf("mixtral-8x22b").message_bytes(128, tp_a=2, tp_e=1, experts_per_node=1) == pytest.approx(196608)


def test_node_hit_probability_counts_a_token_once_per_node():
    p = perf("mixtral-8x22b")  # top-2 of 8
    assert p.node_hit_probability(1) == pytest.approx(2 / 8)
    assert p.node_hit_probability(8) == pytest.approx(1.0)
    assert p.node_hit_probability(2) == pytest.approx(1 - (6 / 8) * (5 / 7))


@pytest.mark.parametrize("t_c, expected", [(0.3, 3), (0.49, 3), (0.7, 4), (0.95, 4)])
def test_micro_batches_three_when_network_under_half_else_four(t_c, expected):
    """§4.1: m >= 3 when T_c < T_f/2, m >= 4 otherwise (T_c < T_f)."""
    assert min_micro_batches(1.0, t_c) == expected
    # ...and that m is exactly what keeps the attention node busy in the event schedule.
    for m, busy in ((expected, True), (expected - 1, False)):
        phases = [p for p in schedule(1.0, 1.0, t_c, m, layers=3) if p.lane == "attention"]
        gaps = [b.start - a.end for a, b in zip(phases, phases[1:])]
        assert (max(gaps) < 1e-9) == busy


def test_iteration_formula_matches_the_event_schedule():
    p = perf("tiny-mixtral")
    rng = random.Random(0)
    for _ in range(200):
        t_a, t_e, t_c = rng.uniform(0.1, 2), rng.uniform(0.1, 2), rng.uniform(0, 2)
        m = rng.randint(1, 5)
        assert float(p.iteration_time(t_a, t_e, t_c, m)) == pytest.approx(
            makespan(schedule(t_a, t_e, t_c, m, PRESETS["tiny-mixtral"].num_layers)))


def test_paper_iteration_latency_when_constraints_hold():
    p = perf("dbrx")
    t_a, t_e, t_c, m = 1.0, 1.0, 0.4, 3  # T_c < T_f/2, m = 3
    assert float(p.iteration_time(t_a, t_e, t_c, m)) == pytest.approx((t_a + t_e + 2 * t_c) + t_a * (m * 40 - 1))


def test_dbrx_attention_sweep_peaks_per_gpu_where_attention_and_experts_balance():
    """Figure 15's shape: with a fixed batch per attention node, adding attention nodes raises
    per-GPU throughput until the experts bound the pipeline, then it falls. Below the ridge
    point the expert GEMMs are memory-bound, so their time grows slowly with tokens and the
    operator model puts the peak at or past T_a ~ T_e (the roofline without curves put it at
    balance)."""
    model, p = PRESETS["dbrx"], perf("dbrx")
    for tp_a, per_node in ((1, 128), (2, 192), (2, 256), (4, 512)):
        sweep = [evaluate_plan(model, p, CATALOG, attention_gpu="H800", tp_a=tp_a, n_a=n, expert_gpu="H800", tp_e=1,
                               experts_per_node=1, m=4, batch=n * per_node * 4) for n in range(1, 17)]
        assert all(c.network_hidden and c.pipeline_full for c in sweep)
        per_gpu = [c.per_gpu for c in sweep]
        peak = int(np.argmax(per_gpu))
        assert 0.5 <= sweep[peak].balance <= 1.15, [round(c.balance, 2) for c in sweep]
        assert all(a < b for a, b in zip(per_gpu[:peak], per_gpu[1:peak + 1]))  # rising to the peak
        assert all(a > b for a, b in zip(per_gpu[peak:], per_gpu[peak + 1:]))  # falling after it


@pytest.mark.parametrize("model", ["mixtral-8x22b", "dbrx", "scaled-moe"])
def test_heterogeneous_search_puts_attention_on_h20_and_experts_on_l40s(model):
    result = search(PRESETS[model], CATALOG, TABLE3, TABLE3, tbt_slo_s=0.150, perf=perf(model))
    best = result.candidates[0]
    assert (best.attention_gpu, best.expert_gpu) == ("H20", "L40S")
    assert best.tbt <= 0.150
    assert best.batch <= best.n_a * p_seqs(model, best)  # the KV cache fits (constraint 8)


def p_seqs(model, c):
    return perf(model).max_sequences_per_attention_node(CATALOG[c.attention_gpu].memory_bytes, c.tp_a)


def test_disaggregation_beats_the_colocated_baseline_per_cost():
    model = PRESETS["dbrx"]
    p = perf("dbrx")
    best = search(model, CATALOG, TABLE3, TABLE3, tbt_slo_s=0.150, perf=p).candidates[0]
    baseline = best_colocated(model, CATALOG, TABLE3, tbt_slo_s=0.150, perf=p)
    assert baseline is not None and baseline.tbt <= 0.150
    assert best.per_cost > 1.2 * baseline.per_cost


@pytest.mark.parametrize("objective, attr", [("gpu", "per_gpu"), ("power", "per_watt"), ("cost", "per_cost")])
def test_objectives_rank_by_their_metric(objective, attr):
    result = search(PRESETS["mixtral-8x7b"], CATALOG, TABLE3, TABLE3, tbt_slo_s=0.1, perf=perf("mixtral-8x7b"),
                    objective=objective)
    values = [getattr(c, attr) for c in result.candidates]
    assert values == sorted(values, reverse=True)


@pytest.mark.slow  # a timing assertion
def test_whole_catalog_search_is_fast():
    names = CATALOG.names()
    start = time.perf_counter()
    result = search(PRESETS["mixtral-8x22b"], CATALOG, names, names, tbt_slo_s=0.150, perf=perf("mixtral-8x22b"))
    elapsed = time.perf_counter() - start
    assert result.configurations > 100_000
    assert elapsed < 4.0  # about 0.5 s on the 2-core dev machine; slack for a loaded CI box


def test_unmeetable_slo_reports_the_fastest_plan():
    result = search(PRESETS["qwen3-235b-a22b"], CATALOG, ["H100"], ["H100"], tbt_slo_s=0.001,
                    perf=perf("qwen3-235b-a22b"))
    assert result.candidates == []
    assert result.fastest is not None and result.fastest.tbt > 0.001


@pytest.mark.parametrize("memory_gb, match", [
    (1, "the attention half does not fit any TP size on T4G: it needs 10.8 GB"),  # 8 x 1 GB < weights
    (4, r"one expert \(33.8 GB across its 56 MoE layers\) does not fit any TP size on T4G"),
])
def test_model_that_fits_nowhere(tmp_path, memory_gb, match):
    path = tmp_path / "tiny-gpus.yaml"
    path.write_text(f"gpus:\n  T4G: {{memory_gb: {memory_gb}, hbm_gbps: 300, bf16_tflops: 65, nic_gbps: 100, "
                    "link_gbps: 32, gpus_per_node: 8, power_w: 70, price: 0.3}\n")
    with pytest.raises(PlanError, match=match):
        search(PRESETS["mixtral-8x22b"], Catalog.load(path), ["T4G"], ["T4G"], tbt_slo_s=0.15,
               perf=perf("mixtral-8x22b"))


@pytest.mark.parametrize("model", ["qwen3-30b-a3b", "qwen3-235b-a22b"])
def test_plan_keeps_attention_tp_a_divisor_of_qwen3s_4_kv_heads(model, tmp_path, capsys):
    """tp 8 would leave each attention rank half a KV head: neither a candidate nor the plan written."""
    from megainfer.cli import main

    path, report = tmp_path / "plan.yaml", tmp_path / "plan.json"
    assert main(["plan", "--model", model, "--gpus", "H20,L40S,H800", "-o", str(path), "--json", str(report)]) == 0
    candidates = json.loads(report.read_text())["candidates"]
    assert candidates and {c["tp_a"] for c in candidates} <= {1, 2, 4}
    assert 8 in {c["tp_e"] for c in candidates}  # the rule is attention's: experts still take tp 8
    assert Plan.load(path).attention.tp in (1, 2, 4)


def test_expert_tp_divides_the_expert_intermediate_size():
    """An intermediate size of 772 = 4 x 193 splits over 1, 2 or 4 expert ranks, not 8."""
    model = dataclasses.replace(PRESETS["qwen3-30b-a3b"], name="qwen3-772", expert_intermediate_size=772)
    result = search(model, CATALOG, ["H20", "L40S"], ["H20", "L40S"], tbt_slo_s=0.150, perf=PerfModel(model, 730))
    assert {c.tp_e for c in result.candidates} == {1, 2, 4}
    with pytest.raises(PlanError, match=r"experts\.tp 8 does not divide qwen3-772's expert intermediate size 772.*"
                                        r"set experts\.tp to 1, 2 or 4"):
        evaluate_plan(model, PerfModel(model, 730), CATALOG, attention_gpu="H20", tp_a=4, n_a=2, expert_gpu="L40S",
                      tp_e=8, experts_per_node=8, m=2, batch=64)


def test_unknown_gpu_lists_known_ones():
    with pytest.raises(PlanError, match="unknown GPU 'H30'.*H20.*L40S"):
        CATALOG["H30"]


@pytest.mark.parametrize("body, match", [
    ("gpus: {X: {memory_gb: 1}}", r"gpus\.X\.hbm_gbps is missing"),
    ("gpus: {X: {memory_gb: -1, hbm_gbps: 1, bf16_tflops: 1, nic_gbps: 1, link_gbps: 1, gpus_per_node: 8, "
     "power_w: 1, price: 1}}", r"gpus\.X\.memory_gb must be a positive number"),
    ("gpus: {X: {memroy_gb: 1}}", r"gpus\.X\.memroy_gb is not a catalog field"),
    ("gpus: [1, 2]", "non-empty 'gpus' mapping"),
    ("gpus: {X: {memory_gb: 1\n", "not valid YAML at line"),
])
def test_malformed_catalog_names_the_field(tmp_path, body, match):
    path = tmp_path / "catalog.yaml"
    path.write_text(body)
    with pytest.raises(PlanError, match=match):
        Catalog.load(path)


def test_user_prices_change_the_ranking_metric():
    cheap = CATALOG.with_prices({"H800": 0.5})
    assert cheap["H800"].price == 0.5 and CATALOG["H800"].price == 5.28
    with pytest.raises(PlanError, match="must be positive"):
        CATALOG.with_prices({"H800": 0})


def test_calibration_replaces_the_roofline(tmp_path):
    path = tmp_path / "cal.yaml"
    path.write_text("attention: {H20: {tp2: {k1: 1.0e-6, k2: 2.0e-4}}}\n"
                    "experts: {L40S: {tp1: {k3: 3.0e-6, k4: 1.0e-4}}}\n"
                    "network: {utilization: [[1024, 0.1], [1048576, 0.9]]}\n")
    cal = Calibration.load(path)
    p = perf("mixtral-8x22b", calibration=cal)
    c = evaluate_plan(PRESETS["mixtral-8x22b"], p, CATALOG, attention_gpu="H20", tp_a=2, n_a=2, expert_gpu="L40S",
                      tp_e=1, experts_per_node=1, m=2, batch=800)
    assert c.t_a == pytest.approx(1e-6 * 200 + 2e-4)  # b_a = 800 / 2 / 2
    assert c.t_e == pytest.approx(3e-6 * 100 + 1e-4)  # b_e = 400 * 2 / 8
    assert float(p.utilization(1024)) == pytest.approx(0.1)
    uncalibrated = evaluate_plan(PRESETS["mixtral-8x22b"], p, CATALOG, attention_gpu="H20", tp_a=1, n_a=2,
                                 expert_gpu="L40S", tp_e=1, experts_per_node=1, m=2, batch=800)
    assert uncalibrated.t_a != pytest.approx(1e-6 * 400 + 2e-4)  # tp1 is not calibrated: roofline


@pytest.mark.parametrize("body, match", [
    ("attention: {H20: {two: {k1: 1, k2: 1}}}", "keys under a GPU are tp1"),
    ("attention: {H20: {tp2: {k1: 1}}}", "needs k1 and k2"),
    ("experts: {L40S: {tp1: {k3: -1, k4: 0}}}", "non-negative"),
    ("network: {utilization: [[1024, 2.0], [2048, 0.5]]}", r"must lie in \(0, 1\]"),
    ("bogus: 1", "unknown key 'bogus'"),
])
def test_malformed_calibration_names_the_field(tmp_path, body, match):
    path = tmp_path / "cal.yaml"
    path.write_text(body)
    with pytest.raises(PlanError, match=match):
        Calibration.load(path)


def test_explain_names_the_bounding_side():
    c = search(PRESETS["dbrx"], CATALOG, TABLE3, TABLE3, tbt_slo_s=0.150, perf=perf("dbrx")).candidates[0]
    text = explain(c, 40)
    assert ("experts bound the pipeline" in text) == (c.t_e >= c.t_a)
    assert f"TBT = {c.tbt * 1e3:.1f} ms" in text
