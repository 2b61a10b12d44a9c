"""One (layer, micro-batch)'s attention half as an attention rank runs it: the layer, then its
routed tokens packed into dispatch records in expert-node order. The same function runs eager
and inside a CUDA graph (decode_graphs.py), so both dispatch the same bytes (`attention_halves.py`
chooses between them, micro-batch by micro-batch)."""

from __future__ import annotations

from dataclasses import dataclass
import torch

import kernels
from megainfer.disagg.expert_link import pack_records
from megainfer.model.attention_layer import AttentionLayer
from megainfer.model.rotary import RotaryEmbedding


@dataclass
class DispatchParts:
    """What one (layer, micro-batch)'s attention half leaves for the dispatch and the combine."""

    residual: torch.Tensor  # [T, H] residual stream after attention
    records: torch.Tensor  # [rows, record bytes] uint8: every expert node's records in node order, spare rows last
    node_offsets: torch.Tensor  # [N + 1] int64 device: where each expert node's records begin
    token_ids: torch.Tensor  # [rows] int64 device: the token of each record


def tokens_in_node_order(token_ids: torch.Tensor, node_offsets: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Each expert node's segment of `token_ids` in ascending token order, spare entries (past
    the last offset) last. The Triton gating kernel fills a segment with atomics, so its order
    varies from run to run, and the ranks of a tensor-parallel node, which each run it, would
    split a segment into overlapping shares. Sorting on the device needs no host sync."""
    positions = torch.arange(token_ids.numel(), device=token_ids.device)
    node = torch.searchsorted(node_offsets[1:].to(torch.int64), positions, right=True)  # spare: past the last
    keys = node * num_tokens + token_ids.to(torch.int64)
    return (keys.sort().values % num_tokens).to(token_ids.dtype)


def attend_and_pack(layer: AttentionLayer, rotary: RotaryEmbedding, kv_cache: tuple[torch.Tensor, torch.Tensor],
                    hidden: torch.Tensor, positions: torch.Tensor, batch: kernels.PagedAttentionBatch,
                    expert_counts: torch.Tensor, tp_size: int = 1, valid: torch.Tensor | None = None) -> DispatchParts:
    """`layer`'s attention half over `hidden`, the tokens it routed added to `expert_counts`
    ([E], this layer's row), and the dispatch records packed. Device work only: nothing is
    read back. `valid`: a padded batch's live rows (the rest are sent nowhere)."""
    a = layer(hidden, positions, rotary, kv_cache, batch, valid)
    g = a.gating
    expert_counts += g.expert_counts
    # Past node_offsets[-1] the entries are spare (uninitialised on the Triton path): clamped so
    # the gather stays in bounds. Those records are copied but never sent.
    token_ids = g.node_token_ids.clamp(0, hidden.shape[0] - 1)
    if tp_size > 1:  # the ranks split each node's tokens by position: they must agree on the order
        token_ids = tokens_in_node_order(token_ids, g.node_offsets, hidden.shape[0])
    # Every token packed once, then the records gathered in send order: one gather, not three.
    records = pack_records(a.expert_input, a.topk_slots, a.topk_weights)[token_ids]
    return DispatchParts(a.residual, records, g.node_offsets, token_ids)
