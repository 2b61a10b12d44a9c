"""Skewed expert popularity priced by the planner (planner/expert_popularity.py): the hottest
expert node sets T_e, and spare slots filled by the redundancy plan win it back."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from megainfer.presets import PRESETS
from planner.catalog import Catalog
from planner.expert_popularity import SkewPricing, inclusion_probability, pair_shares
from planner.perf_model import PerfModel
from planner.search import search

CATALOG = Catalog.load()
QWEN = PRESETS["qwen3-235b-a22b"]


def test_pair_shares_follow_the_popularity_law_and_sum_to_one():
    shares = pair_shares(128, 8, 3.61, 46.6)
    assert shares.sum() == pytest.approx(1.0) and np.all(np.diff(shares) <= 0)  # ranked hottest first
    assert shares[0] / shares[-1] > 10  # a few hot experts
    assert np.allclose(pair_shares(16, 2, 0.0, 0.0), 1 / 16)
    q = inclusion_probability(np.ones(8), 2)
    assert np.allclose(q, 2 / 8, atol=1e-6)  # uniform: every expert is in a token's top-2 a quarter of the time


def test_the_hottest_node_stands_above_the_mean_until_spare_slots_split_its_experts():
    skew = SkewPricing(128, 8, 3.61, 46.6)
    assert SkewPricing(128, 8, 0.0, 46.6).imbalance(4, 0) == 1.0  # uniform routing
    without, with_one = skew.imbalance(4, 0), skew.imbalance(4, 1)
    assert without > 2.0 and with_one < 1.1
    assert skew.imbalance(8, 0) < without  # wider nodes average more experts out
    assert skew.hot_factor(4, 1) == pytest.approx(with_one * 4 / 5)
    assert skew.imbalance(128, 0) == 1.0  # one node: nothing to balance


def test_the_search_charges_skew_and_buys_it_back_with_spare_slots():
    gpus = ["H20", "L40S"]
    uniform = search(QWEN, CATALOG, gpus, gpus, tbt_slo_s=0.150, perf=PerfModel(QWEN, 730)).candidates[0]
    skew = SkewPricing(QWEN.num_experts, QWEN.top_k, 3.61, 46.6)
    skewed = search(QWEN, CATALOG, gpus, gpus, tbt_slo_s=0.150, perf=PerfModel(QWEN, 730, skew=skew)).candidates[0]
    spared = search(QWEN, CATALOG, gpus, gpus, tbt_slo_s=0.150,
                    perf=PerfModel(QWEN, 730, skew=skew, redundant_experts=4)).candidates[0]
    assert skewed.per_gpu < 0.9 * uniform.per_gpu  # the hottest node sets every micro-batch's T_e
    assert skewed.redundant_per_node == 0 and skewed.expert_imbalance > 1.5
    assert spared.per_gpu > 1.1 * skewed.per_gpu and spared.redundant_per_node >= 1
    assert spared.expert_imbalance < 1.1 and spared.t_e < spared.t_e_no_redundancy
    plan = spared.to_plan("qwen3-235b-a22b", "bfloat16", 150, 730)
    assert plan.experts.redundant_per_node == spared.redundant_per_node and plan.experts.rebalance is not None


def test_plan_cli_shows_imbalance_and_t_e_with_and_without_spare_slots():
    out = subprocess.run([sys.executable, "-m", "megainfer", "plan", "--model", "qwen3-235b-a22b", "--gpus",
                          "H20,L40S", "--expert-skew", "3.61", "--redundant-experts", "2", "--top", "3"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "imbalance without" in out.stdout and "best plan with skew and no spare slot" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "megainfer", "plan", "--model", "qwen3-235b-a22b",
                          "--redundant-experts", "2"], capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "give --expert-skew or --expert-load too" in bad.stderr and "Traceback" not in bad.stderr
