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

import logging
import os
import select
import selectors
import socket
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from transport import core
from transport.backends import BackendSet, host_id
from transport.errors import PayloadTooLarge, PeerClosed, PeerTimeout, ProtocolViolation, RoundFailed, TransportError
from transport.rounds import Arrivals, CoreRound, MessageRound, byte_address, row_ranges
from transport.peering import Acceptor, dial, parse_address
from transport.selection import BACKENDS, Choice
from transport.tcp import TcpInbound, TcpOutbound
from transport.wire import MAX_SLOTS, SEQ_MASK, Header, check_header_fields

__all__ = ["Endpoint", "EndpointSpec", "Message", "SlotUsage", "connect_concurrently", "host_id", "parse_address"]

logger = logging.getLogger(__name__)

# Longest single sleep: a safety net should a wakeup ever be lost (see transport/shm.py).
MAX_SLEEP_S = 0.05
# Peers that signal nothing a selector sees (rdma completions, nixl notifications) are polled,
# napping POLLED_NAP_S between looks. rdma spins at least POLLED_SPIN_S first: its queues
# progress only while polled. NIXL has a progress thread of its own (transport/nixl.py).
POLLED_SPIN_S = 0.002
POLLED_NAP_S = 0.0002


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
    core: str = "auto"  # shm channels and rounds in the compiled core: "auto" | "on" | "off" (transport/core.py)

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


@dataclass(frozen=True)
class SlotUsage:
    """An endpoint's slots in use, for leak checks: all zero on an idle endpoint."""

    held: int  # messages recv() handed out that the caller has not released yet
    unreleased: int  # messages this endpoint sent whose slot the receiving peer has not released yet
    queued: int = 0  # messages that arrived but recv() has not handed out yet


class Message:
    """A received message: its header and a zero-copy view of the payload in the slot.
    The view is valid until `release()`; after that the sender may overwrite the slot."""

    __slots__ = ("peer", "header", "data", "_channel", "_slot", "_released")

    def __init__(self, peer: str, header: Header, data: memoryview, channel, slot: int) -> None:
        self.peer = peer
        self.header = header
        self.data = data
        self._channel = channel
        self._slot = slot
        self._released = False

    def tensor(self, dtype=None, shape=None):
        """The payload as a torch tensor sharing the slot's memory (no copy)."""
        import torch

        dtype = dtype or torch.uint8
        if not len(self.data):
            t = torch.empty(0, dtype=dtype)
        else:
            t = torch.frombuffer(self.data, dtype=dtype)
        return t.view(shape) if shape is not None else t

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._channel.release(self._slot)

    def __enter__(self) -> "Message":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def as_bytes(payload) -> memoryview:
    """bytes-like, numpy array or CPU torch tensor -> a flat byte view (no copy)."""
    if isinstance(payload, (bytes, bytearray)):
        return memoryview(payload)
    if hasattr(payload, "is_cuda"):  # a torch tensor
        if payload.is_cuda:
            raise TypeError("CUDA tensors are staged through pinned host memory by the caller (megainfer's "
                            "disagg/device_staging.py), or registered for RDMA (transport/rdma.py)")
        if not payload.is_contiguous():
            raise ValueError("tensor payloads must be contiguous (call .contiguous())")
        payload = payload.detach().view(-1).view(dtype=__import__("torch").uint8).numpy()
    view = memoryview(payload)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


