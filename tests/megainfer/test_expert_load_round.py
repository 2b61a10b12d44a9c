"""The load round: the expert nodes' own count of the pairs they computed, per step, to every
attention rank (megainfer/disagg/expert_load_round.py), and the windows that keep it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megainfer.disagg.expert_load_round import LOAD_LAYER, PREFILL, LoadRound, ServedPairs, post_load
from megainfer.disagg.staging_sizes import load_round_bytes
from megainfer.engine.expert_load_window import ExpertLoadWindow
from megainfer.errors import DataPlaneError
from megainfer.messages import ExpertLoadReport
from megainfer.model.expert_layer import ExpertLayer
from megainfer.presets import PRESETS
from tests.helpers import connect_all
from transport import Endpoint, EndpointSpec

SECRET = b"L" * 32


def test_a_steps_counts_are_the_counters_growth_named_by_the_layer_and_expert_each_row_holds():
    served = ServedPairs(num_layers=2, room=3, num_experts=6, device=torch.device("cpu"))
    held = [[4, 0, 2], [5, 1]]  # layer 1 holds two experts in its room of three
    served.row_view(0, 3).add_(torch.tensor([3, 1, 0]))
    served.row_view(1, 3).add_(torch.tensor([2, 7, 0]))
    first = served.step_counts(held, version=0).copy()
    # (layer x 6 + expert, pairs) per (layer, row); the empty row is (0, 0)
    assert first.tolist() == [[4, 3], [0, 1], [2, 0], [11, 2], [7, 7], [0, 0]]
    served.row_view(0, 3).add_(torch.tensor([0, 5, 4]))
    # placement 1: layer 0's rows now hold experts 3, 0, 1 (a re-placement switched at the step's start)
    second = served.step_counts([[3, 0, 1], [5, 1]], version=1)
    assert second.tolist() == [[3, 0], [0, 5], [1, 4], [11, 0], [7, 0], [0, 0]]
    assert served.per_layer() == [13, 9]  # health: since the counters restarted
    served.restart()
    assert served.per_layer() == [0, 0] and not served.step_counts([[3, 0, 1], [5, 1]], version=1)[:, 1].any()


def test_an_expert_layer_counts_its_rows_pairs_into_the_nodes_counters():
    """The layer adds each row's pairs (padding rows and pairs held elsewhere not) to its view."""
    tiny_config = PRESETS["tiny-mixtral"]
    served = ServedPairs(tiny_config.num_layers, 2, tiny_config.num_experts, torch.device("cpu"))
    layer = ExpertLayer(tiny_config, 0, torch.float32, "cpu", [1, 3], row_pairs=served.row_view(0, 2))
    ids = torch.tensor([[1, 0], [3, 1], [2, 0], [1, 3]])
    layer(torch.zeros(4, tiny_config.hidden_size), ids, torch.full((4, 2), 0.5))
    assert served.counters[0].tolist() == [3, 2] and not served.counters[1:].any()
    layer(torch.zeros(4, tiny_config.hidden_size), ids, torch.full((4, 2), 0.5), valid=torch.tensor([1]))
    assert served.counters[0].tolist() == [4, 2]  # the padded batch's one live row: expert 1 once
    with pytest.raises(ValueError, match="row_pairs must be int64"):
        ExpertLayer(tiny_config, 0, torch.float32, "cpu", [1, 3], row_pairs=torch.zeros(3, dtype=torch.int64))


@pytest.fixture
def one_attention_two_experts():
    """An attention endpoint wired to two expert endpoints over shm (slots as small as a round)."""
    size = load_round_bytes(3, 4)
    endpoints = {name: Endpoint(EndpointSpec(name=name, rank=rank, secret=SECRET, listen="127.0.0.1:0",
                                             slot_bytes=size, num_slots=1, backend="shm", timeout_s=10))
                 for rank, name in enumerate(("attn", "e0", "e1"))}
    connect_all(endpoints, {"attn": ["e0", "e1"], "e0": ["attn"], "e1": ["attn"]})
    yield endpoints
    for endpoint in endpoints.values():
        endpoint.close()


class EndpointLink:
    """The ExpertLink calls the load round makes, straight onto a transport endpoint."""

    def __init__(self, endpoint) -> None:
        self.endpoint = endpoint

    def post_round(self, peers, buffer, begins, ends, token_counts, **header):
        self.endpoint.post_round(peers, buffer, begins, ends, token_counts, **header)

    def collect_round(self, peers, *, micro_batch):
        return self.endpoint.collect_round(peers, micro_batch=micro_batch, timeout=10)


def entries(*cells: tuple[int, int, int]) -> np.ndarray:
    """A node's round for a model of 3 layers x 5 experts: (layer, expert, pairs) each."""
    return np.array([(layer * 5 + expert, pairs) for layer, expert, pairs in cells], dtype=np.int32).reshape(-1, 2)


