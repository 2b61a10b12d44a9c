"""An M2N endpoint: pre-registered slots, tagged one-sided writes, no collective set-up.

An endpoint is built from a plain description (its name and rank, where it listens, its
peers' addresses, its slot sizes, a shared secret). `connect()` authenticates one control
connection to and from every peer and picks a backend per peer pair (shm on one host,
rdma where both ends have a working verbs port, nixl where both have NIXL, tcp otherwise;
see transport/selection.py), logging the choice and its reason; after that, `send()` writes a
message into the peer's slot for its micro-batch and `recv()` returns the next message as
a view on this endpoint's own slot, with no copy, until `Message.release()`.

A slot is reused only once its consumer released it: a sender whose slot is still held
waits (back-pressure), and every wait ends in `PeerTimeout` after `timeout_s` or
`PeerClosed` as soon as the peer's connection drops: never a hang.

A peer that breaks the protocol (transport/wire_rules.py says what is checked) has its
channels dropped, as if it had closed them: waits on it raise `ProtocolViolation` (a
`PeerClosed`) saying what was wrong, and the endpoint keeps serving every other peer, whose
slots and pending messages it never touches. `slots_in_use()` counts the slots in use for
leak checks.
"""

from __future__ import annotations

import socket
import threading
from dataclasses import dataclass, field

from transport import core
from transport.backends import BackendSet, host_id
from transport.errors import PayloadTooLarge, ProtocolViolation, TransportError
from transport.inbox import Inbox
from transport.message import Message, as_bytes
from transport.peer_channels import PeerChannels
from transport.peering import parse_address
from transport.regions import RegionCalls, Regions
from transport.round_collector import RoundCollector
from transport.round_poster import RoundPoster
from transport.rounds import Arrivals, RoundTable
from transport.selection import BACKENDS
from transport.send_waits import SendWaits
from transport.slot_usage import SlotUsage, count_slots
from transport.wakeups import Wakeups
from transport.wire import MAX_SLOTS, SEQ_MASK, Header, check_header_fields

__all__ = ["Endpoint", "EndpointSpec", "Message", "SlotUsage", "connect_concurrently", "host_id", "parse_address"]


@dataclass
class EndpointSpec:
    name: str  # unique among the endpoints that talk to each other, e.g. "attn0"
    secret: bytes  # shared by all endpoints of a deployment; strangers are refused
    rank: int = 0  # written into every header this endpoint sends (the sender field)
    listen: str = "127.0.0.1:0"  # control listener; port 0 picks a free one (see Endpoint.address)
    peers: dict[str, str] = field(default_factory=dict)  # peer name -> its listen address
    slot_bytes: int = 1 << 20  # payload capacity of each of this endpoint's receive slots
    num_slots: int = 2  # receive slots per sending peer: micro-batches in flight
    backend: str = "auto"  # "auto" | "shm" | "tcp" | "rdma" | "nixl" (transport/selection.py: how auto chooses)
    timeout_s: float = 30.0  # longest wait for a peer (connect, send slot, receive)
    spin_us: float = 50.0  # busy-poll this long before sleeping on a wakeup
    tcp_buffer_bytes: int | None = None  # tcp socket buffers; None leaves them to the kernel's autotuning
    # What wiring will register, for rdma's locked-memory check at construction (transport/backends.py):
    expected_peers: int = 0  # peers connect() will be given; 0: len(peers), or checked at connect
    peer_slot_bytes: int | None = None  # the peers' slot_bytes (this endpoint writes into them); None: ours
    rdma_devices: tuple[str, ...] = ()  # verbs devices rdma may use, nearest the GPU first; (): any
    core: str = "auto"  # shm, tcp, rdma channels and rounds in the compiled core: auto | on | off (transport/core.py)

    def __post_init__(self) -> None:
        if not self.name or "/" in self.name:
            raise ValueError(f"EndpointSpec.name must be a non-empty name without '/', got {self.name!r}")
        if not isinstance(self.secret, (bytes, bytearray)) or len(self.secret) < 16:
            raise ValueError("EndpointSpec.secret must be at least 16 bytes (os.urandom(32) is a good one)")
        if self.backend not in BACKENDS:
            raise ValueError(f"EndpointSpec.backend {self.backend!r} is not one of {', '.join(BACKENDS)}")
        if self.slot_bytes <= 0 or not 0 < self.num_slots <= MAX_SLOTS:
            raise ValueError(f"EndpointSpec.slot_bytes must be positive and num_slots in [1, {MAX_SLOTS}], got "
                             f"{self.slot_bytes} and {self.num_slots}")
        if not 0 <= self.rank < (1 << 16):
            raise ValueError(f"EndpointSpec.rank must fit 16 bits, got {self.rank}")
        if self.timeout_s <= 0 or self.spin_us < 0:
            raise ValueError("EndpointSpec.timeout_s must be positive and spin_us non-negative")
        if self.tcp_buffer_bytes is not None and self.tcp_buffer_bytes <= 0:
            raise ValueError(f"EndpointSpec.tcp_buffer_bytes must be positive or None (autotuning), got "
                             f"{self.tcp_buffer_bytes}")
        if self.expected_peers < 0 or self.peer_slot_bytes is not None and self.peer_slot_bytes <= 0:
            raise ValueError(f"EndpointSpec.expected_peers must be non-negative and peer_slot_bytes positive or "
                             f"None, got {self.expected_peers} and {self.peer_slot_bytes}")
        self.rdma_devices = tuple(self.rdma_devices)
        if self.core not in core.CORE_CHOICES:
            raise ValueError(f"EndpointSpec.core {self.core!r} is not one of {', '.join(core.CORE_CHOICES)}")
        parse_address(self.listen)


