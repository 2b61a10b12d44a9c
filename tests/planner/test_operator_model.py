"""The operator model behind plan, simulate and the router's prior: profile tables, efficiency
curves, the sources it reports, and the step model's sum of operators."""

from __future__ import annotations

import numpy as np
import pytest

from megainfer.cli import main
from megainfer.errors import PlanError
from megainfer.presets import PRESETS
from planner.step_prior import step_prior
from planner.catalog import Catalog
from planner.efficiency_curves import EfficiencyCurves
from planner.operator_profile import OPERATOR_AXES, OperatorProfile, OperatorTable, ProfiledDevice, model_shape
from planner.step_cost_model import AttentionWork, ColocatedStepModel, LayerClass

TINY = PRESETS["tiny-mixtral"]
H100 = Catalog.load()["H100"]


def linear_profile(model=TINY, tp=1, catalog_name=None) -> OperatorProfile:
    """A profile whose every table is 1 µs per unit of its first axis plus 1 ns per unit of its
    second, over a grid reaching 4096: easy to price by hand."""
    grid = (1.0, 4.0, 16.0, 64.0, 256.0, 1024.0, 4096.0)
    tables = {}
    for op, axes in OPERATOR_AXES.items():
        if op == "allreduce":
            continue
        values = [grid] * len(axes)
        mesh = np.meshgrid(*values, indexing="ij")
        seconds = 1e-6 * mesh[0] + (1e-9 * mesh[1] if len(axes) > 1 else 0.0)
        tables[op] = OperatorTable(tuple(values), np.asarray(seconds, dtype=np.float64))
    device = ProfiledDevice(kind="cpu", name="test cpu", count=tp, catalog_name=catalog_name, peak_flops=1e11,
                            peak_bytes_per_s=1e10, threads=2)
    return OperatorProfile(device=device, model=model_shape(model), dtype="float32", tp=tp, operators=tables,
                           kv_cache_tokens=100_000)


def test_tables_interpolate_in_log_space_and_know_their_grid():
    table = OperatorTable(((1.0, 3.0, 15.0),), np.array([1.0, 2.0, 4.0]))
    assert table(3.0) == 2.0 and table(15.0) == 4.0
    # log1p(7) is halfway between log1p(3) and log1p(15).
    assert table(7.0) == pytest.approx(3.0)
    assert table.covers(1.0) and table.covers(15.0) and not table.covers(16.0) and not table.covers(0.5)
    with pytest.raises(ValueError):
        OperatorTable(((1.0, 1.0),), np.array([1.0, 2.0]))


