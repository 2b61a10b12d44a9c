"""A tensor-parallel attention node's step, sent from its leader rank (which schedules and
samples) to its follower ranks (which hold the other heads), over the node's own
torch.distributed group. Layout of the int64 payload:
    [num_seqs, num_single_token, per sequence: SEQ,
     has_layered, (if 1) group, num_groups, first_layer, end_layer, num_members, per member: SEQ]
    SEQ = key, num_computed_tokens, num_new_tokens, num_blocks, new token ids..., block ids...
`key` names a sequence for as long as it lives on the leader (its object id), so a follower
can keep a layered-prefill cohort's hidden states between steps under the same name.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megainfer.scheduler import LayeredPass, SchedulerOutput


@dataclass
class SequenceView:
    """What a follower needs of a sequence to prepare its batch."""

    request_id: str  # the leader's key for the sequence, not its request id
    token_ids: list[int]  # only [num_computed_tokens, num_computed_tokens + n) are meaningful
    num_computed_tokens: int
    block_table: list[int]


def _put(flat: list[int], seq, n: int) -> None:
    begin = seq.num_computed_tokens
    flat += [id(seq), begin, n, len(seq.block_table), *seq.token_ids[begin:begin + n], *seq.block_table]


def _take(flat: list[int], pos: int) -> tuple[SequenceView, int, int]:
    key, begin, n, nb = flat[pos:pos + 4]
    pos += 4
    tokens, blocks = flat[pos:pos + n], flat[pos + n:pos + n + nb]
    return SequenceView(str(key), [0] * begin + tokens, begin, blocks), n, pos + n + nb


def encode(out: SchedulerOutput) -> torch.Tensor:
    flat = [len(out.seqs), out.num_single_token]
    for seq, n in zip(out.seqs, out.num_scheduled_tokens):
        _put(flat, seq, n)
    lp = out.layered
    if lp is None:
        flat.append(0)
    else:
        flat += [1, lp.group, lp.num_groups, lp.layers[0], lp.layers[1], len(lp.seqs)]
        for seq, n in zip(lp.seqs, lp.num_tokens):
            _put(flat, seq, n)
    return torch.tensor(flat, dtype=torch.int64)


def decode(payload: torch.Tensor) -> SchedulerOutput:
    flat = payload.tolist()
    num_seqs, num_single = flat[0], flat[1]
    pos = 2
    seqs, counts = [], []
    for _ in range(num_seqs):
        view, n, pos = _take(flat, pos)
        seqs.append(view)
        counts.append(n)
    out = SchedulerOutput(seqs=seqs, num_scheduled_tokens=counts, num_single_token=num_single)
    if flat[pos]:
        group, num_groups, first, end, members = flat[pos + 1:pos + 6]
        pos += 6
        views, chunk = [], []
        for _ in range(members):
            view, n, pos = _take(flat, pos)
            views.append(view)
            chunk.append(n)
        out.layered = LayeredPass(views, chunk, (first, end), group, num_groups)
    return out


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
