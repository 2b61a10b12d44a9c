"""The data-plane link of a node actor: an M2N endpoint that can be replaced when the
deployment re-wires after a failure, and interrupted so a blocked loop notices.

Only the node's loop thread touches the endpoint once it serves: polling a channel takes
credits and completions, and a second thread doing so at the same time (a Ray thread asking
for `resources()`) could split a tcp credit frame or take an RDMA credit before the loop had
marked its slot busy: a spurious ProtocolViolation across hosts. So the slots in use are
counted by the loop thread (`count_usage`) at a moment the node is between steps, and
`slot_usage()` returns that count without touching the transport. Attention ranks count at
the start of a step; an expert node, whose steps follow one another at once, counts inside
a wait in which nothing arrived for QUIET_S (`count_when_quiet`): its peers are then between
steps, its answers consumed and its dispatches released."""

from __future__ import annotations

import threading
import time

import torch

from megainfer.disagg import expert_link
from transport import BackendUnavailable, Endpoint, EndpointSpec, PeerTimeout, TransportError
from transport import rounds, wire
from transport.rounds import Arrivals
from transport.wire import RegionGrant

# The runtime reads these header columns under its own names (megainfer/disagg/expert_link.py,
# which imports no transport), and the mark's place (MARK_LEAD); this binding is where the two
# meet, so it checks they agree.
HEADER_COLUMNS = ("STEP", "LAYER", "FLAGS", "BYTE_LENGTH")
_disagreeing = [c for c in HEADER_COLUMNS if getattr(expert_link, c) != getattr(rounds, c)]
_disagreeing += ["MARK_LEAD"] if expert_link.MARK_LEAD != wire.MARK_LEAD else []
if _disagreeing:
    raise ImportError(f"megainfer/disagg/expert_link.py names {_disagreeing} otherwise than transport/rounds.py "
                      "and transport/wire.py lay them out: make them agree")


class LinkInterrupted(TransportError):
    """The deployment is re-wiring; the current step is abandoned."""