def test_profiles_round_trip_and_refuse_other_shapes(tmp_path):
    profile = linear_profile()
    path = tmp_path / "p.json"
    profile.save(path)
    loaded = OperatorProfile.load(path)
    assert loaded.table("moe")(64.0, 16.0) == pytest.approx(profile.table("moe")(64.0, 16.0))
    assert loaded.kv_cache_tokens == 100_000 and loaded.device.name == "test cpu"
    loaded.check_applies(TINY, 1)
    with pytest.raises(PlanError, match="hidden_size"):
        loaded.check_applies(PRESETS["qwen3-30b-a3b"], 1)
    with pytest.raises(PlanError, match="--tp 1"):
        loaded.check_applies(TINY, 2)
    with pytest.raises(PlanError, match="no such file"):
        OperatorProfile.load(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text('{"format": 1, "device": {}}')
    with pytest.raises(PlanError, match="malformed"):
        OperatorProfile.load(tmp_path / "bad.json")


def test_step_model_sums_profiled_operators_by_hand():
    sm = ColocatedStepModel(TINY, None, 1, profile=linear_profile())
    layers = TINY.num_layers
    work = AttentionWork(4, 4 * 64.0)  # 4 decodes at context 64
    cost = sm.step([LayerClass(layers, 4, work, 2)], sampled=4, seqs=4)
    per_expert = 4 * TINY.top_k / 2  # tokens_per_expert with 2 experts active: a grid point
    per_layer = (1e-6 * 4) + (1e-6 * 4 + 1e-9 * 64) + (1e-6 * per_expert + 1e-9 * 2)
    per_step = 1e-6 * 4 * 3  # lm_head, sampling, step_overhead at 4
    assert cost.seconds == pytest.approx(layers * per_layer + per_step, rel=1e-4)  # 2 experts: between grid points
    assert cost.energy_j == 0  # a device outside the catalog: no power figure
    assert sm.kv_capacity_tokens() == 100_000
    assert dict(sm.explain()) == {op: "profile" for op in ("attention_decode", "dense", "lm_head", "moe", "sampling",
                                                            "step_overhead")}
    # A prompt chunk past the grid is priced from the curves, and the summary says so.
    sm.step([LayerClass(layers, 8000, AttentionWork(0, 0.0, ((8000, 0),)), 8)], sampled=1, seqs=1)
    assert "outside its grid" in dict(sm.explain())["dense"]
    assert dict(sm.explain())["attention_prefill"] == "curves"


def test_curves_file_merges_a_gpu_entry_over_the_default(tmp_path):
    path = tmp_path / "curves.yaml"
    path.write_text("""
default:
  source: generic
  gemm: {flops: [0.5, 16], bandwidth: [0.8, 1000]}
  moe: {flops: [0.5, 16], bandwidth: [0.8, 1000]}
  attention: {flops: [0.5, 16], bandwidth: [0.8, 1000]}
  launch_s: 1.0e-6
  step_overhead_s: 0.001
  step_overhead_per_seq_s: 0
  allreduce_latency_s: 0
  link: 0.8
H100:
  source: fitted
  moe: {bandwidth: [0.6, 2000]}
""")
    h100, other = EfficiencyCurves.load("H100", path), EfficiencyCurves.load("L4", path)
    assert h100.moe.bandwidth.peak == 0.6 and h100.moe.flops.peak == 0.5 and h100.source == "fitted"
    assert other.moe.bandwidth.peak == 0.8 and "no fitted entry" in other.source
    path.write_text("default: {gemm: 3}\n")
    with pytest.raises(PlanError, match="missing field"):
        EfficiencyCurves.load("H100", path)


def test_router_prior_predicts_the_step_model():
    sm = ColocatedStepModel(PRESETS["qwen3-30b-a3b"], H100, 1)
    prior = step_prior(sm)
    assert len(prior) == 5 and all(c >= 0 for c in prior)
    fixed, per_token, per_seq, per_kv, per_pair = prior
    for batch, context in ((16, 1024), (128, 1024)):
        work = AttentionWork(batch, batch * float(context))
        truth = sm.step([LayerClass(48, batch, work, 128)], sampled=batch, seqs=batch).seconds
        guess = fixed + per_token * batch + per_seq * batch + (per_kv + per_pair) * work.kv_tokens
        assert guess == pytest.approx(truth, rel=0.35)


def test_plan_explain_names_each_operators_source(tmp_path, capsys):
    assert main(["plan", "--model", "tiny-mixtral", "--gpus", "H100", "--explain", "--top", "1"]) == 0
    out = capsys.readouterr().out
    assert "where the predicted times come from" in out and "moe" in out and "curves" in out
    profile = linear_profile(catalog_name="H100")
    path = tmp_path / "h100.json"
    profile.save(path)
    assert main(["plan", "--model", "tiny-mixtral", "--gpus", "H100", "--explain", "--top", "1",
                 "--profile", str(path)]) == 0
    out = capsys.readouterr().out
    if "(H100 tp1)" in out:  # the best plan uses the profiled TP size on some side
        assert "profile" in out.split("where the predicted times come from")[1]
    assert main(["plan", "--model", "qwen3-30b-a3b", "--profile", str(path)]) == 2
    assert "hidden_size" in capsys.readouterr().err
