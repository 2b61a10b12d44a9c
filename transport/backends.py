"""An endpoint's backends: what it can offer a peer, the resources each backend needs, and
the channels of a peer pair once its backend is chosen (transport/selection.py chooses).

Resources are made when first needed: the doorbell at once where shm is possible, the RDMA
context when a pair chooses rdma (on the device the probe chose), the NIXL agent when a pair
chooses nixl (with every send buffer declared so far registered on it). The acceptor serves
each connection on a thread of its own, so the agent is made under a lock: one agent per
endpoint, whatever number of peers connect at once.

RDMA is offered only where the probe passed for the regions wiring will register (`rdma.Wiring`:
the peers expected, this endpoint's slots and the peers'); connecting more peers than that
checks the locked-memory limit again first. Where it falls short, `auto` drops rdma with the
reason (logged once here, and in every pair's choice) and a requested `rdma` fails before any
queue pair exists.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import socket
import threading

from transport import nixl, rdma, rdma_host
from transport.core import CoreShmInbound, CoreShmOutbound, native
from transport.core_rdma import CoreRdmaInbound, CoreRdmaOutbound, CoreVerbs
from transport.core_tcp import CoreTcpInbound, CoreTcpOutbound
from transport.errors import BackendUnavailable, HandshakeError
from transport.nixl import NixlAgent, NixlInbound, NixlOutbound
from transport.selection import Capabilities
from transport.shm import Doorbell, ShmInbound, ShmOutbound, shm_available
from transport.tcp import TcpInbound, TcpOutbound, tune
from transport.wire import Hello, RegionGrant, ack_sizes, send_json

logger = logging.getLogger(__name__)


def host_id() -> str:
    """Names this machine and network namespace: two endpoints with equal ids can use shm.
    The namespace counts because the doorbells are abstract UNIX sockets, which are private
    to a network namespace (two containers on one host without a shared network namespace
    are two hosts to M2N)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    try:
        netns = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        netns = 0
    return f"{socket.gethostname()}/{boot}/{netns}"


def capabilities_of(wanted: str, wiring: rdma.Wiring | None = None,
                    rdma_devices: tuple[str, ...] = ()) -> tuple[Capabilities, rdma.ProbeResult | None]:
    """What an endpoint asking for backend `wanted` can offer a peer, and the rdma probe's
    result (None where rdma was not probed); rdma and nixl are probed only when they may be used."""
    shm_ok, shm_reason = shm_available()
    probe = None
    if wanted in ("auto", "rdma"):  # an ACTIVE port that passes a loopback write, not just a device
        probe = rdma.probe(wiring=wiring, allowed=rdma_devices)
        rdma_ok, rdma_reason = probe.ok, probe.reason
    else:
        rdma_ok, rdma_reason = False, f"{wanted} was requested"
    nixl_ok, nixl_reason = nixl.available() if wanted in ("auto", "nixl") else (False, f"{wanted} was requested")
    return Capabilities(host_id(), shm_ok, rdma_ok, nixl_ok, shm_reason, rdma_reason, nixl_reason), probe