class SwitchableLink:
    POLL_S = 0.5  # longest blocking receive before checking for an interrupt
    QUIET_S = 0.001  # a receive that waited this long for nothing: a moment to count slots (count_when_quiet)
    COUNT_EVERY_S = 0.05  # the loop thread counts the slots in use at most this often

    def __init__(self, name: str, rank: int, secret: bytes, host: str, slot_bytes: int, num_slots: int,
                 backend: str, timeout_s: float, *, peers: int = 0, peer_slot_bytes: int | None = None,
                 rdma_devices: tuple[str, ...] = (), count_when_quiet: bool = False) -> None:
        """`peers`, `peer_slot_bytes`: how many peers wiring connects and their slot size, so an
        endpoint checks before wiring that rdma can register its channels (transport.rdma.Wiring);
        `rdma_devices`: the verbs devices rdma may use (plan.yaml's transport.rdma_devices)."""
        self._spec = dict(name=name, rank=rank, secret=secret, listen=f"{host}:0", slot_bytes=slot_bytes,
                          num_slots=num_slots, backend=backend, timeout_s=timeout_s, expected_peers=peers,
                          peer_slot_bytes=peer_slot_bytes, rdma_devices=tuple(rdma_devices))
        self.count_when_quiet = count_when_quiet
        self._usage = (0, 0)  # (held, unreleased) as the loop thread last counted them
        self._count_due = 0.0  # monotonic time of the next count
        self.endpoint: Endpoint | None = None
        self.sources: list[torch.Tensor] = []  # send buffers, registered with every endpoint opened
        self.interrupt = threading.Event()
        self.timeout_s = timeout_s

    def open(self) -> str:
        """A fresh endpoint (closing any old one); returns its address for the peers."""
        if self.endpoint is not None:
            self.endpoint.close()
        self._usage = (0, 0)
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

    def expose(self, buffer: torch.Tensor) -> RegionGrant | None:
        """A region this node's peers write into (its device slots), on the current endpoint
        (see ExpertLink.expose)."""
        return self.endpoint.expose(buffer)

    def aim(self, peer: str, grant: list | None) -> None:
        """The region `peer` exposed, from the plain fields its offer carried."""
        self.endpoint.aim(peer, grant)

    def settle(self) -> None:
        self.endpoint.settle()

    def hold_stream(self, stream: int, device: int, addresses, values) -> str | None:
        """See ExpertLink.hold_stream: the transport's BackendUnavailable becomes its reason."""
        try:
            self.endpoint.hold_stream(stream, device, addresses, values)
        except BackendUnavailable as exc:
            return str(exc)
        return None

    def reads_in_place(self, buffer: torch.Tensor) -> bool:
        return self.endpoint.reads_in_place(buffer)

    def can_aim(self, peer: str) -> bool:
        return self.endpoint.can_aim(peer)

    def post_round(self, peers: tuple[str, ...], buffer: torch.Tensor, begins, ends, token_counts, *, step: int,
                   layer: int, micro_batch: int, flags: int = 0, targets=None, mark: int = 0) -> None:
        """One message to each of `peers` (transport/rounds.py); `buffer`: host memory."""
        if self.interrupt.is_set():
            raise LinkInterrupted("the deployment is re-wiring")
        self.endpoint.post_round(peers, buffer, begins, ends, token_counts, step=step, layer=layer,
                                 micro_batch=micro_batch, flags=flags, targets=targets, mark=mark)

    def post_rows(self, peers: tuple[str, ...], buffer: torch.Tensor, token_counts, row_bytes: int, *, step: int,
                  layer: int, micro_batch: int, flags: int = 0) -> None:
        """post_round with each peer's rows end to end (transport/endpoint.py)."""
        if self.interrupt.is_set():
            raise LinkInterrupted("the deployment is re-wiring")
        self.endpoint.post_rows(peers, buffer, token_counts, row_bytes, step=step, layer=layer,
                                micro_batch=micro_batch, flags=flags)

    def collect_round(self, peers: tuple[str, ...], *, micro_batch: int) -> Arrivals:
        """A message from each of `peers`, waited for in POLL_S slices so an interrupt is seen
        (a slice that ends loses nothing: what arrived stays taken). An expert node counts its
        slots in use inside a wait in which nothing arrived for QUIET_S."""
        return self._waiting(lambda timeout: self.endpoint.collect_round(peers, micro_batch=micro_batch,
                                                                         timeout=timeout))

    def poll_round(self, peers: tuple[str, ...], *, micro_batch: int) -> Arrivals | None:
        if self.interrupt.is_set():
            raise LinkInterrupted("the deployment is re-wiring")
        return self.endpoint.poll_round(peers, micro_batch=micro_batch)

    def _waiting(self, receive):
        """receive(timeout) until it returns: QUIET_S first where counting is due, then POLL_S
        slices, an interrupt checked between them, PeerTimeout after timeout_s in all."""
        waited = 0.0
        if self.count_when_quiet and time.monotonic() >= self._count_due:
            if self.interrupt.is_set():
                raise LinkInterrupted("the deployment is re-wiring")
            try:
                return receive(self.QUIET_S)
            except PeerTimeout:
                self.count_usage(force=True)  # nothing arrived for QUIET_S: the peers are between steps
                waited += self.QUIET_S
        while True:
            if self.interrupt.is_set():
                raise LinkInterrupted("the deployment is re-wiring")
            try:
                return receive(self.POLL_S)
            except PeerTimeout:
                waited += self.POLL_S
                if waited >= self.timeout_s:
                    raise

    def count_usage(self, force: bool = False) -> None:
        """On the loop thread, between steps: count the slots in use (taking the credits that
        have arrived) for `slot_usage`; at most every COUNT_EVERY_S unless `force`."""
        now = time.monotonic()
        if self.endpoint is None or not force and now < self._count_due:
            return
        self._count_due = now + self.COUNT_EVERY_S
        usage = self.endpoint.slots_in_use()
        self._usage = (usage.held, usage.unreleased)

    def slot_usage(self) -> tuple[int, int]:
        """(received messages not yet released, sent slots the peers have not released yet) as
        the loop thread last counted them: from any thread, without touching the transport."""
        return self._usage

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
        self._usage = (0, 0)
