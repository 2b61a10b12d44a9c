"""Expert slots and replicas (megainfer/expert_replicas.py), the routed-token window
(engine/expert_load_window.py), the plan's experts section, and the switch's refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels import REPLICA_BUCKETS
from megainfer.disagg.expert_slot_maps import SlotMaps
from megainfer.disagg.expert_switch import ExpertSwitch
from megainfer.engine.expert_load_window import ExpertLoadWindow
from megainfer.errors import ConfigError, DataPlaneError, PlanError
from megainfer.expert_replicas import ExpertReplicas, LayerReplicas, from_assignment
from megainfer.plan import Plan


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 20), min_size=2, max_size=4), st.integers(1, REPLICA_BUCKETS))
def test_every_run_of_rows_splits_an_experts_pairs_close_to_its_shares(weights, run):
    """Smooth weighted round-robin: in any `run` consecutive rows, each replica takes its share
    to within one row (so a decode micro-batch of a few rows is split too)."""
    shares = np.array(weights, dtype=np.float64) / sum(weights)
    nodes = len(shares)
    layer = LayerReplicas(tuple((0,) for _ in range(nodes)), tuple((float(s),) for s in shares), 1)
    row = layer.slot_table(1, REPLICA_BUCKETS)[0]
    counts = np.array([(row == j).sum() for j in range(nodes)])
    assert np.all(np.abs(counts - shares * REPLICA_BUCKETS) < 1 + 1e-9)  # the whole table
    for start in range(REPLICA_BUCKETS - run + 1):
        window = row[start:start + run]
        got = np.array([(window == j).sum() for j in range(nodes)])
        assert np.all(np.abs(got - shares * run) <= 2), (start, run, got, shares)


def test_slots_are_numbered_by_each_nodes_room_and_mapped_to_their_nodes():
    layer = LayerReplicas(((0, 1, 2), (3, 0)), ((0.6, 1.0, 1.0), (1.0, 0.4)), 3)
    assert layer.num_slots == 6 and layer.slot_node() == [0, 0, 0, 1, 1, 1]
    assert layer.node_slots(1) == [3, 4]
    assert layer.expert_replicas(4)[0] == [(0, 0.6), (4, 0.4)]
    assert not layer.is_identity(4) and from_assignment([[0, 1, 2, 3], [4, 5, 6, 7]]).is_identity(8)
    np.testing.assert_allclose(layer.node_load(np.array([100, 10, 10, 10])), [60 + 20, 10 + 40])
    table = layer.slot_table(4, REPLICA_BUCKETS)
    assert set(table[0]) == {0, 4} and set(table[3]) == {3}
    assert ExpertReplicas.uniform(from_assignment([[0, 1], [2, 3]], 3), 2).needs_table(4)  # spare room


@pytest.mark.parametrize("layer, message", [
    (LayerReplicas(((0, 1), (2,)), ((1.0, 1.0), (1.0,)), 2), "expert 3 is on no node"),
    (LayerReplicas(((0, 1), (2, 3, 0)), ((0.5, 1.0), (1.0, 1.0, 0.4)), 3), "sum to 1"),
    (LayerReplicas(((0, 0), (1, 2, 3)), ((0.5, 0.5), (1.0, 1.0, 1.0)), 3), "holds an expert twice"),
    (LayerReplicas(((0, 1, 2), (3,)), ((1.0, 1.0, 1.0), (1.0,)), 2), "more than its 2 slots"),
])
def test_a_placement_that_cannot_serve_is_refused_naming_what_is_wrong(layer, message):
    with pytest.raises(ConfigError, match=message):
        layer.check(4)


def test_the_window_keeps_the_last_steps_decode_and_prefill_apart():
    window = ExpertLoadWindow(2, 3, window_steps=3)
    shared = np.ones((2, 3), dtype=np.int64)
    window.observe(shared, prefill=True)
    shared[:] = 2  # a CPU runner reuses its counts buffer: the window keeps a copy
    window.observe(shared, prefill=False)
    window.observe(np.array([]), prefill=False)  # a step that routed nothing
    window.observe(np.full((2, 3), 5), prefill=False)  # the first (prefill) step leaves the window
    report = window.report()
    assert (report.decode_steps, report.prefill_steps) == (3, 0)
    assert report.decode.tolist() == [[7, 7, 7]] * 2 and report.prefill.sum() == 0
    assert report.of("all").sum() == 42


def test_the_plan_takes_spare_slots_and_a_rebalance_section_and_refuses_bad_ones():
    plan = Plan.from_dict({"model": "tiny-mixtral", "experts": {
        "nodes": 2, "redundant_per_node": 1, "rebalance": {"window_steps": 16, "interval_s": 30, "phase": "all"}}})
    assert plan.places_experts and plan.experts.rebalance.window_steps == 16
    assert Plan.from_dict(plan.to_dict()).experts == plan.experts  # round trip
    from megainfer.model_resolution import resolve_model

    replicas = plan.expert_replicas(resolve_model("tiny-mixtral")[0])
    assert replicas.slots_per_node == 5 and replicas.layers[0].node_experts == ((0, 1, 2, 3), (4, 5, 6, 7))
    with pytest.raises(PlanError, match="phase 'sometimes'"):
        Plan.from_dict({"model": "tiny-mixtral", "experts": {"rebalance": {"phase": "sometimes"}}})
    with pytest.raises(PlanError, match="experts.rebalance.windows"):
        Plan.from_dict({"model": "tiny-mixtral", "experts": {"rebalance": {"windows": 3}}})
    with pytest.raises(PlanError, match="redundant_per_node"):
        Plan.from_dict({"model": "tiny-mixtral", "experts": {"redundant_per_node": -1}})


def test_a_switch_arriving_after_its_step_began_is_refused_not_applied_late():
    from megainfer.model_resolution import resolve_model

    cfg = resolve_model("tiny-mixtral")[0]
    start = ExpertReplicas.uniform(from_assignment([[0, 1, 2, 3], [4, 5, 6, 7]], 5), cfg.num_layers)
    maps = SlotMaps(start, cfg.num_experts, torch.device("cpu"), movable=True)
    maps.apply_due(10, [])
    new = ExpertReplicas(1, start.layers)
    with pytest.raises(DataPlaneError, match="after that step began"):
        maps.switch_at(10, new)
    maps.switch_at(12, new)
    maps.apply_due(11, [])
    assert maps.current.version == 0
    maps.apply_due(12, [])
    assert maps.current.version == 1
    with pytest.raises(DataPlaneError, match="cannot move"):
        SlotMaps(ExpertReplicas.uniform(from_assignment([[0, 1, 2, 3], [4, 5, 6, 7]]), cfg.num_layers), 8, torch.device("cpu"),
                 movable=False).switch_at(5, new)
    switch = ExpertSwitch(0)
    with pytest.raises(DataPlaneError, match="not staged"):
        switch.switch_at(5, 1)