class BackendSet:
    def __init__(self, name: str, wanted: str, slot_bytes: int, num_slots: int, tcp_buffer_bytes: int | None,
                 peers: int = 0, peer_slot_bytes: int | None = None, rdma_devices: tuple[str, ...] = (), *,
                 rank: int = 0, core: bool = False, core_demanded: bool = False, timeout_s: float = 30.0) -> None:
        """`peers`: how many peers wiring will connect (0: not known yet; `expect_peers` then
        checks at connect); `peer_slot_bytes`: their receive slots (None: the same as ours);
        `rank`: the sender rank headers carry; `core`: shm, tcp and rdma channels driven by the
        compiled core (transport/core.py, core_tcp.py, core_rdma.py); `core_demanded`: asked for
        outright (a kind the core cannot drive then fails instead of running on the reference);
        `timeout_s`: the endpoint's, how long a core tcp channel's close waits for its queued
        bytes to leave."""
        self.rank, self.core, self.timeout_s = rank, core, timeout_s
        self.name, self.wanted, self.slot_bytes, self.num_slots, self.tcp_buffer_bytes = \
            name, wanted, slot_bytes, num_slots, tcp_buffer_bytes
        self.peer_slot_bytes = slot_bytes if peer_slot_bytes is None else peer_slot_bytes
        self.rdma_devices = tuple(rdma_devices)
        self._rdma_checked_peers = peers  # the rdma probe's locked-memory check covered this many
        self.capabilities, self.rdma_probe = capabilities_of(wanted, self.wiring(peers) if peers else None,
                                                             self.rdma_devices)
        if wanted not in ("auto", "tcp") and not getattr(self.capabilities, wanted):
            raise BackendUnavailable(f"backend {wanted!r} requested but unavailable: "
                                     f"{getattr(self.capabilities, wanted + '_reason')}")
        self._log_rdma()
        self.doorbell = Doorbell() if self.capabilities.shm else None
        self.rdma = RdmaResources(name, core, core_demanded)  # opened when a peer pair chooses rdma
        self._nixl: NixlAgent | None = None  # made when a peer pair chooses nixl
        self._nixl_lock = threading.Lock()  # handshake threads ask for the agent at once
        self._sources: list = []  # send buffers declared with register()
        self._inbound_ids = itertools.count()
        self._progress = None  # native.TcpProgress, made with the first core tcp channel
        self._tcp_lock = threading.Lock()

    def wiring(self, peers: int) -> rdma.Wiring:
        """What rdma channels to `peers` peers would register."""
        return rdma.Wiring(peers, self.slot_bytes, self.peer_slot_bytes, self.num_slots)

    def expect_peers(self, count: int) -> None:
        """Before wiring `count` peers: where that is more than the probe checked and rdma's
        regions would pass RLIMIT_MEMLOCK, `auto` stops offering rdma (saying why) and a
        requested `rdma` fails now, before any queue pair exists."""
        if count <= self._rdma_checked_peers or not self.capabilities.rdma:
            return
        self._rdma_checked_peers = count
        shortfall = rdma.memlock_shortfall(self.wiring(count), rdma_host.locked_memory())
        if not shortfall:
            return
        if self.wanted == "rdma":
            raise BackendUnavailable(f"backend 'rdma' requested but unavailable: {shortfall}")
        self.capabilities = dataclasses.replace(self.capabilities, rdma=False, rdma_reason=shortfall)
        self._log_rdma()

    def _log_rdma(self) -> None:
        """Once per endpoint (and again if a connect withdraws rdma): the rdma device, or why none."""
        probe = self.rdma_probe
        if probe is None:
            return
        if self.capabilities.rdma:
            logger.info("endpoint %s: rdma on port %d of %s (%s)", self.name, probe.port, probe.device,
                        probe.device_reason)
        elif probe.device:  # a device is there but cannot be used: worth a warning
            logger.warning("endpoint %s: rdma unavailable on port %d of %s, so auto uses nixl or tcp across hosts: "
                           "%s", self.name, probe.port, probe.device, self.capabilities.rdma_reason)
        else:
            logger.info("endpoint %s: no rdma (%s)", self.name, self.capabilities.rdma_reason)

    def hello(self, name: str, rank: int, backend: str, channel: int) -> Hello:
        """What a connecting endpoint tells the peer: who it is and what it can do."""
        return Hello(name, rank, backend, channel, self.doorbell.name if self.doorbell else "", self.capabilities)

    @staticmethod
    def peer_capabilities(hello: Hello) -> Capabilities:
        """What a connecting peer said it can do (shm needs its doorbell too)."""
        peer = hello.capabilities
        if not hello.doorbell:
            peer = dataclasses.replace(peer, shm=False, shm_reason=peer.shm_reason or "no doorbell")
        return peer

    def outbound(self, kind: str, peer: str, channel_id: int, ack: dict, sock: socket.socket):
        """This endpoint -> `peer` over `kind`, from the peer's acknowledgement."""
        slot_bytes, num_slots = ack_sizes(ack)
        if kind == "shm":
            if self.core:
                return CoreShmOutbound(peer, channel_id, slot_bytes, num_slots, self.doorbell, ack["shm"], sock,
                                       self.rank)
            return ShmOutbound(peer, channel_id, slot_bytes, num_slots, self.doorbell, ack["shm"], sock)
        if kind == "rdma":
            resources = self._rdma_resources()
            if isinstance(resources, CoreVerbs):
                return CoreRdmaOutbound.connect(resources, peer, channel_id, slot_bytes, num_slots, sock, ack["rdma"],
                                                self.rank)
            return rdma.RdmaOutbound.connect(resources, peer, channel_id, slot_bytes, num_slots, sock, ack["rdma"])
        if kind == "nixl":
            return NixlOutbound.connect(self._nixl_agent(), peer, slot_bytes, num_slots, sock, ack["nixl"])
        tune(sock, self.tcp_buffer_bytes)
        if self.core:
            return CoreTcpOutbound(peer, slot_bytes, num_slots, sock, self.rank, self._tcp_progress(), self.timeout_s)
        return TcpOutbound(peer, slot_bytes, num_slots, sock)

    def inbound(self, kind: str, hello: Hello, ack: dict, sock: socket.socket):
        """`hello.name` -> this endpoint over `kind`; sends `ack` with what the backend adds to it.
        The channel holds every header to the rank the hello announced."""
        peer, sender = hello.name, hello.rank
        if kind == "shm":
            try:  # a /dev/shm too small for the slots: the peer is told why, not left to time out
                inbound = CoreShmInbound if self.core else ShmInbound
                channel = inbound(peer, next(self._inbound_ids), self.slot_bytes, self.num_slots, self.doorbell,
                                  sender=sender)
            except BackendUnavailable as exc:
                send_json(sock, {"ok": False, "error": str(exc)})
                raise
            channel.bind_peer(hello.doorbell, hello.channel, sock)
            send_json(sock, {**ack, "shm": channel.handshake_info()})
            return channel
        if kind == "rdma":
            resources = self._rdma_resources()
            inbound = CoreRdmaInbound if isinstance(resources, CoreVerbs) else rdma.RdmaInbound
            return inbound.accept(resources, peer, sender, self.slot_bytes, self.num_slots, sock, ack)
        if kind == "nixl":
            return NixlInbound.accept(self._nixl_agent(), peer, sender, self.slot_bytes, self.num_slots, sock, ack)
        tune(sock, self.tcp_buffer_bytes)
        channel = (CoreTcpInbound if self.core else TcpInbound)(peer, sender, self.slot_bytes, self.num_slots, sock)
        send_json(sock, ack)
        return channel

    def register(self, buffer) -> None:
        """A buffer payloads will be sent from (see Endpoint.register): registered with the NIXL
        agent (host memory only: nixl sends leave from the host here) and the core's rdma
        domain where they exist, and with each when it is made."""
        if not getattr(buffer, "is_cuda", False):
            with self._nixl_lock:
                self._sources.append(buffer)
                if self._nixl is not None:
                    self._nixl.register_source(buffer)
        self.rdma.register(buffer)

    def renew(self) -> None:
        """Before a re-handshake: a fresh NIXL agent, since reusing one whose UCX link to a
        peer failed crashes NIXL (SIGSEGV in transfer or get_new_notifs, 2 runs in 3). The old
        one is torn down in the order transport/nixl_agent.py gives (or kept, where a write
        is still in flight)."""
        with self._nixl_lock:
            agent, self._nixl = self._nixl, None
        if agent is not None:
            agent.close()

    def close(self) -> None:
        with self._tcp_lock:
            progress, self._progress = self._progress, None
        if progress is not None:
            progress.stop()  # after the channels closed (Endpoint.close): it writes to no socket any more
        if self.doorbell is not None:
            self.doorbell.close()
        self.rdma.close()
        self.renew()

    def _tcp_progress(self):
        """The endpoint's progress thread for its core tcp channels' queued bytes (made once;
        channels are made on the acceptor's threads too)."""
        with self._tcp_lock:
            if self._progress is None:
                self._progress = native.TcpProgress()
            return self._progress

    def _rdma_resources(self):
        """The device the probe chose (`RdmaResources.open`)."""
        probed = self.rdma_probe.device if self.rdma_probe is not None else ""
        return self.rdma.open((probed,) if probed else self.rdma_devices)

    def _nixl_agent(self) -> NixlAgent:
        with self._nixl_lock:
            if self._nixl is None:
                agent = NixlAgent(self.name)
                for buffer in self._sources:
                    agent.register_source(buffer)
                self._nixl = agent
            return self._nixl


