"""A measured expert-load profile (megainfer/expert_load_profile.py, what `GET /admin/experts/load`
serves) priced by the planner and the plan simulator (planner/expert_popularity.MeasuredPricing)
instead of the fitted popularity law."""

from __future__ import annotations

import json

import numpy as np
import pytest

from megainfer.errors import ConfigError
from megainfer.expert_load_profile import ExpertLoadProfile
from megainfer.messages import ExpertLoadReport
from megainfer.presets import PRESETS
from megainfer.tools.simulator.disaggregated import PlanSimulator
from planner.catalog import Catalog
from planner.expert_popularity import MeasuredPricing, SkewPricing
from planner.perf_model import PerfModel
from planner.search import search
from tests.helpers import megainfer

QWEN = PRESETS["qwen3-235b-a22b"]
CATALOG = Catalog.load()


def law_profile(model, skew: float = 3.61) -> np.ndarray:
    """[layers, experts] counts drawn exactly from the fitted law's shares (the planner's ids)."""
    shares = SkewPricing(model.num_experts, model.top_k, skew, 46.6).shares
    return np.rint(np.tile(shares, (model.num_layers, 1)) * 1e7).astype(np.int64)


def test_a_profile_goes_to_json_and_back_and_says_which_field_is_wrong(tmp_path):
    report = ExpertLoadReport(np.arange(12).reshape(3, 4), np.ones((3, 4), dtype=np.int64), 5, 2)
    profile = ExpertLoadProfile.of("tiny", report)
    path = tmp_path / "load.json"
    path.write_text(json.dumps(profile.to_dict()))
    again = ExpertLoadProfile.load(path)
    assert (again.model, again.num_layers, again.num_experts, again.decode_steps) == ("tiny", 3, 4, 5)
    assert (again.counts("all") == report.decode + report.prefill).all()
    good = profile.to_dict()
    for change, words in [({"decode": [[1, 2], [3]]}, "decode must be a [layers][experts] table"),
                          ({"prefill": [[1, 2]]}, "decode is [3, 4] but prefill is [1, 2]"),
                          ({"decode": [[-1] * 4] * 3}, "negative counts"),
                          ({"decode_steps": True}, "decode_steps must be a whole number"),
                          ({"model": ""}, "model must name the model")]:
        with pytest.raises(ConfigError, match=words.replace("[", r"\[").replace("]", r"\]")):
            ExpertLoadProfile.from_dict({**good, **change})
    with pytest.raises(ConfigError, match="missing prefill"):
        ExpertLoadProfile.from_dict({k: v for k, v in good.items() if k != "prefill"})
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ConfigError, match="not JSON"):
        ExpertLoadProfile.load(tmp_path / "bad.json")
    with pytest.raises(ConfigError, match="3 layers x 4 experts.*has 94 x 128"):
        profile.check_model(QWEN.num_layers, QWEN.num_experts, QWEN.name, "decode")
    with pytest.raises(ConfigError, match="no prefill pairs"):
        ExpertLoadProfile.of("tiny", ExpertLoadReport(report.decode, np.zeros((3, 4), np.int64), 5, 0)).check_model(
            3, 4, "tiny", "prefill")


def test_a_profile_of_the_fitted_law_prices_as_the_law_does():
    model = PRESETS["qwen3-30b-a3b"]
    measured = MeasuredPricing(law_profile(model), model.num_moe_layers, "law")
    law = SkewPricing(model.num_experts, model.top_k, 3.61, 46.6)
    for experts_per_node, spare in [(8, 0), (16, 0), (8, 1)]:
        assert measured.imbalance(experts_per_node, spare) == pytest.approx(law.imbalance(experts_per_node, spare),
                                                                            rel=1e-4)
        assert measured.hot_factor(experts_per_node, spare) == pytest.approx(
            law.hot_factor(experts_per_node, spare), rel=1e-4)


def test_each_layer_waits_for_its_own_hottest_node():
    # 4 experts on 2 nodes (0, 1 | 2, 3): layer 0 sends everything to node 0, layer 1 is even,
    # layer 2 saw no pairs (even), and a dense first layer is not a MoE layer at all.
    counts = np.array([[9, 9, 9, 9], [30, 10, 0, 0], [5, 5, 5, 5], [0, 0, 0, 0]])
    pricing = MeasuredPricing(counts, num_moe_layers=3, source="hand-made")
    assert pricing.layer_shares.shape == (3, 4)
    assert pricing.imbalance(2, 0) == pytest.approx((2.0 + 1.0 + 1.0) / 3)
    assert pricing.imbalance(4, 0) == 1.0  # one node holds every expert
    # One spare slot per node: layer 0's hot expert split over both nodes evens it out.
    assert pricing.imbalance(2, 1) == pytest.approx(1.0, abs=0.01)


def test_the_plan_simulator_draws_each_layer_from_the_profile_and_meets_the_prediction():
    skew = SkewPricing(QWEN.num_experts, QWEN.top_k, 3.61, 46.6)
    best = search(QWEN, CATALOG, ["H20", "L40S"], ["H20", "L40S"], tbt_slo_s=0.150,
                  perf=PerfModel(QWEN, 730, skew=skew, redundant_experts=2)).candidates[0]
    plan = best.to_plan("qwen3-235b-a22b", "bfloat16", 150, 730)
    assert plan.experts.redundant_per_node >= 1
    perf = PerfModel(QWEN, 730, skew=MeasuredPricing(law_profile(QWEN), QWEN.num_moe_layers, "law"),
                     redundant_experts=plan.experts.redundant_per_node)
    sim = PlanSimulator(plan, QWEN, perf, CATALOG).run(70)
    assert sim.replaced_at == plan.experts.rebalance.window_steps
    assert sim.imbalance_before > 2.0 and sim.imbalance_after < 1.15
    assert abs(sim.tbt_over_prediction - 1) <= 0.15, sim.tbt_over_prediction


def test_the_cli_refuses_a_profile_of_another_model_and_two_kinds_of_skew(tmp_path):
    path = tmp_path / "load.json"
    small = PRESETS["qwen3-30b-a3b"]
    counts = law_profile(small)
    path.write_text(json.dumps(ExpertLoadProfile("qwen3-30b-a3b", counts, np.zeros_like(counts), 10, 0).to_dict()))
    out = megainfer("plan", "--model", "qwen3-235b-a22b", "--gpus", "H20,L40S", "--expert-load", str(path))
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert "measured on qwen3-30b-a3b (48 layers x 128 experts), but qwen3-235b-a22b has 94 x 128" in out.stderr
    out = megainfer("plan", "--model", "qwen3-30b-a3b", "--expert-load", str(path), "--expert-skew", "3")
    assert out.returncode != 0 and "give one of them" in out.stderr
    out = megainfer("simulate", "--plan", "deploy/plans/qwen3-235b-h20-l40s.yaml", "--expert-load", str(path))
    assert out.returncode != 0 and "has 94 x 128" in out.stderr and "Traceback" not in out.stderr
