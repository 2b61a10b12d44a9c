"""The split the disaggregated runtime relies on: AttentionLayer and ExpertLayer stand alone,
and expert layers holding disjoint expert subsets add up to the full MoE output."""

from __future__ import annotations

import pytest
import torch

from megainfer.model.expert_layer import ExpertLayer
from megainfer.model.weights import RandomWeights
from megainfer.presets import PRESETS

CFG = PRESETS["tiny-mixtral"]


def test_expert_subsets_sum_to_the_full_layer():
    source = RandomWeights(seed=3)
    full = ExpertLayer(CFG, 1, torch.float32, "cpu")
    full.load_weights(source)
    halves = [ExpertLayer(CFG, 1, torch.float32, "cpu", expert_ids=ids) for ids in ([0, 2, 4, 6], [7, 5, 3, 1])]
    for h in halves:
        h.load_weights(source)  # each loads only its experts, with the same values
    g = torch.Generator().manual_seed(0)
    x = torch.randn(10, CFG.hidden_size, generator=g)
    ids = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(10)])
    weights = torch.rand(10, 2, generator=g)
    combined = halves[0](x, ids, weights) + halves[1](x, ids, weights)
    torch.testing.assert_close(combined, full(x, ids, weights), atol=1e-5, rtol=1e-5)


def test_nodes_holding_fewer_experts_than_top_k_sum_to_the_full_layer():
    """A node of n < k experts keeps only T x n of the sorted pairs (the rest are held elsewhere):
    eight one-expert nodes and four two-expert nodes at top-4 still add up to the whole layer,
    also with padding rows past `valid` (a CUDA graph's size)."""
    import dataclasses
    cfg = dataclasses.replace(CFG, top_k=4)
    source = RandomWeights(seed=5)
    full = ExpertLayer(cfg, 1, torch.float32, "cpu")
    full.load_weights(source)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(12, cfg.hidden_size, generator=g)
    ids = torch.stack([torch.randperm(8, generator=g)[:4] for _ in range(12)])
    weights = torch.rand(12, 4, generator=g)
    want = full(x, ids, weights)
    for per_node in (1, 2):
        nodes = [ExpertLayer(cfg, 1, torch.float32, "cpu", expert_ids=list(range(e, e + per_node)))
                 for e in range(0, 8, per_node)]
        for node in nodes:
            node.load_weights(source)
        torch.testing.assert_close(sum(node(x, ids, weights) for node in nodes), want, atol=1e-5, rtol=1e-5)
        valid = torch.tensor([9], dtype=torch.int32)
        padded = sum(node(x, ids, weights, valid) for node in nodes)
        torch.testing.assert_close(padded[:9], want[:9], atol=1e-5, rtol=1e-5)
        assert padded[9:].abs().sum() == 0
        # Every (token, expert) pair is computed on exactly one node, padding rows' on none.
        assert sum(int(node.row_pairs.sum()) for node in nodes) == 12 * 4 + 9 * 4


def test_tensor_parallel_expert_slices_sum_to_the_full_layer():
    """An expert node's tp ranks each hold a slice of every expert's intermediate dimension."""
    source = RandomWeights(seed=4)
    full = ExpertLayer(CFG, 2, torch.float32, "cpu", expert_ids=[1, 3, 5])
    full.load_weights(source)
    g = torch.Generator().manual_seed(1)
    for tokens in (3, 600):  # the per-expert and the batched paths
        x = torch.randn(tokens, CFG.hidden_size, generator=g)
        ids = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(tokens)])
        weights = torch.rand(tokens, 2, generator=g)
        for tp in (2, 4):
            ranks = [ExpertLayer(CFG, 2, torch.float32, "cpu", expert_ids=[1, 3, 5], tp_rank=r, tp_size=tp)
                     for r in range(tp)]
            for rank in ranks:
                rank.load_weights(source)
                assert rank.w_down.shape[2] == CFG.expert_intermediate_size // tp
            combined = sum(rank(x, ids, weights) for rank in ranks)
            torch.testing.assert_close(combined, full(x, ids, weights), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="does not split"):
        ExpertLayer(CFG, 0, torch.float32, "cpu", tp_rank=0, tp_size=3)


def test_expert_layer_matches_a_per_expert_loop():
    layer = ExpertLayer(CFG, 0, torch.float32, "cpu", expert_ids=[1, 3])
    layer.load_weights(RandomWeights(seed=1))
    x = torch.randn(6, CFG.hidden_size)
    ids = torch.tensor([[1, 3], [3, 0], [2, 5], [1, 1 + 6], [3, 1], [0, 2]])
    w = torch.rand(6, 2)
    expected = torch.zeros_like(x)
    for t in range(6):
        for j in range(2):
            e = int(ids[t, j])
            if e in (1, 3):
                local = [1, 3].index(e)
                gate, up = (layer.w_gate_up[local] @ x[t]).chunk(2)
                expected[t] += w[t, j] * (layer.w_down[local] @ (torch.nn.functional.silu(gate) * up))
    torch.testing.assert_close(layer(x, ids, w), expected, atol=1e-5, rtol=1e-5)
    assert layer(x[2:3], ids[2:3], w[2:3]).abs().sum() == 0  # token routed elsewhere


def test_random_weights_depend_only_on_seed_and_name():
    a, b = RandomWeights(seed=5), RandomWeights(seed=5)
    name = "model.layers.2.block_sparse_moe.experts.4.w1.weight"
    assert torch.equal(a.get(name, (4, 4)), b.get(name, (4, 4)))
    assert not torch.equal(a.get(name, (4, 4)), RandomWeights(seed=6).get(name, (4, 4)))
    assert torch.equal(a.get("model.norm.weight", (8,)), torch.ones(8))
