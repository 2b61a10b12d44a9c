"""DeepSeek-V2/V3 in the planner: MLA's compressed KV cache (held whole by every attention rank),
shared experts and dense first layers on the attention side, routed experts and the M2N rounds
over the MoE layers only (docs/planner.md, "DeepSeek")."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest

from megainfer.errors import PlanError
from megainfer.presets import PRESETS
from planner.catalog import Catalog
from planner.colocated import best_colocated
from planner.efficiency_curves import EfficiencyCurves
from planner.operator_costs import DevicePeaks, OperatorCosts
from planner.perf_model import PerfModel
from planner.search import evaluate_plan, search
from planner.step_cost_model import AttentionWork, ColocatedStepModel, LayerClass
from planner.timeline import makespan, schedule

CATALOG = Catalog.load()
GPUS = ["H800", "H20", "L40S"]
V3 = PRESETS["deepseek-v3"]
# V3 with its attention as plain multi-head attention: 128 KV heads of 192 values cached for k and
# for v (2 x 128 x 192 per token and layer; even unpadded, 128 x (192 + 128) = 40,960, 71x MLA's 576).
V3_MHA = dataclasses.replace(V3, name="deepseek-v3-mha", kv_lora_rank=0, q_lora_rank=None, qk_rope_head_dim=0,
                             v_head_dim=0)


def ops(model, tp, gpu="H800") -> OperatorCosts:
    return OperatorCosts(model, tp, DevicePeaks.of(CATALOG[gpu]), EfficiencyCurves.load(gpu))


def test_mla_caches_576_values_per_token_and_layer_held_whole_by_every_rank():
    assert V3.kv_cache_width == 512 + 64
    assert V3.kv_bytes_per_token("bfloat16") == 61 * 576 * 2 == 70_272
    perf = PerfModel(V3, 730)
    assert perf.kv_bytes_per_token_layer == 576 * 2
    assert perf.kv_bytes_per_sequence() == 736 * 70_272  # 730 tokens in whole 16-token blocks
    # A rank reads the whole latent for its heads; KV heads split over the ranks.
    assert ops(V3, 8).kv_bytes_per_token == ops(V3, 1).kv_bytes_per_token == 1152
    dbrx = PRESETS["dbrx"]
    assert ops(dbrx, 8).kv_bytes_per_token == 2 * 8 * 128 * 2 / 8


def test_mla_decode_flops_in_the_absorbed_form_and_the_absorption_in_the_dense_work():
    costs = ops(V3, 2)
    # per (query head, cached token): scores over latent + rotary key, values summed over the latent
    assert costs.decode_pair_flops == 64 * (2 * 576 + 2 * 512)
    # W_UK and W_UV (kv_lora_rank x heads x (qk_nope + v)) are attention-side weights: `dense` runs them per token
    assert V3.attention_side_params() * 2 > 2 * 512 * 128 * (128 + 128)
    assert costs.attn_params == V3.attention_side_params() / 2
    # Prompt chunks run decompressed: the cached context's latents through W_UK/W_UV as well.
    assert costs.attention_prefill(512, 4096) > costs.attention_prefill(512, 0)


def test_expert_nodes_hold_the_moe_layers_experts_only():
    perf = PerfModel(V3, 730)
    one_node = 8 * V3.expert_params * 2  # 8 experts in bf16, per layer
    assert V3.num_moe_layers == 58
    fits_58 = one_node * 58 / 0.9  # memory that just holds them at 90%
    assert perf.expert_node_fits(fits_58 * 1.001, 1, 8)
    assert not perf.expert_node_fits(fits_58 * 0.999, 1, 8)
    tiny = dataclasses.replace(CATALOG["L40S"], memory_gb=0.5)  # 8 x 0.5 GB hold no 5.1 GB expert
    with pytest.raises(PlanError, match=r"one expert \(5.1 GB across its 58 MoE layers\)"):
        search(V3, Catalog({"H800": CATALOG["H800"], "L40S": tiny}), ["H800"], ["L40S"], tbt_slo_s=0.15, perf=perf)


def test_plan_search_finds_deepseek_v3_plans_over_h800_h20_l40s():
    perf = PerfModel(V3, 730)
    result = search(V3, CATALOG, GPUS, GPUS, tbt_slo_s=0.150, perf=perf)
    assert result.candidates
    best = result.candidates[0]
    assert best.tbt <= 0.150
    assert best.batch <= best.n_a * perf.max_sequences_per_attention_node(
        CATALOG[best.attention_gpu].memory_bytes, best.tp_a)
    # A dense layer's FFN (18,432 wide) outweighs an MoE layer's shared expert and router.
    assert best.t_dense > best.t_a > 0
    assert best_colocated(V3, CATALOG, GPUS, tbt_slo_s=0.150, perf=perf) is not None
    lite = PRESETS["deepseek-v2-lite"]
    assert search(lite, CATALOG, ["H20", "L40S"], ["H20", "L40S"], tbt_slo_s=0.150,
                  perf=PerfModel(lite, 730)).candidates


def test_mla_fits_ten_times_the_sequences_of_the_same_model_with_mha():
    for gpu, tp in (("H800", 8), ("H20", 8), ("H20", 4)):
        memory = CATALOG[gpu].memory_bytes
        mla = PerfModel(V3, 730).max_sequences_per_attention_node(memory, tp)
        mha = PerfModel(V3_MHA, 730).max_sequences_per_attention_node(memory, tp)
        assert mla >= 10 * mha > 0, (gpu, tp, mla, mha)
    # On one H800 the MHA form does not hold a single sequence beside its weights; MLA holds hundreds.
    assert PerfModel(V3_MHA, 730).max_sequences_per_attention_node(CATALOG["H800"].memory_bytes, 1) < 1
    assert PerfModel(V3, 730).max_sequences_per_attention_node(CATALOG["H800"].memory_bytes, 1) > 600


def test_the_dry_run_sizes_mla_kv_as_the_planner_does():
    from deploy.runtime_config import check_batch, runtime_of

    perf = PerfModel(V3, 730)
    for tp in (1, 2, 8):  # one attention node at the planner's capacity: the dry run's KV holds that many
        planned = int(perf.max_sequences_per_attention_node(CATALOG["H800"].memory_bytes, tp))
        c = evaluate_plan(V3, perf, CATALOG, attention_gpu="H800", tp_a=tp, n_a=1, expert_gpu="L40S", tp_e=1,
                          experts_per_node=2, m=4, batch=planned)
        check = check_batch(runtime_of(c.to_plan("deepseek-v3", "bfloat16", 150.0, 730)),
                            CATALOG["H800"].memory_bytes)
        assert planned <= check.kv_sequences <= 1.02 * planned, (tp, check.kv_sequences, planned)


def test_dense_layers_add_attention_time_but_no_rounds():
    perf = PerfModel(V3, 730)
    rng = random.Random(0)
    for _ in range(50):
        t_a, t_e, t_c, t_d = (rng.uniform(0.1, 2) for _ in range(4))
        m = rng.randint(1, 5)
        # The rounds: the 58 MoE layers' pipeline; the 3 dense layers: m micro-batches each, on attention only.
        assert float(perf.iteration_time(t_a, t_e, t_c, m, 0.0, t_d)) == pytest.approx(
            makespan(schedule(t_a, t_e, t_c, m, 58)) + 3 * m * t_d)
    c = evaluate_plan(V3, perf, CATALOG, attention_gpu="H800", tp_a=1, n_a=8, expert_gpu="L40S", tp_e=1,
                      experts_per_node=2, m=4, batch=4096)
    with_dense = float(perf.iteration_time(c.t_a, c.t_e, c.t_c, c.m, 0.0, c.t_dense))
    rounds_only = float(perf.iteration_time(c.t_a, c.t_e, c.t_c, c.m))
    assert with_dense - rounds_only == pytest.approx(3 * 4 * c.t_dense)


def test_the_colocated_step_prices_routed_experts_over_the_moe_layers_only():
    lite = PRESETS["deepseek-v2-lite"]  # layer 0 dense
    step = ColocatedStepModel(lite, CATALOG["H100"], 1)
    work = AttentionWork(64, 64 * 1000.0)
    all_moe = step.step([LayerClass(27, 64, work, 40)], sampled=64, seqs=64)
    first_dense = step.step([LayerClass(27, 64, work, 40, dense_layers=1)], sampled=64, seqs=64)
    assert first_dense.operators["moe"] == pytest.approx(all_moe.operators["moe"] * 26 / 27)
    assert first_dense.expert_bytes == 26 * 40 * lite.expert_params * 2
    assert first_dense.operators["dense"] > all_moe.operators["dense"]  # the dense FFN outweighs the shared experts
    # MLA's KV held whole by every rank of the instance: tp 2 holds each token twice.
    one, two = ColocatedStepModel(lite, CATALOG["H100"], 1), ColocatedStepModel(lite, CATALOG["H100"], 2)
    weights = lite.num_params * 2
    per_token = lite.kv_bytes_per_token("bfloat16")
    assert two.kv_capacity_tokens() == int((2 * CATALOG["H100"].memory_bytes * 0.9 - weights) // (2 * per_token))
    assert one.kv_capacity_tokens() == int((CATALOG["H100"].memory_bytes * 0.9 - weights) // per_token)


def test_the_plan_simulator_draws_the_moe_layers_and_matches_the_planner():
    from megainfer.tools.simulator.disaggregated import PlanSimulator

    perf = PerfModel(V3, 730)
    c = evaluate_plan(V3, perf, CATALOG, attention_gpu="H800", tp_a=1, n_a=8, expert_gpu="L40S", tp_e=1,
                      experts_per_node=2, m=4, batch=4096)
    sim = PlanSimulator(c.to_plan("deepseek-v3", "bfloat16", 150.0, 730), V3, perf, CATALOG, seed=1)
    assert sim.node_shares.shape[0] == 58
    result = sim.run(3)
    assert np.all(result.tbt_s > 0)
    assert result.tbt_over_prediction == pytest.approx(1.0, rel=0.1)
