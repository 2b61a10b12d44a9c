"""The link from an attention node to the expert nodes (`ExpertLink`) and what travels over it:
the dispatch payload, its packing, and the BUSY flag on answers.

Per (step, layer, micro-batch) each attention node sends each expert node one message:
the tokens that chose at least one of that node's experts, once per token, as
    x        [n, hidden]   model dtype   post-attention-normed hidden states
    ids      [n, top_k]    int32         global expert ids (the node ignores others')
    weights  [n, top_k]    float32       routing weights
packed back to back in that order, n in the header's token count. The expert node answers
with [n, hidden] in the model dtype: for each token, the routing-weighted sum of its
experts' outputs. A node with nothing to say sends n = 0, so nobody waits on silence.
The header flag BUSY on an answer says some attention node had tokens for that
(layer, micro-batch), so idle attention nodes know to keep pace.
"""

from __future__ import annotations

from typing import Protocol

import torch

BUSY = 1  # header flag on expert answers


class LinkMessage(Protocol):
    header: object  # .step, .layer, .micro_batch, .token_count, .flags

    def tensor(self, dtype: torch.dtype = ...) -> torch.Tensor: ...

    def release(self) -> None: ...


class ExpertLink(Protocol):
    """A node's view of its peers (deploy/ binds it to a transport Endpoint)."""

    def send(self, peer: str, payload: torch.Tensor, *, step: int, layer: int, micro_batch: int,
             token_count: int, flags: int = 0) -> None: ...

    def recv(self, peer: str, *, micro_batch: int) -> LinkMessage: ...


def dispatch_bytes(tokens: int, hidden: int, top_k: int, dtype: torch.dtype) -> int:
    return tokens * (hidden * torch.empty(0, dtype=dtype).element_size() + top_k * 8)


def pack_dispatch(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """One contiguous byte tensor: x, then ids as int32, then weights as float32."""
    if x.shape[0] == 0:
        return torch.empty(0, dtype=torch.uint8)
    parts = [x.contiguous().view(-1).view(torch.uint8), ids.to(torch.int32).contiguous().view(-1).view(torch.uint8),
             weights.to(torch.float32).contiguous().view(-1).view(torch.uint8)]
    return torch.cat(parts)


def unpack_dispatch(buf: torch.Tensor, tokens: int, hidden: int, top_k: int,
                    dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Views (no copy) of x [n, hidden], ids [n, top_k] int32, weights [n, top_k] float32."""
    x_bytes = tokens * hidden * torch.empty(0, dtype=dtype).element_size()
    k_bytes = tokens * top_k * 4
    if buf.numel() != x_bytes + 2 * k_bytes:
        raise ValueError(f"dispatch payload of {buf.numel()} bytes does not hold {tokens} tokens "
                         f"(expected {x_bytes + 2 * k_bytes})")
    x = buf[:x_bytes].view(dtype).view(tokens, hidden)
    ids = buf[x_bytes:x_bytes + k_bytes].view(torch.int32).view(tokens, top_k)
    weights = buf[x_bytes + k_bytes:].view(torch.float32).view(tokens, top_k)
    return x, ids, weights
