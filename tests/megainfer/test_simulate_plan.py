"""`megainfer simulate --plan`: a disaggregated plan's decode steps with drawn expert loads,
placed and re-placed by the deployment's code, against the planner's prediction."""

from __future__ import annotations

import subprocess
import sys

from megainfer.presets import PRESETS
from megainfer.tools.simulator.disaggregated import PlanSimulator
from planner.catalog import Catalog
from planner.expert_popularity import SkewPricing
from planner.perf_model import PerfModel
from planner.search import search

QWEN = PRESETS["qwen3-235b-a22b"]
CATALOG = Catalog.load()


def _plan(skew: SkewPricing, redundant: int):
    perf = PerfModel(QWEN, 730, skew=skew, redundant_experts=redundant)
    best = search(QWEN, CATALOG, ["H20", "L40S"], ["H20", "L40S"], tbt_slo_s=0.150, perf=perf).candidates[0]
    return best.to_plan("qwen3-235b-a22b", "bfloat16", 150, 730), perf


def test_the_simulated_tbt_of_the_planners_skewed_plan_is_within_15_percent_of_its_prediction():
    skew = SkewPricing(QWEN.num_experts, QWEN.top_k, 3.61, 46.6)
    plan, perf = _plan(skew, redundant=4)
    assert plan.experts.redundant_per_node >= 1
    sim = PlanSimulator(plan, QWEN, perf, CATALOG).run(90)
    assert sim.replaced_at == plan.experts.rebalance.window_steps  # re-placed once its window filled
    assert sim.imbalance_before > 2.0 and sim.imbalance_after < 1.15
    assert abs(sim.tbt_over_prediction - 1) <= 0.15, sim.tbt_over_prediction
    # Before the re-placement the hottest node held every step back.
    assert sim.tbt_s[:sim.replaced_at].mean() > 1.2 * sim.settled_tbt_s


def test_simulate_plan_cli_prints_the_comparison(tmp_path):
    skew = SkewPricing(QWEN.num_experts, QWEN.top_k, 3.61, 46.6)
    plan, _ = _plan(skew, redundant=2)
    path = plan.save(tmp_path / "plan.yaml")
    out = subprocess.run([sys.executable, "-m", "megainfer", "simulate", "--plan", str(path), "--expert-skew", "3.61",
                          "--steps", "70", "--json", str(tmp_path / "sim.json")], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert "simulated / planner" in out.stdout and (tmp_path / "sim.json").is_file()