class Endpoint(RegionCalls):
    """An M2N endpoint (the module docstring says what it guarantees). It is the caller's
    face over its parts: the channel set and its peers gone (transport/peer_channels.py),
    the inbox of received messages (transport/inbox.py), the waits on its sockets and
    doorbell (transport/wakeups.py), a send's slow paths (transport/send_waits.py), and its
    rounds (transport/round_poster.py, transport/round_collector.py). `send` keeps its whole
    fast case here and `recv`'s first look is one call into the inbox: per message a part
    costs one attribute lookup (the data plane is measured per message); the waits live in
    the parts."""

    def __init__(self, spec: EndpointSpec) -> None:
        self.spec = spec
        host, port = parse_address(spec.listen)
        self.listener = socket.create_server((host, port), reuse_port=False, backlog=128)
        try:  # a requested backend that cannot work (rdma past the locked-memory limit) fails here
            self.uses_core = core.resolve(spec.core, spec.name)
            self.backends = BackendSet(spec.name, spec.backend, spec.slot_bytes, spec.num_slots,
                                       spec.tcp_buffer_bytes, spec.expected_peers or len(spec.peers),
                                       spec.peer_slot_bytes, spec.rdma_devices, rank=spec.rank,
                                       core=self.uses_core, core_demanded=core.demanded(spec.core),
                                       timeout_s=spec.timeout_s)
        except BaseException:
            self.listener.close()
            raise
        self.doorbell = self.backends.doorbell
        self._wakeups = Wakeups(spec.spin_us)
        self._channels = channels = PeerChannels(spec, self.backends, self.listener, self._wakeups)
        # The channel set's own dicts (emptied and refilled, never replaced): the public `outbound`,
        # `inbound` and `choices` (peer -> its pair's backend and why), and what send() reads.
        self.outbound, self.inbound, self.choices = channels.outbound, channels.inbound, channels.choices
        self._seq, self._dead = channels.seq, channels.dead
        self._inbox = Inbox(spec, channels, self._wakeups)
        self._send_waits = SendWaits(spec, channels, self._inbox, self._wakeups)
        self._round_table = RoundTable(spec.name, self.outbound, self.inbound, self.doorbell)
        self._poster = RoundPoster(spec, self._round_table, channels, self._wakeups, self.send)
        self._collector = RoundCollector(spec, self._round_table, channels, self._inbox, self._wakeups,
                                         self.poll, self.recv)
        self.regions = Regions(spec.name, self.backends, self.outbound)

    @property
    def address(self) -> str:
        host, port = self.listener.getsockname()[:2]
        return f"{host}:{port}"

    def backend_of(self, peer: str) -> str:
        return self.outbound[peer].kind

    # -- set-up ----------------------------------------------------------------------------
    def connect(self, peers: dict[str, str] | None = None) -> "Endpoint":
        """Authenticate a connection to and from every peer; returns when all are up."""
        if peers is not None:
            self.spec.peers = dict(peers)
        self._channels.connect(self.spec.peers)
        self._channels.watch(self._inbox.collect)
        self._wakeups.pace(self._channels.kinds())
        return self

    # -- data --------------------------------------------------------------------------------
    def send(self, peer: str, payload=b"", *, step: int = 0, layer: int = 0, micro_batch: int = 0,
             token_count: int = 0, flags: int = 0, timeout: float | None = None) -> None:
        """Write one message into `peer`'s slot for `micro_batch`; waits while the peer still
        holds that slot. An empty payload is a valid message (a header alone)."""
        channel = self.outbound.get(peer)
        if channel is None:
            raise TransportError(f"endpoint {self.spec.name} has no peer {peer!r}; peers: {', '.join(self.outbound)}")
        if self._dead and peer in self._dead:
            self._channels.check_alive((peer,))
        data = memoryview(payload) if isinstance(payload, (bytes, bytearray)) else as_bytes(payload)
        n = len(data)
        if n > channel.slot_bytes:
            raise PayloadTooLarge(f"payload of {n} bytes exceeds the {channel.slot_bytes}-byte slot of peer "
                                  f"{peer}; raise that endpoint's slot_bytes or split the message")
        check_header_fields(step, layer, micro_batch, self.spec.rank, token_count)
        seq = self._seq[peer]
        header = Header(step, layer, micro_batch, self.spec.rank, flags & 0xFFFF, token_count, seq, n)
        limit = self.spec.timeout_s if timeout is None else timeout
        try:
            if not channel.try_send(header, data):
                self._send_waits.until_free(channel, header, data, limit)
            if getattr(channel, "unsent", 0):
                self._send_waits.until_sent(channel, limit)
        except ProtocolViolation as exc:  # a malformed credit from the peer
            self._channels.drop(peer, exc)
            raise
        self._seq[peer] = (seq + 1) & SEQ_MASK

    def recv(self, peer: str | None = None, *, micro_batch: int | None = None,
             timeout: float | None = None) -> Message:
        """The next message (from `peer`, for `micro_batch`, when given), as a view on its slot."""
        msg = self._inbox.poll_once(peer, micro_batch)
        if msg is not None:
            return msg
        return self._inbox.wait(peer, micro_batch, timeout)

    def poll(self, peer: str, *, micro_batch: int | None = None) -> Message | None:
        """The message `recv` would return if it has arrived, else None at once (with `send`,
        `recv` and `register`, an Endpoint is a node's ExpertLink where nothing re-wires it)."""
        if peer not in self.inbound:
            raise TransportError(f"endpoint {self.spec.name} has no peer {peer!r}; peers: {', '.join(self.inbound)}")
        msg = self._inbox.poll_once(peer, micro_batch)
        if msg is None:
            self._channels.check_alive((peer,))
        return msg

    # -- rounds ------------------------------------------------------------------------------
    def post_round(self, peers: tuple[str, ...], buffer, begins, ends, token_counts, *, step: int = 0,
                   layer: int = 0, micro_batch: int = 0, flags: int = 0, timeout: float | None = None,
                   targets=None, mark: int = 0) -> None:
        """One message to each of `peers`: peers[i] gets bytes [begins[i], ends[i]) of `buffer`
        (a contiguous CPU tensor or numpy array) with header token count token_counts[i]. Returns
        once every message is written (the buffer may then be reused). Peers whose slot is still
        held are waited for, each within the timeout; a peer that fails (gone, or holding its
        slot past the timeout) does not stop the others: RoundFailed names every one that did.
        `targets` (one int per peer, or None): where targets[i] >= 0, peer i's bytes are written
        at that offset of the region it exposed (`aim`), and its header says 0 bytes; -1: its slot.
        `mark` (with `targets`; a 32-bit word, 0: none): after each such peer's bytes, and before
        its header, the mark is written as the 4 bytes `wire.MARK_LEAD` before them, in the same
        chain, for the peer's GPU stream to wait on (`hold_stream`)."""
        self._poster.post_round(peers, buffer, begins, ends, token_counts, step, layer, micro_batch, flags, timeout,
                                targets, mark)

    def post_rows(self, peers: tuple[str, ...], buffer, token_counts, row_bytes: int, *, step: int = 0,
                  layer: int = 0, micro_batch: int = 0, flags: int = 0, timeout: float | None = None,
                  targets=None, mark: int = 0) -> None:
        """`post_round` where peers[i]'s bytes are token_counts[i] rows of `row_bytes`, the peers'
        rows end to end from the buffer's start (an expert node's answers, a dispatch's records
        in node order)."""
        self._poster.post_rows(peers, buffer, token_counts, row_bytes, step, layer, micro_batch, flags, timeout,
                               targets, mark)

    def collect_round(self, peers: tuple[str, ...], *, micro_batch: int, timeout: float | None = None) -> Arrivals:
        """A message for `micro_batch` from each of `peers`, as views on their slots until the
        returned Arrivals is released. A peer that fails (gone, or broke the protocol) does not
        stop the others from arriving; once each has arrived or failed, the round's messages
        are released and RoundFailed names every peer that failed. Where peers are only slow,
        PeerTimeout after `timeout` loses nothing: what arrived stays taken for the next call."""
        arrivals = self._collector.collect(peers, micro_batch, self.spec.timeout_s if timeout is None else timeout)
        assert arrivals is not None
        return arrivals

    def poll_round(self, peers: tuple[str, ...], *, micro_batch: int) -> Arrivals | None:
        """The round `collect_round` would return if all of it has arrived, else None at once
        (what arrived so far stays taken, for the next call)."""
        return self._collector.collect(peers, micro_batch, None)

    # -- accounting, registration, lifecycle ---------------------------------------------------
    def slots_in_use(self) -> SlotUsage:
        """The slots in use now, for leak checks: credits and doorbells that have arrived are
        taken first (without waiting), so an idle endpoint whose peers released everything
        reads all zero. A peer found gone on the way keeps the slots it never released.
        Taking credits is a poll: call it on the thread that sends and receives, never beside
        it (a second poller can split a tcp credit frame or take an RDMA credit before the
        sender marked its slot busy, a spurious ProtocolViolation)."""
        return count_slots(self.doorbell, self._channels, self._inbox)

    def reconnect(self, peers: dict[str, str] | None = None) -> "Endpoint":
        """Drop every channel and handshake again (same listener, same name): after a peer
        failed (`PeerClosed`, `PeerTimeout`) or a link came back. Messages not yet received
        are lost; both ends must reconnect, as both connected."""
        self._drop_channels()
        self.backends.renew()
        return self.connect(peers)

    def _drop_channels(self) -> None:
        self._inbox.clear()
        self._wakeups.reset()
        self._channels.close()
        self._round_table.clear()

    def sever(self) -> None:
        """Shut every peer connection down as a failing network would (fault injection): both
        ends see their connections drop (PeerClosed) and must reconnect; this endpoint's
        objects stay for its owner to notice and replace."""
        self._channels.sever()

    def close(self) -> None:
        self._drop_channels()
        self.backends.close()
        self.listener.close()

    def __enter__(self) -> "Endpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def connect_concurrently(wiring: list[tuple[Endpoint, dict[str, str]]], timeout_s: float) -> None:
    """Connect each endpoint to its peers (name -> address), all at once on threads of their
    own, as separate processes would (each `connect` waits for its peers to connect back);
    raises the first error once every thread has ended or `timeout_s` passed."""
    errors: list[BaseException] = []

    def run(endpoint: Endpoint, peers: dict[str, str]) -> None:
        try:
            endpoint.connect(peers)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=pair) for pair in wiring]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    if errors:
        raise errors[0]
