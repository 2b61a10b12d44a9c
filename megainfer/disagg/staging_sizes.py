"""The pinned host staging a node reserves on CUDA (device_staging.py): per micro-batch slot and
direction, the largest message that slot can carry, aligned and nothing more. Torch-free:
`megainfer deploy PLAN --dry-run` prints these for a GPU plan without importing torch.

A micro-batch can carry every token of a step (one long prompt chunk lands in one micro-
batch): `tokens` below is EngineConfig.max_step_tokens. Per (layer, micro-batch):

attention rank, to host: the dispatch, copied whole by every rank of a tensor-parallel node
    (each then sends its share of each expert node's tokens, expert_link.rank_share):
        records  dispatch_rows(tokens) x record_size   (the gating kernel sizes the records
                 buffer by this host-known bound, a token once for each expert node it chose:
                 min(top_k, expert nodes); rows past the last node offset are spare)
        offsets  (expert nodes + 1) x 8 bytes (int64), the part after the records, ALIGN-aligned
attention rank, to device: every expert node's answer to this rank, end to end,
        answer_rows(tokens) x hidden x dtype bytes
expert node (its leader), to device: every attention rank's dispatch, end to end: at most
        `tokens` of each attention node (a token goes once to each expert node it chose;
        the ranks of a node split its tokens), attention nodes x tokens x record_size
expert node, to host: its answers, one row per token received,
        attention nodes x tokens x hidden x dtype bytes, ALIGN-aligned

The transport's 32-byte message headers travel in its own slots (transport/wire.py), never in
this staging. Nor does an expert node's load round (expert_load_round.py), sent once per step
from host memory: `load_round_bytes`, which an attention rank's receive slots must hold too.
"""

from __future__ import annotations

from typing import NamedTuple

ALIGN = 64  # bytes: each part of a staged copy starts aligned (any dtype view of it is valid)
LOAD_ENTRY_BYTES = 8  # the load round's entry per (layer, row): int32 (layer, expert) cell, int32 pairs
FIELD_BYTES = 4  # a record's expert id (int32) or routing weight (float32)
NODE_OFFSET_BYTES = 8  # int64 node offsets beside the dispatch records


class StagingBytes(NamedTuple):
    """Pinned bytes of one micro-batch slot, per direction."""

    to_host: int = 0  # device -> host: what the node sends
    to_device: int = 0  # host -> device: what it receives

    @property
    def per_slot(self) -> int:
        return self.to_host + self.to_device


def aligned_layout(sizes: list[int]) -> tuple[list[int], int]:
    """Offsets of parts of these byte sizes laid end to end at ALIGN boundaries, and the total."""
    offsets, end = [], 0
    for size in sizes:
        offsets.append(end)
        end += -(-size // ALIGN) * ALIGN
    return offsets, end


def record_size(hidden: int, top_k: int, value_bytes: int) -> int:
    """Bytes of one token's dispatch record (expert_link.py: x, int32 ids, float32 weights)."""
    return hidden * value_bytes + 2 * top_k * FIELD_BYTES


def dispatch_rows(tokens: int, top_k: int, expert_nodes: int) -> int:
    """Rows of the records buffer one attention rank builds for a micro-batch of `tokens`."""
    return max(1, tokens * min(top_k, expert_nodes))


def answer_rows(tokens: int, top_k: int, expert_nodes: int, tp_size: int) -> int:
    """The most answer rows one attention rank receives for a micro-batch: its share of each
    expert node's c_k tokens, at most ceil(c_k / tp) each, where the c_k add up to at most
    tokens x min(top_k, expert nodes): the sum is at most (that + nodes x (tp - 1)) // tp."""
    routed = tokens * min(top_k, expert_nodes)
    return min(routed, (routed + expert_nodes * (tp_size - 1)) // tp_size)


def attention_staging(tokens: int, hidden: int, top_k: int, value_bytes: int, expert_nodes: int,
                      tp_size: int) -> StagingBytes:
    """One attention rank's largest messages of one micro-batch."""
    records = dispatch_rows(tokens, top_k, expert_nodes) * record_size(hidden, top_k, value_bytes)
    _, to_host = aligned_layout([records, (expert_nodes + 1) * NODE_OFFSET_BYTES])
    return StagingBytes(to_host, answer_rows(tokens, top_k, expert_nodes, tp_size) * hidden * value_bytes)


def expert_staging(tokens: int, hidden: int, top_k: int, value_bytes: int, attention_nodes: int) -> StagingBytes:
    """One expert node's largest messages of one micro-batch (its leader's: followers stage none)."""
    received = attention_nodes * tokens
    _, to_host = aligned_layout([received * hidden * value_bytes])
    return StagingBytes(to_host, received * record_size(hidden, top_k, value_bytes))


def load_round_bytes(num_layers: int, room: int) -> int:
    """An expert node's load round: an entry per (layer, row) of its room (expert_load_round.py)."""
    return num_layers * room * LOAD_ENTRY_BYTES