class Endpoint:
    def __init__(self, spec: EndpointSpec) -> None:
        self.spec = spec
        host, port = parse_address(spec.listen)
        self.listener = socket.create_server((host, port), reuse_port=False, backlog=128)
        self.outbound: dict[str, object] = {}
        self.inbound: dict[str, object] = {}
        self._pending: list[Message] = []
        self._seq: dict[str, int] = {}
        self._dead: dict[str, str] = {}  # peer -> why it is gone (the first reason)
        self._violators: set[str] = set()  # peers dropped for breaking the protocol: never read again
        self._max_sleep: float | None = None  # the longest nap while waiting (set by connect for polled peers)
        self._spin_s = spec.spin_us * 1e-6  # busy-poll this long before sleeping (longer for rdma peers)
        self._selector = selectors.DefaultSelector()
        self.choices: dict[str, Choice] = {}  # peer -> the backend its pair uses and why
        self._rounds: dict[tuple[str, ...], CoreRound | MessageRound] = {}  # peers -> how their rounds run
        try:  # a requested backend that cannot work (rdma past the locked-memory limit) fails here
            self.uses_core = core.resolve(spec.core, spec.name)
            self.backends = BackendSet(spec.name, spec.backend, spec.slot_bytes, spec.num_slots,
                                       spec.tcp_buffer_bytes, spec.expected_peers or len(spec.peers),
                                       spec.peer_slot_bytes, spec.rdma_devices, rank=spec.rank,
                                       core=self.uses_core)
        except BaseException:
            self.listener.close()
            raise
        self.doorbell = self.backends.doorbell

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
        peers = self.spec.peers
        spec = self.spec
        if spec.name in peers:
            raise ValueError(f"endpoint {spec.name!r} lists itself among its peers")
        self.backends.expect_peers(len(peers))  # rdma's locked memory, before any channel exists
        deadline = time.monotonic() + spec.timeout_s
        acceptor = Acceptor(spec.name, spec.backend, bytes(spec.secret), self.backends, self.listener, set(peers),
                            deadline, spec.slot_bytes, spec.num_slots)
        accepting = threading.Thread(target=acceptor.run, name=f"m2n-accept-{spec.name}", daemon=True)
        accepting.start()
        try:
            for peer, address in peers.items():
                channel, self.choices[peer] = dial(spec.name, spec.rank, spec.backend, bytes(spec.secret),
                                                   self.backends, peer, address, len(self.outbound), deadline,
                                                   spec.timeout_s)
                self.outbound[peer] = channel
                self._seq[peer] = 0
                logger.info("endpoint %s -> %s over %s (%s)", spec.name, peer, channel.kind, self.choices[peer].reason)
        finally:
            accepting.join(max(0.0, deadline - time.monotonic()) + 1.0)
        if acceptor.errors:
            raise acceptor.errors[0]
        missing = sorted(set(peers) - set(acceptor.accepted))
        if missing:
            raise PeerTimeout(f"endpoint {spec.name}: peers {', '.join(missing)} did not connect within "
                              f"{spec.timeout_s:g} s (not started, wrong address, or a different secret)")
        self.inbound.update(acceptor.accepted)
        self._register()
        # RDMA completions and NIXL notifications do not wake a selector: with such peers, wake
        # often and poll them (rdma after a longer spin).
        kinds = {ch.kind for ch in list(self.inbound.values()) + list(self.outbound.values())}
        self._max_sleep = POLLED_NAP_S if kinds & {"rdma", "nixl"} else None
        self._spin_s = spec.spin_us * 1e-6
        if "rdma" in kinds:
            self._spin_s = max(self._spin_s, POLLED_SPIN_S)
        return self

    def _register(self) -> None:
        if self.doorbell is not None:
            self._selector.register(self.doorbell.sock, selectors.EVENT_READ, ("doorbell", None))
        for direction, channels in (("in", self.inbound), ("out", self.outbound)):
            for peer, ch in channels.items():
                try:
                    self._selector.register(ch.control, selectors.EVENT_READ, (direction, peer))
                except KeyError:  # the same socket serves both directions: already watched
                    pass

    # -- data --------------------------------------------------------------------------------
    def send(self, peer: str, payload=b"", *, step: int = 0, layer: int = 0, micro_batch: int = 0,
             token_count: int = 0, flags: int = 0, timeout: float | None = None) -> None:
        """Write one message into `peer`'s slot for `micro_batch`; waits while the peer still
        holds that slot. An empty payload is a valid message (a header alone)."""
        channel = self.outbound.get(peer)
        if channel is None:
            raise TransportError(f"endpoint {self.spec.name} has no peer {peer!r}; peers: {', '.join(self.outbound)}")
        if self._dead and peer in self._dead:
            self._check_alive((peer,))
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
                self._send_when_free(channel, header, data, limit)
            if getattr(channel, "unsent", 0):
                self._finish_send(channel, limit)
        except ProtocolViolation as exc:  # a malformed credit from the peer
            self._drop(peer, exc)
            raise
        self._seq[peer] = (seq + 1) & SEQ_MASK

    def _finish_send(self, channel, limit: float) -> None:
        """The rest of a message: for tcp, what the kernel could not take at once, written as
        the socket drains, while every inbound tcp connection is read into its slots, so a
        peer that is sending to this endpoint at the same time is never left waiting for a
        reader (full duplex: two senders never block each other). Returns once the message is
        all out, so the caller may reuse its buffer. (nixl never comes here: its send returns
        once the write is posted, transport/nixl.py.)"""
        peer = channel.peer
        deadline = time.monotonic() + limit
        readers = {ch.sock: name for name, ch in self.inbound.items()
                   if isinstance(ch, TcpInbound) and name not in self._dead}  # a dead one's socket is at its end
        writing = [channel.sock] if channel.kind == "tcp" else []
        # A NIXL write completes without this thread (UCX's progress thread moves the bytes):
        # poll it briefly, then sleep in small steps.
        step = MAX_SLEEP_S if writing else 0.0
        spin_until = time.monotonic() + self._spin_s
        while not channel.flush():
            self._check_alive((peer,))
            now = time.monotonic()
            if now >= deadline:
                what = f"read {channel.unsent} bytes of" if writing else "completed the write of"
                raise PeerTimeout(f"endpoint {self.spec.name}: peer {peer} has not {what} a message within "
                                  f"{limit:g} s (it stopped reading, or its host is unreachable)")
            if not writing:
                step = 0.0 if now < spin_until else POLLED_NAP_S
            readable, _, _ = select.select(list(readers), writing, [], step)
            for sock in readable:
                self._collect(readers[sock])

    def _send_when_free(self, channel, header: Header, data: memoryview, limit: float) -> None:
        """The slow path of send: the peer still holds the slot. Spin, then sleep, until it frees."""
        peer = channel.peer
        deadline = time.monotonic() + limit
        spin_until = time.monotonic() + self._spin_s
        while True:
            self._check_alive((peer,))
            now = time.monotonic()
            if now >= deadline:
                raise PeerTimeout(f"endpoint {self.spec.name}: peer {peer} has not released its slot for micro-batch "
                                  f"{header.micro_batch} within {limit:g} s (it stopped consuming, or died)")
            if now < spin_until:
                os.sched_yield()
            sent = channel.try_send(header, data) if now < spin_until else \
                self._block(deadline, lambda: channel.try_send(header, data), asleep=[channel])
            if sent:
                return

    def recv(self, peer: str | None = None, *, micro_batch: int | None = None,
             timeout: float | None = None) -> Message:
        """The next message (from `peer`, for `micro_batch`, when given), as a view on its slot."""
        msg = self._poll_once(peer, micro_batch)
        if msg is not None:
            return msg
        if peer is not None and peer not in self.inbound:
            raise TransportError(f"endpoint {self.spec.name} has no peer {peer!r}; peers: {', '.join(self.inbound)}")
        limit = self.spec.timeout_s if timeout is None else timeout
        deadline = time.monotonic() + limit
        spin_until = time.monotonic() + self._spin_s
        peers = (peer,) if peer is not None else tuple(self.inbound)
        spins = 0
        while True:
            msg = self._poll_once(peer, micro_batch)
            if msg is not None:
                return msg
            spins += 1
            if spins & 15:  # a tight spin: the clock and liveness every 16 looks
                continue
            os.sched_yield()  # let a peer sharing this core run (oversubscribed hosts)
            self._check_alive(peers)
            now = time.monotonic()
            if now >= deadline:
                what = f"from {peer}" if peer else f"from any of {', '.join(peers)}"
                mb = f" for micro-batch {micro_batch}" if micro_batch is not None else ""
                raise PeerTimeout(f"endpoint {self.spec.name}: no message {what}{mb} within {limit:g} s")
            if now >= spin_until:
                def arrived() -> bool:
                    for p in peers:
                        self._collect(p)
                    return any((peer is None or m.peer == peer) and (micro_batch is None or m.header.micro_batch ==
                                                                     micro_batch) for m in self._pending)
                self._block(deadline, arrived, asleep=[self.inbound[p] for p in peers])

    def poll(self, peer: str, *, micro_batch: int | None = None) -> Message | None:
        """The message `recv` would return if it has arrived, else None at once (with `send`,
        `recv` and `register`, an Endpoint is a node's ExpertLink where nothing re-wires it)."""
        if peer not in self.inbound:
            raise TransportError(f"endpoint {self.spec.name} has no peer {peer!r}; peers: {', '.join(self.inbound)}")
        msg = self._poll_once(peer, micro_batch)
        if msg is None:
            self._check_alive((peer,))
        return msg

    # -- rounds ------------------------------------------------------------------------------
    def post_round(self, peers: tuple[str, ...], buffer, begins, ends, token_counts, *, step: int = 0,
                   layer: int = 0, micro_batch: int = 0, flags: int = 0, timeout: float | None = None) -> None:
        """One message to each of `peers`: peers[i] gets bytes [begins[i], ends[i]) of `buffer`
        (a contiguous CPU tensor or numpy array) with header token count token_counts[i]. Returns
        once every message is written (the buffer may then be reused). Peers whose slot is still
        held are waited for, each within the timeout; a peer that fails (gone, or holding its
        slot past the timeout) does not stop the others: RoundFailed names every one that did."""
        round_ = self._core_round_to_post(peers)
        check_header_fields(step, layer, micro_batch, self.spec.rank, 0)
        limit = self.spec.timeout_s if timeout is None else timeout
        if round_ is None:
            return self._post_each(peers, buffer, begins, ends, token_counts, step, layer, micro_batch, flags, limit)
        address, nbytes = byte_address(buffer)
        # the arrays are converted to int64 by the core's binding where they are not already
        self._post_core(round_, micro_batch, limit, round_.native.post, step, layer, micro_batch, flags & 0xFFFF,
                        address, nbytes, begins, ends, token_counts)

    def post_rows(self, peers: tuple[str, ...], buffer, token_counts, row_bytes: int, *, step: int = 0,
                  layer: int = 0, micro_batch: int = 0, flags: int = 0, timeout: float | None = None) -> None:
        """`post_round` where peers[i]'s bytes are token_counts[i] rows of `row_bytes`, the peers'
        rows end to end from the buffer's start (an expert node's answers, a dispatch's records
        in node order)."""
        round_ = self._core_round_to_post(peers)
        if round_ is None:
            begins, ends = row_ranges(token_counts, row_bytes)
            return self.post_round(peers, buffer, begins, ends, token_counts, step=step, layer=layer,
                                   micro_batch=micro_batch, flags=flags, timeout=timeout)
        check_header_fields(step, layer, micro_batch, self.spec.rank, 0)
        address, nbytes = byte_address(buffer)
        self._post_core(round_, micro_batch, self.spec.timeout_s if timeout is None else timeout,
                        round_.native.post_rows, step, layer, micro_batch, flags & 0xFFFF, address, nbytes,
                        token_counts, row_bytes)

    def _core_round_to_post(self, peers) -> CoreRound | None:
        """The core's round to these peers, or None where the post goes per message: channels the
        core does not drive, or a peer known dead (it fails alone and the others are posted, as
        send() does)."""
        round_ = self._rounds.get(peers) or self._round(peers)
        if isinstance(round_, MessageRound) or self._dead and not self._dead.keys().isdisjoint(peers):
            return None
        return round_

    def _post_core(self, round_: CoreRound, micro_batch: int, limit: float, post, *args) -> None:
        """One call into the core posts the round (`post(*args)`); peers whose slot is still held
        are then waited for."""
        try:
            pending = post(*args)
        except (IndexError, ValueError) as exc:  # a range outside the buffer, or past a peer's slot
            raise PayloadTooLarge(f"endpoint {self.spec.name}: {exc}") from None
        if pending:
            self._post_pending(round_, micro_batch, limit)

    def _post_each(self, peers, buffer, begins, ends, counts, step, layer, micro_batch, flags, limit) -> None:
        view = as_bytes(buffer)
        failures: dict[str, TransportError] = {}
        for i, peer in enumerate(peers):
            try:
                self.send(peer, view[begins[i]:ends[i]], step=step, layer=layer, micro_batch=micro_batch,
                          token_count=int(counts[i]), flags=flags, timeout=limit)
            except (PeerClosed, PeerTimeout) as exc:
                failures[peer] = exc
        if failures:
            raise self._round_failed("post", micro_batch, failures)

    def _post_pending(self, round_: CoreRound, micro_batch: int, limit: float) -> None:
        """Peers that still held their slot at the post: spin, then sleep, until each frees it,
        dies, or the timeout passes."""
        deadline = time.monotonic() + limit
        spin_until = time.monotonic() + self._spin_s
        failures: dict[str, TransportError] = {}
        pending = round_.pending
        while True:
            for i in np.flatnonzero(pending):
                peer = round_.peers[i]
                if peer in self._dead:
                    failures[peer] = self._dead_error(peer)
                    pending[i] = 0
            if not pending.any():
                break
            now = time.monotonic()
            if now >= deadline:
                for i in np.flatnonzero(pending):
                    failures[round_.peers[i]] = PeerTimeout(
                        f"endpoint {self.spec.name}: peer {round_.peers[i]} has not released its slot for micro-batch "
                        f"{micro_batch} within {limit:g} s (it stopped consuming, or died)")
                pending[:] = 0
                break
            if now < spin_until:
                os.sched_yield()
                round_.native.retry()
            else:
                waiting = [round_.outbound[i] for i in np.flatnonzero(pending)]
                self._block(deadline, lambda: round_.native.retry() == 0, asleep=waiting)
        if failures:
            raise self._round_failed("post", micro_batch, failures)

    def collect_round(self, peers: tuple[str, ...], *, micro_batch: int, timeout: float | None = None) -> Arrivals:
        """A message for `micro_batch` from each of `peers`, as views on their slots until the
        returned Arrivals is released. A peer that fails (gone, or broke the protocol) does not
        stop the others from arriving; once each has arrived or failed, the round's messages
        are released and RoundFailed names every peer that failed. Where peers are only slow,
        PeerTimeout after `timeout` loses nothing: what arrived stays taken for the next call."""
        arrivals = self._collect_round(peers, micro_batch, self.spec.timeout_s if timeout is None else timeout)
        assert arrivals is not None
        return arrivals

    def poll_round(self, peers: tuple[str, ...], *, micro_batch: int) -> Arrivals | None:
        """The round `collect_round` would return if all of it has arrived, else None at once
        (what arrived so far stays taken, for the next call)."""
        return self._collect_round(peers, micro_batch, None)

    def _collect_round(self, peers, micro_batch: int, limit: float | None) -> Arrivals | None:
        round_ = self._rounds.get(peers) or self._round(peers)
        if round_.handed_out:
            raise TransportError(f"endpoint {self.spec.name}: the last round from {', '.join(round_.peers)} was not "
                                 "released (Arrivals.release) before the next was collected")
        if round_.partial is not None and round_.partial != micro_batch:
            raise TransportError(f"endpoint {self.spec.name}: micro-batch {round_.partial}'s round from "
                                 f"{', '.join(round_.peers)} is partly collected; collect it before micro-batch "
                                 f"{micro_batch}'s")
        if isinstance(round_, CoreRound):
            if self._pending_from(peers):
                raise TransportError(f"endpoint {self.spec.name}: messages from {', '.join(round_.peers)} were taken "
                                     "by recv()/poll() and not handed out yet; a round cannot collect them (take "
                                     "them with recv() first, or use rounds alone)")
            round_.partial = micro_batch  # until it completes or fails
            arrivals = self._collect_core(round_, micro_batch, limit)
        else:
            round_.partial = micro_batch
            arrivals = self._collect_each(round_, micro_batch, limit)
        if arrivals is not None:
            round_.partial = None
            round_.handed_out = True
        return arrivals

    def _pending_from(self, peers) -> bool:
        """Messages of these peers taken by recv/poll and not handed out yet."""
        return bool(self._pending) and any(m.peer in peers for m in self._pending)

    def _collect_core(self, round_: CoreRound, micro_batch: int, limit: float | None) -> Arrivals | None:
        native = round_.native
        deadline = None if limit is None else time.monotonic() + limit
        spin, slice_s = (0.0, 0.0) if limit is None else (self._spin_s, min(limit, MAX_SLEEP_S))
        while True:
            try:
                missing = native.collect(micro_batch, spin, slice_s)
            except RuntimeError as exc:  # the endpoint was closed (from another thread) during the round
                round_.partial = None
                raise PeerClosed(f"endpoint {self.spec.name}: {exc}") from None
            if native.failed_count or missing:
                missing = self._note_failures(round_)
            if not missing:
                if native.failed_count:
                    failures = {peer: self._dead_error(peer) for i, peer in enumerate(round_.peers)
                                if not round_.arrived[i]}
                    round_.release()
                    native.clear_failures()
                    round_.partial = None
                    raise self._round_failed("collect", micro_batch, failures)
                return Arrivals(round_.peers, round_.fields, round_)
            if deadline is None:  # a poll: what arrived stays taken
                return None
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                waiting = [peer for i, peer in enumerate(round_.peers)
                           if not round_.arrived[i] and peer not in self._dead]
                raise PeerTimeout(f"endpoint {self.spec.name}: no message for micro-batch {micro_batch} from "
                                  f"{', '.join(waiting)} within {limit:g} s")
            spin, slice_s = 0.0, min(remaining, MAX_SLEEP_S)

    def _note_failures(self, round_: CoreRound) -> int:
        """Peers of the round that broke the protocol are dropped, peers found gone (a selector
        look) given up: the round waits for neither. Returns how many it still awaits."""
        native = round_.native
        for i in np.flatnonzero(round_.broken):
            peer = round_.peers[i]
            if peer not in self._violators:
                self._drop(peer, core.violation_error(round_.inbound[i]))
        self._watch_controls()
        awaited = 0
        for i, peer in enumerate(round_.peers):
            if round_.arrived[i] or round_.broken[i]:
                continue
            if peer in self._dead:
                native.give_up(i)
            else:
                awaited += 1
        return awaited

    def _collect_each(self, round_: MessageRound, micro_batch: int, limit: float | None) -> Arrivals | None:
        taken = round_.messages or [None] * len(round_.peers)  # a poll may have found part of the round
        round_.messages = taken
        deadline = None if limit is None else time.monotonic() + limit
        failures: dict[str, TransportError] = {}
        slow: list[str] = []
        for i, peer in enumerate(round_.peers):
            if taken[i] is not None:
                continue
            try:
                taken[i] = (self.poll(peer, micro_batch=micro_batch) if deadline is None else
                            self.recv(peer, micro_batch=micro_batch, timeout=max(0.0, deadline - time.monotonic())))
            except PeerTimeout:
                slow.append(peer)
            except PeerClosed as exc:
                failures[peer] = exc
        if failures and all(msg is not None or peer in failures for peer, msg in zip(round_.peers, taken)):
            round_.release()  # every peer has arrived or failed: the round fails as a whole
            round_.partial = None
            raise self._round_failed("collect", micro_batch, failures)
        if slow:
            raise PeerTimeout(f"endpoint {self.spec.name}: no message for micro-batch {micro_batch} from "
                              f"{', '.join(slow)} within {limit:g} s")
        if any(msg is None for msg in taken):
            return None  # a poll: the rest is awaited by the next call (a failed peer is reported then)
        round_.take(taken)
        return Arrivals(round_.peers, round_.fields, round_)

    def _round(self, peers) -> CoreRound | MessageRound:
        """How rounds with `peers` run: in the core where it drives every channel involved."""
        peers = tuple(peers)
        round_ = self._rounds.get(peers)
        if round_ is not None:
            return round_
        unknown = [p for p in peers if p not in self.outbound or p not in self.inbound]
        if unknown or not peers:
            raise TransportError(f"endpoint {self.spec.name} has no peer {', '.join(map(repr, unknown)) or '(none)'}; "
                                 f"peers: {', '.join(self.outbound)}")
        channels = [self.outbound[p] for p in peers] + [self.inbound[p] for p in peers]
        if all(getattr(ch, "core_driven", False) for ch in channels):
            round_ = CoreRound(peers, [self.outbound[p] for p in peers], [self.inbound[p] for p in peers],
                               self.doorbell.sock.fileno())
        else:
            round_ = MessageRound(peers)
        self._rounds[peers] = round_
        return round_

    def _dead_error(self, peer: str) -> PeerClosed:
        error = ProtocolViolation if peer in self._violators else PeerClosed
        return error(f"endpoint {self.spec.name}: {self._dead[peer]}")

    def _round_failed(self, what: str, micro_batch: int, failures: dict[str, TransportError]) -> RoundFailed:
        detail = "; ".join(f"{peer}: {exc}" for peer, exc in failures.items())
        return RoundFailed(f"endpoint {self.spec.name}: the {what} of micro-batch {micro_batch}'s round failed for "
                           f"{len(failures)} peer(s): {detail}", failures)

    def _watch_controls(self) -> None:
        """Notices peers whose connection dropped, without waiting (a selector look)."""
        self._handle(self._selector.select(timeout=0))

    def _poll_once(self, peer: str | None, micro_batch: int | None) -> Message | None:
        """One look for a matching message: already collected ones first, then the channels."""
        if self._pending:
            msg = self._take(peer, micro_batch)
            if msg is not None:
                return msg
        for name in ((peer,) if peer is not None else self.inbound):
            if name not in self.inbound:
                return None
            self._collect(name)
        return self._take(peer, micro_batch) if self._pending else None

    def _collect(self, peer: str) -> None:
        if peer in self._violators:
            return
        channel = self.inbound[peer]
        try:
            done = channel.poll()
        except PeerClosed as exc:
            self._drop(peer, exc, channel.control if channel.kind == "tcp" else None)
            return
        for slot, header in done:
            self._pending.append(Message(peer, header, channel.payload(slot, header.byte_length), channel, slot))

    def _take(self, peer: str | None, micro_batch: int | None) -> Message | None:
        pending = self._pending
        if peer is None and micro_batch is None:
            return pending.pop(0)
        for i, msg in enumerate(pending):
            if (peer is None or msg.peer == peer) and (micro_batch is None or msg.header.micro_batch == micro_batch):
                return pending.pop(i)
        return None

    def _drop(self, peer: str, exc: PeerClosed, quiet_socket: socket.socket | None = None) -> None:
        """`peer` is gone: waits on it raise PeerClosed with the first reason recorded. A peer
        that broke the protocol also has its connections shut (it sees them drop) and is never
        read again; every other peer's channels, slots and pending messages stay as they are.
        `quiet_socket`, a connection at its end, stops waking the selector."""
        if quiet_socket is not None:
            self._unwatch(quiet_socket)
        if peer not in self._dead:
            self._dead[peer] = str(exc)
        if isinstance(exc, ProtocolViolation) and peer not in self._violators:
            logger.warning("endpoint %s: %s", self.spec.name, exc)
            self._violators.add(peer)
            for channel in (self.inbound.get(peer), self.outbound.get(peer)):
                if channel is not None and channel.control is not None:
                    self._unwatch(channel.control)
                    try:
                        channel.control.shutdown(socket.SHUT_RDWR)
                    except OSError:  # already gone
                        pass

    def _unwatch(self, sock: socket.socket) -> None:
        try:
            self._selector.unregister(sock)
        except (KeyError, ValueError):  # not watched (any more), or closed
            pass

    def slots_in_use(self) -> SlotUsage:
        """The slots in use now, for leak checks: credits and doorbells that have arrived are
        taken first (without waiting), so an idle endpoint whose peers released everything
        reads all zero. A peer found gone on the way keeps the slots it never released.
        Taking credits is a poll: call it on the thread that sends and receives, never beside
        it (a second poller can split a tcp credit frame or take an RDMA credit before the
        sender marked its slot busy, a spurious ProtocolViolation)."""
        if self.doorbell is not None:
            self.doorbell.drain()
        unreleased = 0
        for peer, channel in self.outbound.items():
            try:
                unreleased += channel.unreleased()
            except PeerClosed as exc:
                self._drop(peer, exc)
                unreleased += sum(channel.busy)  # shm never raises here: the others keep `busy`
        queued = len(self._pending)
        held = sum(channel.outstanding for channel in self.inbound.values()) - queued
        queued += sum(getattr(channel, "queued", 0) for channel in self.inbound.values())  # the core's
        return SlotUsage(held=held, unreleased=unreleased, queued=queued)

    def _check_alive(self, peers) -> None:
        """A wait on one peer fails as soon as it is dead; a wait on any of several, once all are."""
        dead = [p for p in peers if p in self._dead]
        if dead and (len(peers) == 1 or len(dead) == len(peers)):
            error = ProtocolViolation if self._violators.issuperset(dead) else PeerClosed
            raise error(f"endpoint {self.spec.name}: " + "; ".join(self._dead[p] for p in dead))

    def _block(self, deadline: float, ready, asleep) -> bool:
        """Sleep until a wakeup (doorbell, socket data, a peer's connection dropping) or the
        deadline; returns ready()'s True if the awaited thing happened before sleeping.

        Shared-memory peers ring only a side that says it is asleep: set the asleep words of
        `asleep`'s shm channels, re-check `ready()` (a message or slot may have landed just
        before), and only then sleep."""
        sleepers = [ch for ch in asleep if ch.kind == "shm"]
        for ch in sleepers:
            ch.set_asleep(True)
        try:
            if ready():
                return True
            self._wait(deadline)
            return False
        finally:
            for ch in sleepers:
                ch.set_asleep(False)

    def _wait(self, deadline: float) -> None:
        timeout = max(0.0, deadline - time.monotonic())
        if self._max_sleep is not None:
            # Polled peers (rdma, nixl): epoll counts whole milliseconds, so a 200 us nap there is
            # 1 ms; look at the sockets without waiting, then nap with nanosleep.
            events = self._selector.select(timeout=0)
            if not events:
                time.sleep(min(timeout, self._max_sleep))
        else:
            events = self._selector.select(timeout=min(timeout, MAX_SLEEP_S))
        self._handle(events)

    def _handle(self, events) -> None:
        """What a selector look found: doorbells drained, tcp data and credits read, dropped
        control connections recorded as dead peers."""
        for key, _ in events:
            kind, peer = key.data
            if kind == "doorbell":
                self.doorbell.drain()
            elif kind == "in" and isinstance(self.inbound[peer], TcpInbound):
                self._collect(peer)  # keep the socket drained even while a send is waiting
            elif kind == "out" and isinstance(self.outbound.get(peer), TcpOutbound):
                try:
                    self.outbound[peer].drain_credits()
                except PeerClosed as exc:
                    self._drop(peer, exc, key.fileobj)
            else:  # a control connection (shm, rdma) says something only when it closes
                try:
                    alive = key.fileobj.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b""
                except BlockingIOError:
                    alive = True
                except OSError:
                    alive = False
                if not alive:
                    self._drop(peer, PeerClosed(f"peer {peer} closed its connection (process exited or shut down)"),
                               key.fileobj)

    def register(self, buffer) -> None:
        """Declare a host buffer (a contiguous CPU torch tensor) that payloads will be sent
        from, for the life of this endpoint. Backends that write from registered memory
        (nixl) then send a payload lying in it without copying it to staging first, after
        `send` returned: its bytes must stay as they are until the receiver has the message
        (its answer came back, or its slot was released). A hint: payloads anywhere else
        still work, through staging."""
        self.backends.register(buffer)

    def reconnect(self, peers: dict[str, str] | None = None) -> "Endpoint":
        """Drop every channel and handshake again (same listener, same name): after a peer
        failed (`PeerClosed`, `PeerTimeout`) or a link came back. Messages not yet received
        are lost; both ends must reconnect, as both connected."""
        self._drop_channels()
        self.backends.renew()
        return self.connect(peers)

    def _drop_channels(self) -> None:
        self._pending.clear()
        self._selector.close()
        self._selector = selectors.DefaultSelector()
        for ch in list(self.outbound.values()) + list(self.inbound.values()):
            ch.close()
            if getattr(ch, "control", None) is not None and ch.kind != "tcp":
                ch.control.close()
        self._rounds.clear()
        self.outbound.clear()
        self.inbound.clear()
        self._seq.clear()
        self._dead.clear()
        self._violators.clear()
        self.choices.clear()

    def sever(self) -> None:
        """Shut every peer connection down as a failing network would (fault injection): both
        ends see their connections drop (PeerClosed) and must reconnect; this endpoint's
        objects stay for its owner to notice and replace."""
        for ch in list(self.outbound.values()) + list(self.inbound.values()):
            for sock in {getattr(ch, "sock", None), getattr(ch, "control", None)} - {None}:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:  # already closed
                    pass

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
