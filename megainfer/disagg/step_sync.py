"""A tensor-parallel attention node's step, sent from its leader rank (which schedules and
samples) to its follower ranks (which hold the other heads), over the node's own
torch.distributed group. Layout of the int64 payload:
    [num_seqs, num_single_token,
     per sequence: num_computed_tokens, num_new_tokens, num_blocks, new token ids..., block ids...]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megainfer.scheduler import SchedulerOutput


@dataclass
class SequenceView:
    """What a follower needs of a sequence to prepare its batch."""

    token_ids: list[int]  # only [num_computed_tokens, num_computed_tokens + n) are meaningful
    num_computed_tokens: int
    block_table: list[int]


def encode(out: SchedulerOutput) -> torch.Tensor:
    flat = [len(out.seqs), out.num_single_token]
    for seq, n in zip(out.seqs, out.num_scheduled_tokens):
        begin = seq.num_computed_tokens
        flat += [begin, n, len(seq.block_table), *seq.token_ids[begin:begin + n], *seq.block_table]
    return torch.tensor(flat, dtype=torch.int64)


def decode(payload: torch.Tensor) -> SchedulerOutput:
    flat = payload.tolist()
    num_seqs, num_single = flat[0], flat[1]
    pos = 2
    seqs, counts = [], []
    for _ in range(num_seqs):
        begin, n, nb = flat[pos:pos + 3]
        pos += 3
        tokens, blocks = flat[pos:pos + n], flat[pos + n:pos + n + nb]
        pos += n + nb
        seqs.append(SequenceView([0] * begin + tokens, begin, blocks))
        counts.append(n)
    return SchedulerOutput(seqs=seqs, num_scheduled_tokens=counts, num_single_token=num_single)


def broadcast_step(out: SchedulerOutput) -> None:
    payload = encode(out)
    dist.broadcast(torch.tensor([payload.numel()], dtype=torch.int64), src=0)
    dist.broadcast(payload, src=0)


def receive_step() -> SchedulerOutput:
    size = torch.zeros(1, dtype=torch.int64)
    dist.broadcast(size, src=0)
    payload = torch.empty(int(size.item()), dtype=torch.int64)
    dist.broadcast(payload, src=0)
    return decode(payload)
