"""The data-plane link of a node actor: an M2N endpoint that can be replaced when the
deployment re-wires after a failure, and interrupted so a blocked loop notices."""

from __future__ import annotations

import threading

import torch

from transport import Endpoint, EndpointSpec, Message, PeerTimeout, TransportError


class LinkInterrupted(TransportError):
    """The deployment is re-wiring; the current step is abandoned."""


class SwitchableLink:
    POLL_S = 0.5  # longest blocking receive before checking for an interrupt

    def __init__(self, name: str, rank: int, secret: bytes, host: str, slot_bytes: int, num_slots: int,
                 backend: str, timeout_s: float) -> None:
        self._spec = dict(name=name, rank=rank, secret=secret, listen=f"{host}:0", slot_bytes=slot_bytes,
                          num_slots=num_slots, backend=backend, timeout_s=timeout_s)
        self.endpoint: Endpoint | None = None
        self.sources: list[torch.Tensor] = []  # send buffers, registered with every endpoint opened
        self.interrupt = threading.Event()
        self.timeout_s = timeout_s

    def open(self) -> str:
        """A fresh endpoint (closing any old one); returns its address for the peers."""
        if self.endpoint is not None:
            self.endpoint.close()
        self.endpoint = Endpoint(EndpointSpec(**self._spec))
        for buffer in self.sources:
            self.endpoint.register(buffer)
        self.interrupt.clear()
        return self.endpoint.address

    def connect(self, peers: dict[str, str]) -> None:
        self.endpoint.connect(peers)

    def register(self, buffer: torch.Tensor) -> None:
        """A pinned buffer payloads leave from (see ExpertLink.register)."""
        self.sources.append(buffer)
        if self.endpoint is not None:
            self.endpoint.register(buffer)

    def backends(self) -> dict[str, str]:
        """Peer -> the M2N backend its pair chose (the reason is in this actor's log)."""
        return {peer: choice.backend for peer, choice in self.endpoint.choices.items()} if self.endpoint else {}

    def send(self, peer: str, payload: torch.Tensor, *, step: int, layer: int, micro_batch: int,
             token_count: int, flags: int = 0) -> None:
        """`payload`: a host tensor (device tensors are staged through pinned memory by the
        runner; the endpoint refuses them)."""
        if self.interrupt.is_set():
            raise LinkInterrupted("the deployment is re-wiring")
        self.endpoint.send(peer, payload.contiguous(), step=step, layer=layer, micro_batch=micro_batch,
                           token_count=token_count, flags=flags)

    def recv(self, peer: str, *, micro_batch: int) -> Message:
        waited = 0.0
        while True:
            if self.interrupt.is_set():
                raise LinkInterrupted("the deployment is re-wiring")
            try:
                return self.endpoint.recv(peer, micro_batch=micro_batch, timeout=self.POLL_S)
            except PeerTimeout:
                waited += self.POLL_S
                if waited >= self.timeout_s:
                    raise

    def poll(self, peer: str, *, micro_batch: int) -> Message | None:
        """The message `recv` would return, if it has arrived; None at once otherwise (the
        runner sends dispatches as their device copies land while it awaits an answer)."""
        if self.interrupt.is_set():
            raise LinkInterrupted("the deployment is re-wiring")
        try:
            return self.endpoint.recv(peer, micro_batch=micro_batch, timeout=0)
        except PeerTimeout:
            return None

    def slot_usage(self) -> tuple[int, int]:
        """(received messages not yet released, sent slots the peers have not released yet)."""
        if self.endpoint is None:
            return 0, 0
        usage = self.endpoint.slots_in_use()
        return usage.held, usage.unreleased

    def drop_connections(self) -> None:
        """Close every channel of the current endpoint, as a network fault would (fault injection:
        `megainfer bench soak --chaos`); the peers see their connections drop and the deployment
        re-wires."""
        if self.endpoint is not None:
            self.endpoint.sever()

    def close(self) -> None:
        if self.endpoint is not None:
            self.endpoint.close()
            self.endpoint = None