class RdmaResources:
    """The rdma device an endpoint's pairs use, opened once, when a pair first chooses rdma
    (under a lock: the acceptor serves each connection on a thread of its own): the core's
    domain where the core drives the channels (transport/core_rdma.py), else pyverbs' context
    and protection domain; and the send buffers registered on the core's domain."""

    def __init__(self, endpoint: str, core: bool, core_demanded: bool) -> None:
        self.endpoint, self.core, self.core_demanded = endpoint, core, core_demanded
        self.opened: rdma.RdmaContext | CoreVerbs | None = None
        self._sources: list = []  # send buffers declared so far (Endpoint.register)
        self._exposed: dict[tuple[int, int], RegionGrant] = {}  # (domain, buffer) ids -> grant (expose)
        self._lock = threading.Lock()

    def open(self, allowed: tuple[str, ...]) -> "rdma.RdmaContext | CoreVerbs":
        with self._lock:
            if self.opened is None:
                self.opened = (self.core and self._core_verbs(allowed)) or rdma.RdmaContext.open(allowed=allowed)
            return self.opened

    def register(self, buffer) -> None:
        with self._lock:
            self._sources.append(buffer)
            if isinstance(self.opened, CoreVerbs):
                self.opened.register(buffer)

    def expose(self, buffer) -> RegionGrant | None:
        """`buffer` registered for the peers' writes on the core's domain, and its grant; None
        where this endpoint's rdma channels are not the core's (none opened, or the reference),
        whose peers then cannot write into it. The grant is the same while the domain is."""
        with self._lock:
            if not isinstance(self.opened, CoreVerbs):
                return None
            key = (id(self.opened), id(buffer))
            if key not in self._exposed:  # a buffer the endpoint holds until it closes
                self._exposed[key] = self.opened.expose(buffer)
            return self._exposed[key]

    def reads_in_place(self, buffer) -> bool:
        """Whether the core's domain holds `buffer` registered (Endpoint.register): its adapter
        then reads a payload lying in it where it lies (GPU memory included)."""
        opened = self.opened
        return isinstance(opened, CoreVerbs) and any(held is buffer for held, _ in opened.registered)

    def settle(self) -> None:
        opened = self.opened
        if isinstance(opened, CoreVerbs):
            opened.settle()

    def hold_stream(self, stream: int, ordinal: int, addresses, values) -> None:
        opened = self.opened
        if not isinstance(opened, CoreVerbs):
            raise BackendUnavailable("rdma: this endpoint exposes no memory in the compiled core: no mark to wait on")
        opened.hold_stream(stream, ordinal, addresses, values)

    def close(self) -> None:
        with self._lock:
            self._exposed.clear()
            opened, self.opened = self.opened, None
        if opened is not None:
            opened.close()

    def _core_verbs(self, allowed: tuple[str, ...]) -> CoreVerbs | None:
        """The core's domain on the chosen port, every send buffer declared so far registered
        on it; None (said once, with the reason) where the core cannot open the device and was
        not demanded: the rdma channels then run on the reference."""
        choice = rdma.choose_port(allowed=allowed)
        try:
            verbs = CoreVerbs(choice)
        except HandshakeError as exc:
            if self.core_demanded:
                raise
            logger.warning("endpoint %s: %s; its rdma channels run on the pure-Python reference (pyverbs), one "
                           "call per work request", self.endpoint, exc)
            return None
        logger.info("endpoint %s: rdma channels in the M2N core on %s, through %s", self.endpoint,
                    choice.describe(), verbs.library)
        for buffer in self._sources:
            verbs.register(buffer)
        return verbs
