"""What a deployment reports about itself (deploy/status.py): the expert nodes' load."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("ray")

from deploy.status import expert_load  # noqa: E402
from megainfer.expert_replicas import ExpertReplicas  # noqa: E402
from megainfer.messages import ExpertLoadReport  # noqa: E402


def _group() -> SimpleNamespace:
    return SimpleNamespace(attention=["attention0", "attention1"],
                           expert_replicas=ExpertReplicas.of_assignment([[0, 1], [2, 3]], 2))


def test_the_metrics_show_each_expert_nodes_own_count_where_the_windows_hold_it():
    """Each leader's window holds the whole deployment's (the load round): one is read, not summed."""
    loads = np.array([[9, 1, 1, 1], [0, 0, 0, 0]])
    nodes = np.array([[10, 2], [0, 0]])
    window = ExpertLoadReport(loads, np.zeros_like(loads), 5, 0, nodes)
    engines = [SimpleNamespace(expert_window=window)] * 2
    units, per_layer = expert_load([_group()], engines)
    assert units == [10, 2] and per_layer == [10 / 6, 1.0]


def test_without_the_expert_nodes_counts_the_gating_counts_are_placed_and_summed_over_leaders():
    loads = np.array([[9, 1, 1, 1], [1, 1, 1, 1]])
    engines = [SimpleNamespace(expert_window=ExpertLoadReport(loads, np.zeros_like(loads), 5, 0))] * 2
    units, per_layer = expert_load([_group()], engines)
    assert units == [24.0, 8.0] and per_layer == [10 / 6, 1.0]