def test_every_expert_nodes_round_is_added_up_and_any_prefill_flag_marks_the_step(one_attention_two_experts):
    endpoints = one_attention_two_experts
    # rooms of one row (e0) and two (e1), layer by layer; e1 holds a replica of expert (0, 1) and
    # an empty row in layers 0 and 2, entry (0, 0)
    rounds = (("e0", entries((0, 1, 6), (1, 2, 1), (2, 4, 3)), False),
              ("e1", entries((0, 1, 2), (0, 0, 0), (1, 0, 5), (1, 3, 0), (2, 3, 1), (0, 0, 0)), True))
    for name, report, prefill in rounds:
        post_load(EndpointLink(endpoints[name]), ("attn",), report, step=7, prefill=prefill)
    round_ = LoadRound(("e0", "e1"), 3, 5)
    load = round_.collect(EndpointLink(endpoints["attn"]), step=7)
    assert load.counts.tolist() == [[0, 8, 0, 0, 0], [5, 0, 1, 0, 0], [0, 0, 0, 1, 3]]
    assert load.counts.dtype == np.int64
    assert load.node_pairs.tolist() == [[6, 2], [1, 5], [3, 1]]  # [layers, nodes]
    assert load.prefill
    for name in ("e0", "e1"):
        post_load(EndpointLink(endpoints[name]), ("attn",), entries((0, 1, 0), (1, 1, 1), (2, 1, 0)), step=8,
                  prefill=False)
    load = round_.collect(EndpointLink(endpoints["attn"]), step=8)
    assert not load.prefill and load.counts[1, 1] == 2 and load.counts.sum() == 2
    assert load.node_pairs.tolist() == [[0, 0], [1, 1], [0, 0]]
    for name in ("e0", "e1"):
        post_load(EndpointLink(endpoints[name]), ("attn",), entries((0, 1, 0), (1, 1, 1)), step=9, prefill=False)
    with pytest.raises(DataPlaneError, match=r"hold \[2, 2\] entries: not whole rooms of 3 layers"):
        round_.collect(EndpointLink(endpoints["attn"]), step=9)


def test_a_load_round_of_another_step_or_model_fails_the_step_naming_what_is_wrong(one_attention_two_experts):
    endpoints = one_attention_two_experts
    for name in ("e0", "e1"):
        post_load(EndpointLink(endpoints[name]), ("attn",), entries((0, 0, 1)), step=5, prefill=False)
    with pytest.raises(DataPlaneError, match=rf"expert node e0 sent \(step 5, layer {LOAD_LAYER}, 8 bytes for 1 "
                                             r"entries\) where step 4's load round"):
        LoadRound(("e0", "e1"), 3, 5).collect(EndpointLink(endpoints["attn"]), step=4)
    for name, cell in (("e0", (0, 0, 1)), ("e1", (3, 0, 1))):  # layer 3 of a 3-layer model
        post_load(EndpointLink(endpoints[name]), ("attn",), entries(cell), step=6, prefill=False)
    with pytest.raises(DataPlaneError, match="names \\(layer, expert\\) cell 15 of 15: it serves another model"):
        LoadRound(("e0", "e1"), 3, 5).collect(EndpointLink(endpoints["attn"]), step=6)
    assert PREFILL & 1 == 0  # not the answers' BUSY flag


def test_the_window_keeps_each_expert_nodes_pairs_beside_the_expert_counts():
    window = ExpertLoadWindow(2, 3, window_steps=2)
    step = np.array([[1, 0, 2], [0, 4, 0]])
    window.observe(step, prefill=False, node_pairs=np.array([[1, 2], [4, 0]]))
    window.observe(step * 2, prefill=True, node_pairs=np.array([[2, 4], [8, 0]]))
    window.observe(step * 3, prefill=False, node_pairs=np.array([[3, 6], [12, 0]]))  # the first step leaves
    report = window.report()
    assert report.node_pairs.tolist() == [[5, 10], [20, 0]]
    assert report.decode.tolist() == (step * 3).tolist() and report.prefill.tolist() == (step * 2).tolist()
    window.observe(step, prefill=False, node_pairs=np.array([[1, 1, 1], [1, 1, 1]]))  # re-wired: three nodes
    assert window.report().node_pairs.tolist() == [[1, 1, 1], [1, 1, 1]]
    assert ExpertLoadWindow(2, 3, 2).report().node_pairs is None  # a colocated engine's: gating counts only


def test_the_deployments_window_is_one_leaders_where_the_expert_nodes_counted_else_every_leaders_sum():
    ones = np.ones((2, 3), dtype=np.int64)
    counted = [ExpertLoadReport(ones * k, ones, 4, 1, np.full((2, 2), k)) for k in (1, 2)]
    assert ExpertLoadReport.deployment(counted) is counted[0]
    gating = [ExpertLoadReport(ones * k, ones, 4, 1) for k in (1, 2)]
    total = ExpertLoadReport.deployment(gating)
    assert total.decode.tolist() == (ones * 3).tolist() and total.decode_steps == 8 and total.node_pairs is None
