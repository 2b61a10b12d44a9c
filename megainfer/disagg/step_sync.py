"""A tensor-parallel attention node's step, sent from its leader rank (which schedules and
samples) to its follower ranks (which hold the other heads), over the node's control group
(gloo: host tensors; see megainfer/tensor_parallel.py). Layout of the int64 payload:
    [num_seqs, num_single_token, has_layered, group, num_groups, first_layer, end_layer,
     num_members, then per sequence of `SchedulerOutput.all_seqs`: SEQ]
    SEQ = key, num_computed_tokens, num_new_tokens, num_tokens, num_blocks,
          new token ids (num_new_tokens of them)..., block ids (num_blocks of them)...
`all_seqs` is the step's own `num_seqs` sequences, then the layered cohort's `num_members`;
without a layered pass (`has_layered` 0) the five cohort fields are 0. `num_tokens` is the
sequence's whole length, so a follower knows which sequences complete this step.
`key` names a sequence for as long as it lives on the leader (its object id), so a follower
can keep a layered-prefill cohort's hidden states between steps under the same name.

A follower rebuilds the leader's `SchedulerOutput` from this (one `SequenceView` per sequence)
and derives the step's `StepLayout` with the same constructor as the leader, so every rank
splits micro-batches and offsets rows identically.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megainfer.scheduling.scheduler_output import LayeredPass, SchedulerOutput
from megainfer.tensor_parallel import TensorParallelGroup

_HEADER = 8  # int64 fields before the first SEQ


@dataclass
class SequenceView:
    """What a follower needs of a sequence to prepare its batch and lay out its rows."""

    request_id: str  # the leader's key for the sequence, not its request id
    token_ids: list[int]  # only [num_computed_tokens, num_computed_tokens + n) are meaningful
    num_computed_tokens: int  # tokens already in the KV cache, where this step's begin
    num_tokens: int  # the sequence's length on the leader (prompt and generated tokens)
    block_table: list[int]  # KV-cache block ids, in order, as the leader allocated them
    window_table: list[int]  # the windowed layers' (gpt-oss), released entries included; [] without


def encode(out: SchedulerOutput) -> torch.Tensor:
    cohort = out.layered
    if cohort is None:
        flat = [len(out.seqs), out.num_single_token, 0, 0, 0, 0, 0, 0]
        counts = out.num_scheduled_tokens
    else:
        flat = [len(out.seqs), out.num_single_token, 1, cohort.group, cohort.num_groups, *cohort.layers,
                len(cohort.seqs)]
        counts = out.num_scheduled_tokens + cohort.num_tokens
    for seq, n in zip(out.all_seqs, counts):
        begin = seq.num_computed_tokens
        flat += [id(seq), begin, n, seq.num_tokens, len(seq.block_table), len(seq.window_table),
                 *seq.token_ids[begin:begin + n], *seq.block_table, *seq.window_table]
    return torch.tensor(flat, dtype=torch.int64)


def decode(payload: torch.Tensor) -> SchedulerOutput:
    flat = payload.tolist()
    num_seqs, num_single, has_layered, group, num_groups, first, end, members = flat[:_HEADER]
    pos = _HEADER
    views, counts = [], []
    for _ in range(num_seqs + members):
        key, begin, n, length, num_blocks, num_window = flat[pos:pos + 6]
        pos += 6
        tokens, blocks = flat[pos:pos + n], flat[pos + n:pos + n + num_blocks]
        pos += n + num_blocks
        window, pos = flat[pos:pos + num_window], pos + num_window
        views.append(SequenceView(str(key), [0] * begin + tokens, begin, length, blocks, window))
        counts.append(n)
    out = SchedulerOutput(seqs=views[:num_seqs], num_scheduled_tokens=counts[:num_seqs], num_single_token=num_single)
    if has_layered:
        out.layered = LayeredPass(views[num_seqs:], counts[num_seqs:], (first, end), group, num_groups)
    return out


def broadcast_step(group: TensorParallelGroup, out: SchedulerOutput) -> None:
    payload = encode(out)
    group.broadcast_control(torch.tensor([payload.numel()], dtype=torch.int64))
    group.broadcast_control(payload)


def receive_step(group: TensorParallelGroup) -> SchedulerOutput:
    size = torch.zeros(1, dtype=torch.int64)
    group.broadcast_control(size)
    payload = torch.empty(int(size.item()), dtype=torch.int64)
    group.broadcast_control(payload)
    return decode(payload)
