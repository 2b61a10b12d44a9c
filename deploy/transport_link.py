"""Binds megainfer's `ExpertLink` to an M2N transport `Endpoint` (Ray-free)."""

from __future__ import annotations

import torch

from transport import Endpoint, Message


class TransportLink:
    def __init__(self, endpoint: Endpoint) -> None:
        self.endpoint = endpoint

    def send(self, peer: str, payload: torch.Tensor, *, step: int, layer: int, micro_batch: int,
             token_count: int, flags: int = 0) -> None:
        self.endpoint.send(peer, payload.contiguous(), step=step, layer=layer, micro_batch=micro_batch,
                           token_count=token_count, flags=flags)

    def recv(self, peer: str, *, micro_batch: int) -> Message:
        return self.endpoint.recv(peer, micro_batch=micro_batch)
