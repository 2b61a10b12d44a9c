"""The redundancy plan (planner/expert_placement.py): the greedy against brute force on small
instances, and what it does to a skewed layer."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from megainfer.errors import ConfigError
from planner.expert_placement import (GREEDY_BOUND, contiguous_placement, expert_costs, optimal_shares, place,
                                      place_layer, slots_per_node)


def brute_force(loads, num_nodes: int, redundant: int, floor_cost: float) -> float:
    """The optimum: every way of filling every node's slots with distinct experts that holds each
    expert somewhere, each with its best shares."""
    costs = expert_costs(loads, floor_cost)
    slots = min(slots_per_node(len(costs), num_nodes, redundant), len(costs))
    best = float("inf")
    for held in itertools.product(itertools.combinations(range(len(costs)), slots), repeat=num_nodes):
        replicas = [[j for j in range(num_nodes) if i in held[j]] for i in range(len(costs))]
        if any(not nodes for nodes in replicas):
            continue
        best = min(best, max(optimal_shares(costs, replicas, num_nodes)[1]))
    return best


def instances():
    rng = np.random.default_rng(7)
    for num_experts, num_nodes, redundant in [(3, 2, 0), (4, 2, 0), (4, 2, 1), (5, 2, 1), (4, 3, 0), (5, 3, 0),
                                               (6, 3, 0), (6, 2, 1)]:
        for trial in range(4):
            skew = rng.uniform(0.5, 3.0)
            loads = rng.permutation((np.arange(num_experts) + 1.0) ** -skew * rng.uniform(50, 500))
            floor = [0.0, float(np.median(loads))][trial % 2]
            yield loads, num_nodes, redundant, floor


@pytest.mark.parametrize("loads,num_nodes,redundant,floor", list(instances()))
def test_the_greedy_is_within_its_bound_of_the_optimum(loads, num_nodes, redundant, floor):
    greedy = max(place_layer(loads, num_nodes, redundant, floor).node_cost)
    optimum = brute_force(loads, num_nodes, redundant, floor)
    assert optimum <= greedy * (1 + 1e-9)  # brute force is the optimum
    assert greedy <= GREEDY_BOUND * optimum + 1e-9, (greedy, optimum)


def test_every_expert_is_served_whole_and_no_node_holds_more_than_its_slots():
    loads = np.array([900, 400, 120, 80, 60, 40, 30, 20, 10, 5, 3, 2], dtype=float)
    plan = place_layer(loads, num_nodes=4, redundant_per_node=1, floor_cost=5.0)
    assert all(abs(sum(s) - 1.0) < 1e-9 and all(x >= -1e-12 for x in s) for s in plan.shares)
    assert all(len(set(nodes)) == len(nodes) >= 1 for nodes in plan.replicas)
    assert all(len(plan.experts_on(j)) <= slots_per_node(12, 4, 1) for j in range(4))
    assert sum(plan.node_cost) == pytest.approx(sum(np.maximum(loads, 5.0)))  # shares move cost, never add it
    assert len(plan.replicas[0]) >= 2  # the hottest expert is replicated


def test_redundancy_flattens_a_skewed_layer():
    """Popularity (rank + 1)^-1.5 over 16 experts on 4 nodes: contiguous placement puts the four
    hottest on one node (imbalance ~2.9); one redundant slot per node brings it to ~1."""
    loads = 1000 * (np.arange(16) + 1.0) ** -1.5
    before = contiguous_placement(loads, 4)
    after = place_layer(loads, 4, redundant_per_node=1)
    assert before.imbalance > 2.5
    assert after.imbalance <= 1.15
    assert max(place_layer(loads, 4, 0).node_cost) >= max(after.node_cost)  # R = 1 never worse than R = 0


def test_uniform_load_needs_no_replicas_to_balance():
    plan = place_layer(np.full(8, 10.0), num_nodes=4)
    assert plan.imbalance == pytest.approx(1.0)
    assert all(len(nodes) == 1 for nodes in plan.replicas)


def test_every_layer_gets_its_own_plan():
    loads = np.array([[100, 1, 1, 1], [1, 1, 1, 100]], dtype=float)
    first, second = place(loads, num_nodes=2, redundant_per_node=1)
    assert len(first.replicas[0]) == 2 and len(second.replicas[3]) == 2


def test_a_plan_needs_an_expert_per_node():
    with pytest.raises(ConfigError, match="at least one expert per node"):
        place_layer([1.0, 2.0], num_nodes=3)
