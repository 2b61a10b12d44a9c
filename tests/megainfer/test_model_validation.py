"""The performance model checked against published rows it was not fitted to: the structural
terms that carry it across models (expert width, expert storage format), the simulator's
saturation measures, and the leave-one-out report end to end on a small subset."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from megainfer.tools.bench.workload import SimRequest
from megainfer.engine_config import EngineConfig
from megainfer.presets import PRESETS
from megainfer.tools.simulator.published_rows import MXFP4_BYTES, ROWS
from megainfer.tools.simulator.sim import Simulator
from megainfer.tools.simulator.validation import (format_report, predict, row_requests, row_spec, validate,
                                                  with_width)
from planner.catalog import Catalog
from planner.efficiency_curves import EfficiencyCurves
from planner.prediction_error import PredictionError
from planner.step_cost_model import ColocatedStepModel
from tests.helpers import megainfer

H100 = Catalog.load()["H100"]


def moe_seconds(model: str, tp: int, curves: EfficiencyCurves, **kw) -> float:
    step = ColocatedStepModel(PRESETS[model], H100, tp, curves=curves, **kw)
    return step.ops.moe(4096, np.full(PRESETS[model].num_moe_layers, 64))


def test_the_width_term_prices_narrow_experts_slower_and_keeps_the_reference_width():
    committed = EfficiencyCurves.load("H100")
    assert committed.moe_width_half == 0.0  # the committed fit has no width term: nothing changes
    widened = with_width(committed).with_values(moe_overlap=0.0)  # the width term alone
    # Qwen3-30B-A3B at TP 2 (384 wide per rank), what the curves were fitted on: the same price.
    assert moe_seconds("qwen3-30b-a3b", 2, widened) == pytest.approx(moe_seconds("qwen3-30b-a3b", 2, committed))
    # gpt-oss-120b's 2,880-wide experts at TP 2 (1,440 per rank) are priced faster per FLOP.
    ratio = moe_seconds("gpt-oss-120b", 2, widened) / moe_seconds("gpt-oss-120b", 2, committed)
    assert ratio < 0.7


def test_mxfp4_experts_read_a_quarter_of_the_bytes_and_leave_room_for_kv():
    model = PRESETS["gpt-oss-120b"]
    bf16 = ColocatedStepModel(model, H100, 4)  # 234 GB in bf16: not on 2 H100s, as the paper's fp4 is
    fp4 = ColocatedStepModel(model, H100, 4, expert_bytes_per_param=MXFP4_BYTES)
    assert fp4.expert_bytes_each == pytest.approx(bf16.expert_bytes_each * MXFP4_BYTES / 2)
    assert fp4.kv_capacity_tokens() > 1.5 * bf16.kv_capacity_tokens()
    ColocatedStepModel(model, H100, 2, expert_bytes_per_param=MXFP4_BYTES).kv_capacity_tokens()  # fp4 fits on 2
    decode = [np.full(model.num_moe_layers, 60)]
    # Cheaper at decode sizes; by less than the bytes, since the fitted FLOP curve's half-saturation
    # (51 tokens per expert) also prices small GEMMs high (docs/performance-model.md, "Generalisation").
    assert fp4.ops.moe(64, decode[0]) < 0.9 * bf16.ops.moe(64, decode[0])


def _kernels(cost) -> float:
    """A step's layers' kernel seconds (what hides the host's issuing of them)."""
    return sum(cost.operators[k] for k in ("dense", "attention", "moe", "allreduce"))


def test_a_step_takes_the_longer_of_its_layers_kernels_and_the_hosts_issuing_of_them():
    from planner.step_cost_model import AttentionWork, LayerClass
    model = PRESETS["qwen3-30b-a3b"]
    curves = EfficiencyCurves.load("H100").with_values(layer_host_s=50e-6)
    step = ColocatedStepModel(model, H100, 2, curves=curves)
    decode = AttentionWork(8, 8 * 4000.0)
    chunk = decode + AttentionWork(prefill_chunks=((504, 2000),))
    chunked = step.step([LayerClass(48, 512, chunk, 100)], sampled=8, seqs=9)
    # 50 us of issuing per layer hides behind a 512-token layer's kernels: the GPU never waits.
    assert chunked.operators["host"] == 0.0
    outside = sum(chunked.operators[k] for k in ("lm_head", "sampling", "step_overhead"))
    layer_s = (chunked.seconds - outside) / 48
    assert 50e-6 < layer_s < 5e-3
    # 5 ms per layer: the host sets the pace, the step's layers take 48 of its issuing.
    slow_host = ColocatedStepModel(model, H100, 2, curves=curves.with_values(layer_host_s=5e-3))
    host_bound = slow_host.step([LayerClass(48, 512, chunk, 100)], sampled=8, seqs=9)
    assert host_bound.operators["host"] == pytest.approx(48 * (5e-3 - layer_s))
    assert host_bound.seconds == pytest.approx(48 * 5e-3 + outside)
    # A decode step's layers are issued too (graph pieces and an eager attention call each).
    decoding = step.step([LayerClass(48, 8, decode, 40)], sampled=8, seqs=8)
    kernels = _kernels(decoding)
    assert decoding.operators["host"] == pytest.approx(max(0.0, 48 * 50e-6 - kernels))
    slow_decode = slow_host.step([LayerClass(48, 8, decode, 40)], sampled=8, seqs=8)
    assert slow_decode.operators["host"] == pytest.approx(48 * 5e-3 - kernels)
    # Layered: the host issues the cohort's 3 heavy layers and the 45 light ones while the GPU
    # works through the heavy ones, so only the step's total kernels hide the issuing.
    layered = slow_host.step([LayerClass(3, 8 + 8192, chunk, 128), LayerClass(45, 8, decode, 40)], sampled=8, seqs=9)
    layered_kernels = _kernels(layered)
    assert layered.operators["host"] == pytest.approx(max(0.0, 48 * 5e-3 - layered_kernels))
    # Layers no token passes are not issued.
    lone = slow_host.step([LayerClass(3, 8192, AttentionWork(prefill_chunks=((8192, 0),)), 128),
                           LayerClass(45, 0, AttentionWork(), 0)], sampled=0, seqs=1)
    lone_kernels = _kernels(lone)
    assert lone.operators["host"] == pytest.approx(max(0.0, 3 * 5e-3 - lone_kernels))
    # Power beyond idle counts only kernels at work, not the GPU's waiting for the host.
    assert slow_decode.energy_j < slow_host.power_w * slow_decode.seconds
    with pytest.raises(Exception, match="layer_host_s"):
        EfficiencyCurves.from_dict({**_curve_fields(), "layer_host_s": -1}, "test")
    # A file written before the term was replaced says what to do, not just "unknown field".
    with pytest.raises(Exception, match="eager_layer_s is no longer a curves field.*layer_host_s.*--write-curves"):
        EfficiencyCurves.from_dict({**_curve_fields(), "eager_layer_s": 1e-5}, "test")


def _curve_fields() -> dict:
    import yaml
    from planner.efficiency_curves import DEFAULT_CURVES
    return yaml.safe_load(DEFAULT_CURVES.read_text())["default"]


def run(rate: float, n: int = 120, poisson: bool = False) -> dict:
    model = PRESETS["qwen3-30b-a3b"]
    step = ColocatedStepModel(model, H100, 2)
    gaps = np.random.default_rng(0).exponential(1 / rate, n) if poisson else np.full(n, 1 / rate)
    requests = [SimRequest(float(t), 2000, 300) for t in np.cumsum(gaps) - gaps[0]]
    return Simulator(model, step, EngineConfig(max_num_batched_tokens=512)).run(requests).summary(10.0, 0.125)


def test_the_served_rate_tells_a_kept_up_instance_from_a_saturated_one():
    light, heavy = run(1.0), run(40.0)
    assert light["served_rate"] == pytest.approx(light["offered_rate"], rel=0.05)
    assert light["offered_rate"] == pytest.approx(1.0, rel=0.01) and light["queue_growth"] < 2
    assert heavy["served_rate"] < 0.5 * heavy["offered_rate"] and heavy["queue_growth"] > 3
    # Poisson arrivals: the first requests meet an empty instance and finish sooner than later
    # ones, which a count of completions in a window mistakes for falling behind; the wait's
    # growth does not.
    poisson = run(1.5, n=200, poisson=True)
    assert poisson["served_rate"] == pytest.approx(poisson["offered_rate"], rel=0.05)


def test_published_rows_are_well_formed():
    from megainfer.tools.simulator.published_rows import OFFLINE, SERVING, SINGLE_PROMPT
    kinds = [r.kind for r in ROWS]
    assert (kinds.count(SERVING), kinds.count(OFFLINE), kinds.count(SINGLE_PROMPT)) == (20, 2, 2)
    for row in ROWS:
        assert row.model in PRESETS and row.policy in ("chunked", "layered")
        assert row.max_layer_groups in (2, 4, 8, 12, 16)  # the paper's --num-stages
        expected = {SERVING: {"ttft", "tbt"}, OFFLINE: {"throughput"}, SINGLE_PROMPT: {"ttft"}}[row.kind]
        assert set(row.measured) == expected and all(v > 0 for v in row.measured.values())
    # Run as the paper's driver ran them: ten minutes of arrivals (6,000 at most), 1,024 running
    # sequences on 8 GPUs; gpt-oss-20b's layered rows with its --num-stages 12.
    by_label = {r.label: r for r in ROWS}
    assert by_label["Qwen3-30B 2xH100 arXiv 1.3 chunked"].num_requests == 780
    assert by_label["gpt-oss-120b 8xH100 ShareGPT 6.5 chunked"].num_requests == 3900
    assert [r.num_requests for r in ROWS if r.kind != SERVING] == [300, 300, 1, 1]
    assert {r.max_num_seqs for r in ROWS if r.gpus == 8} == {1024} and {r.max_num_seqs for r in ROWS if r.gpus == 2} == {256}
    assert {r.max_layer_groups for r in ROWS if r.model == "gpt-oss-20b" and r.policy == "layered"} == {12}
    # Stages by the engine's get_num_stages table, which has rows for 4, 12 and 16 only: the
    # N_lg sweep (2, 4, 8, 16 at 1.4 req/s) passes every cohort in N_lg stages.
    sweep = [r for r in ROWS if r.rate == 1.4]
    assert [r.max_layer_groups for r in sweep] == [2, 4, 8, 16] and all(r.group_table == () for r in sweep)
    n12 = by_label["gpt-oss-120b 8xH100 ShareGPT 6.5 layered N12"]
    settings = EngineConfig(prefill_policy="layered", max_layer_groups=12,
                            layered_group_table=n12.group_table).layered_settings(36)
    assert [settings.groups(t) for t in (400, 1000, 2000, 3000, 5000)] == [1, 2, 4, 6, 12]
    assert by_label["Qwen3-30B 2xH100 arXiv 1.3 layered"].group_table[-1] == (4096, 8)
    layered_configs = {r.config for r in ROWS if r.policy == "layered"}
    chunked_configs = {r.config for r in ROWS if r.policy == "chunked"}
    assert len(layered_configs & chunked_configs) >= 6  # the directions the report checks, offline's too


def test_offline_and_single_prompt_rows_are_simulated_as_measured():
    curves = EfficiencyCurves.load("H100")
    offline = next(r for r in ROWS if r.label.endswith("offline chunked"))
    p = predict(offline, curves, num_requests=40)
    # Every request at once: a throughput, not a served rate against an offered one.
    assert set(p.errors(offline)) == {"throughput"} and 100 < p.throughput_tok_s < 1000
    assert not p.saturated(offline)
    single = next(r for r in ROWS if r.label.endswith("chunk 8192"))
    p = predict(single, curves)
    assert set(p.errors(single)) == {"ttft"} and p.ttft_mean_s == pytest.approx(0.200, rel=0.25)


def test_each_prediction_is_the_mean_of_its_draws():
    from megainfer.tools.simulator.validation import Prediction, _Simulations
    curves = EfficiencyCurves.load("H100")
    serving, single = ROWS[0], ROWS[-1]
    sims = _Simulations([serving, single], 40, workers=1, seeds=2)
    draws = sims.run([(serving, curves), (single, curves)])
    assert [len(d) for d in draws] == [2, 1]  # one prompt alone has no arrivals to draw
    assert draws[0] == [predict(serving, curves, 40, seed) for seed in (0, 1)]
    assert draws[0][0].ttft_mean_s != draws[0][1].ttft_mean_s  # different arrivals and lengths
    mean = Prediction.mean(draws[0])
    assert mean.ttft_mean_s == pytest.approx((draws[0][0].ttft_mean_s + draws[0][1].ttft_mean_s) / 2)
    # A prediction's draws offer exactly the row's rate; free draws, as the paper's run, stray from it.
    assert all(d.offered_rate == pytest.approx(serving.rate, rel=1e-9) for d in draws[0])
    free = sims.run([(serving, curves)], exact_rate=False)[0]
    assert free == [predict(serving, curves, 40, seed, exact_rate=False) for seed in (0, 1)]
    assert all(abs(d.offered_rate / serving.rate - 1) > 1e-3 for d in free)


def test_the_requests_way_outside_the_engine_adds_to_every_ttft_and_to_no_gap_between_tokens():
    curves = EfficiencyCurves.load("H100")
    assert curves.request_latency_s == 0.0  # off until an entry sets it
    row = ROWS[0]
    base = predict(row, curves, 40)
    late = predict(row, curves.with_values(request_latency_s=0.05), 40)
    assert late.ttft_mean_s == pytest.approx(base.ttft_mean_s + 0.05)
    assert late.tbt_mean_s == base.tbt_mean_s and late.throughput_tok_s == base.throughput_tok_s


def test_a_figure_that_one_draw_swings_weighs_less_in_the_fit():
    from megainfer.tools.simulator.validation import (MODEL_SIGMA, Prediction, draw_spread, residual_weights,
                                                      residuals)
    serving, single = ROWS[0], ROWS[-1]
    steady = [Prediction(2.8, 0.032, 1.3), Prediction(2.8, 0.032, 1.3)]
    swinging = [Prediction(1.4, 0.030, 1.3), Prediction(5.6, 0.034, 1.3)]
    assert draw_spread(steady, serving) == {"ttft": 0.0, "tbt": 0.0}
    spread = draw_spread(swinging, serving)
    assert spread["ttft"] == pytest.approx(math.log(4) / math.sqrt(2))  # sample deviation of log 1.4, log 5.6
    assert draw_spread(swinging[:1], serving) == {"ttft": 0.0, "tbt": 0.0}  # one draw: nothing to tell
    runs = [draw_spread(steady, serving), spread, {"ttft": 0.0}]
    w = residual_weights(runs, runs, seeds=2)
    assert list(w[:2]) == [1.0, 1.0]  # no draw noise: the model's own error alone
    assert w[2] == pytest.approx(MODEL_SIGMA / math.sqrt(MODEL_SIGMA ** 2 + spread["ttft"] ** 2 * 1.5))
    # The paper's one free draw counts whole, the prediction's mean of draws at the exact rate by 1/seeds.
    tight = {"ttft": spread["ttft"] / 4, "tbt": spread["tbt"] / 4}
    w_tight = residual_weights(runs, [runs[0], tight, runs[2]], seeds=2)
    assert w_tight[2] == pytest.approx(MODEL_SIGMA / math.sqrt(MODEL_SIGMA ** 2 + spread["ttft"] ** 2 * (1 + 1 / 32)))
    assert w[2] < w_tight[2]
    assert w[2] < 0.15 and 0.5 < w[3] < 1.0  # the swinging TTFT counts for little, its TBT (13% apart) more
    assert w[5] == 1.0  # a row of one figure: its empty slot
    r = residuals([Prediction.mean(swinging)], [serving], w[2:4])
    assert r == pytest.approx(residuals([Prediction.mean(swinging)], [serving]) * w[2:4])
    assert single.kind == "single prompt"


def test_the_leave_one_out_report_runs_end_to_end_on_a_subset(tmp_path):
    rows = [r for r in ROWS if r.model == "qwen3-30b-a3b" and r.rate == 1.3] + [ROWS[-1]]
    report = validate(EfficiencyCurves.load("H100"), rows=rows, num_requests=40, workers=2, seeds=2)
    assert report.seeds == 2 and "mean of 2 simulations" in format_report(report)
    assert set(report.rows[0].spread) == {"ttft", "tbt"} and report.rows[-1].spread == {"ttft": 0.0}
    assert report.as_dict()["rows"][0]["draw_spread"] == report.rows[0].spread
    spreads = {(r.row.label, name): s for r in report.rows for name, s in r.spread.items()}
    assert report.swung_by_the_draw(bar=0.0) == [key for key, s in spreads.items() if s > 0]
    assert report.swung_by_the_draw(bar=math.inf) == []
    assert "figures one draw moves by more than 35%" in format_report(report)
    assert "swung_by_the_draw" in report.as_dict()
    assert [r.row for r in report.rows] == rows
    for r in report.rows:  # every figure is a simulation's
        assert all(r.fitted.values()[m] > 0 and r.left_out.values()[m] > 0 for m in r.row.measured)
    assert report.directions("fitted")[0][0].startswith("Qwen3-30B 2xH100 arXiv 1.3 layered")
    text = format_report(report)
    assert "mean absolute error, left out" in text and "layered vs chunked" in text and "fitted curves" in text
    band = report.error_band()
    assert set(band) == {"ttft", "tbt", "all"} and all(v >= 0 for v in band.values())
    assert report.within("left_out")[1] == 5  # two serving rows' two figures and the single prompt's one
    # The fit as a curves file plan and simulate take with --curves: every fitted term, read back.
    import argparse
    from megainfer.cli.simulate import write_fitted_curves
    path = tmp_path / "curves.yaml"
    write_fitted_curves(report, argparse.Namespace(curves=None, write_curves=str(path), fit_steps=1))
    loaded = EfficiencyCurves.load("H100", path)
    for name in ("moe_overlap", "layer_host_s", "moe_quantized_flops_half", "moe_width_half"):
        assert getattr(loaded, name) == pytest.approx(getattr(report.fitted_curves, name), rel=1e-3), name
    assert "published H100 rows" in loaded.source
    assert set(report.as_dict()) >= {"rows", "mean_abs_error", "directions", "saturated", "bars"}


def test_one_row_is_simulated_as_the_simulate_command_runs_it():
    row = dataclasses.replace(ROWS[0])
    p = predict(row, EfficiencyCurves.load("H100"), num_requests=60)
    assert p.ttft_mean_s > 0 and p.tbt_mean_s > 0 and p.served_rate > 0


def test_plan_and_simulate_print_the_error_band_and_plan_leaves_headroom(tmp_path):
    band = PredictionError.load()
    assert 0 < band.tbt < 1 and band.rows == len(ROWS)
    assert band.headroom_slo_s(0.150) == pytest.approx(0.150 / (1 + band.tbt))
    out = megainfer("plan", "--model", "mixtral-8x22b", "--gpus", "H20,L40S", "--tbt-slo-ms", "150")
    assert out.returncode == 0, out.stderr
    assert f"planned to {150 / (1 + band.tbt):.1f} ms" in out.stdout and "expected error" in out.stdout
    out = megainfer("simulate", "--write-error")
    assert out.returncode != 0 and "add --validate" in out.stderr and "Traceback" not in out.stderr
    missing = tmp_path / "none.yaml"
    with pytest.raises(Exception, match="regenerate it"):
        PredictionError.load(missing)


def test_the_expert_gemms_overlap_and_the_4_bit_kernel_are_off_until_an_entry_sets_them():
    model = PRESETS["qwen3-30b-a3b"]
    committed = EfficiencyCurves.load("H100")
    assert committed.moe_overlap == 0 and committed.moe_quantized_flops_half == 0
    ops = ColocatedStepModel(model, H100, 2, curves=committed).ops
    summed = ColocatedStepModel(model, H100, 2, curves=committed.with_values(moe_overlap=1.0)).ops
    sharp = ColocatedStepModel(model, H100, 2, curves=committed.with_values(moe_overlap=64.0)).ops
    layers = np.full(model.num_moe_layers, 128)
    t_max, t_sum, t_sharp = ops.moe(1024, layers), summed.moe(1024, layers), sharp.moe(1024, layers)
    # p = 1 adds the weight streaming and the MMAs, a large p comes back to the roofline's max.
    assert t_max <= t_sharp < 1.02 * t_max and t_sum > 1.3 * t_max
    oss = PRESETS["gpt-oss-120b"]
    fp4 = committed.with_values(moe_quantized_flops_half=1.0)
    quantized = ColocatedStepModel(oss, H100, 8, curves=fp4, expert_bytes_per_param=MXFP4_BYTES).ops
    plain = ColocatedStepModel(oss, H100, 8, curves=committed, expert_bytes_per_param=MXFP4_BYTES).ops
    bf16 = ColocatedStepModel(oss, H100, 8, curves=fp4).ops  # bf16 experts keep the bf16 kernel's curve
    few = np.full(oss.num_moe_layers, 128)
    assert quantized.moe(512, few) < 0.5 * plain.moe(512, few)  # 16 tokens per expert: no longer FLOP-priced
    assert bf16.moe(512, few) == pytest.approx(ColocatedStepModel(oss, H100, 8, curves=committed).ops.moe(512, few))
    # The 4-bit kernel's weight streaming at a share of the bf16 one's: decode's few tokens per
    # expert are bandwidth-bound, so half the bandwidth doubles their weight streaming (the rest of
    # the layer's expert time stays); bf16 experts keep theirs.
    assert committed.moe_quantized_bandwidth == 0
    slow = fp4.with_values(moe_quantized_bandwidth=0.5)
    decode = np.full(oss.num_moe_layers, 32)
    streamed = ColocatedStepModel(oss, H100, 8, curves=slow, expert_bytes_per_param=MXFP4_BYTES).ops
    assert 1.4 * quantized.moe(8, decode) < streamed.moe(8, decode) <= 2 * quantized.moe(8, decode)
    assert ColocatedStepModel(oss, H100, 8, curves=slow).ops.moe(8, decode) == pytest.approx(bf16.moe(8, decode))


def test_the_paper_engines_gpt_oss_attends_every_layer_in_full():
    row = next(r for r in ROWS if r.model == "gpt-oss-20b")
    assert not row.windowed_attention  # its GptOssAttention passes no window to its kernel
    curves = EfficiencyCurves.load("H100")
    full = predict(row, curves, num_requests=30)
    windowed = predict(dataclasses.replace(row, windowed_attention=True), curves, num_requests=30)
    assert full.tbt_mean_s > windowed.tbt_mean_s  # every layer reads the whole context


def test_kv_heads_fewer_than_the_ranks_are_copied_not_split():
    """Qwen3-235B-A22B has 4 KV heads; at TP 8 (the paper's 8-H100 rows) each rank holds one
    whole head, two ranks a copy of each, as vLLM runs it: a rank reads and stores as much KV per
    token as at TP 4, and the instance holds half the tokens that splitting 4 heads 8 ways would."""
    model = PRESETS["qwen3-235b-a22b"]
    assert model.num_kv_heads == 4
    assert [model.kv_shards(tp) for tp in (1, 2, 4, 8)] == [1, 2, 4, 4]
    assert model.kv_shards(np.array([2, 8])).tolist() == [2, 4]  # the planner's vectorised search
    assert PRESETS["deepseek-v3"].kv_shards(8) == 1  # MLA: a whole latent on every rank
    at4, at8 = (ColocatedStepModel(model, H100, tp) for tp in (4, 8))
    assert at8.ops.kv_bytes_per_token == at4.ops.kv_bytes_per_token
    one_head = model.kv_cache_layers * model.kv_cache_width // model.num_kv_heads * 2  # bf16, every layer
    free = 8 * H100.memory_bytes * 0.9 - (model.num_params * 2)
    assert at8.kv_capacity_tokens() == pytest.approx(free / (8 * one_head), rel=1e-6)
    # Where the heads divide over the ranks nothing changes: 8 KV heads on 8 ranks, one each.
    oss = PRESETS["gpt-oss-120b"]
    assert oss.num_kv_heads == 8 and oss.kv_shards(8) == 8


def test_tuned_expert_tiles_stream_weights_faster_only_where_the_engine_has_them():
    model = PRESETS["qwen3-235b-a22b"]
    published = EfficiencyCurves.load("H100", "planner/efficiency_curves_published.yaml")
    assert published.moe_tuned_bandwidth > 1  # fitted on the two Qwen3-235B rows
    published = published.with_values(moe_tuned_bandwidth=0.0)
    tuned = published.with_values(moe_tuned_bandwidth=1.25)
    decode = np.full(model.num_moe_layers, 100)  # 64 tokens over 100 experts: weight streaming
    default_tiles = ColocatedStepModel(model, H100, 8, curves=tuned).ops.moe(64, decode)
    with_tiles = ColocatedStepModel(model, H100, 8, curves=tuned, tuned_expert_tiles=True).ops.moe(64, decode)
    untuned = ColocatedStepModel(model, H100, 8, curves=published, tuned_expert_tiles=True).ops.moe(64, decode)
    assert default_tiles == pytest.approx(ColocatedStepModel(model, H100, 8, curves=published).ops.moe(64, decode))
    assert untuned == pytest.approx(default_tiles)  # an entry without the term: tiles change nothing
    assert 0.78 * default_tiles < with_tiles < 0.9 * default_tiles
    # The paper's repository ships tiles for Qwen3-235B at TP 8 on H100 and for no other bf16 row.
    tuned_rows = {r.label for r in ROWS if r.tuned_expert_tiles}
    assert tuned_rows == {r.label for r in ROWS if r.model == "qwen3-235b-a22b"} and len(tuned_rows) == 2


def test_arxiv_rows_send_the_quoted_lengths_in_the_models_own_tokens():
    """The paper quotes arXiv's lengths in Llama-2 tokens; its driver tokenized each article with
    the served model's tokenizer, which makes fewer of them (Qwen's 0.944 as many, gpt-oss's
    0.889). ShareGPT's lengths are sent as quoted, and a lone prompt is its own length."""
    curves = EfficiencyCurves.load("H100")

    def mean_lengths(row):
        requests = row_requests(row, row_spec(row, curves, num_requests=400))
        return np.mean([q.input_len for q in requests]), np.mean([q.output_len for q in requests])

    qwen = next(r for r in ROWS if r.model == "qwen3-30b-a3b" and r.workload == "arxiv" and r.rate)
    oss = next(r for r in ROWS if r.model == "gpt-oss-120b" and r.workload == "arxiv")
    as_quoted = mean_lengths(dataclasses.replace(qwen, workload="sharegpt-lp"))
    assert dataclasses.replace(qwen, workload="sharegpt-lp").length_scale == 1.0
    (q_in, q_out), (o_in, o_out) = mean_lengths(qwen), mean_lengths(oss)
    assert q_in == pytest.approx(0.944 * 9194, rel=0.05) and o_in == pytest.approx(0.889 * 9194, rel=0.05)
    assert q_out == pytest.approx(0.944 * 231, rel=0.05) and o_out == pytest.approx(0.889 * 231, rel=0.05)
    assert as_quoted[0] == pytest.approx(2340, rel=0.05)
    single = next(r for r in ROWS if r.prompt_tokens)
    assert [q.input_len for q in row_requests(single, row_spec(single, curves))] == [8192]
