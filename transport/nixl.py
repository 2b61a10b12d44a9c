"""NIXL channels: one-sided writes through NVIDIA's Inference Xfer Library (UCX underneath).

Each endpoint owns one NIXL agent (`NixlAgent`), made when the first peer pair chooses nixl.
The receiver of a channel registers its slot region with the agent once; the sender
registers a staging region of the same shape once. Their agents' metadata and the slot
region's address cross over the authenticated control connection, then:

    sender                                   receiver
    copy payload into staging slot k
    WRITE staging[k] -> region[k],
      notification = DATA | header  ----->   notification arrives after the bytes:
                                             the message is in slot k, read in place
                                   <-----    release: notification CREDIT | k
    slot k may be written again

A header-only message (no payload) is a bare notification: it writes no slot, so it holds
none and its release returns no credit. Notifications are the only
signal either way; they carry 1 kind byte, then the 32-byte message header (DATA) or the
u16 slot (CREDIT). A receiver hands messages out in sequence order (a header-only
notification can overtake the notification of a large write still in flight).

Each header is checked as its notification arrives (transport/wire_rules.py: magic, sender,
length), its sequence number must lie within REORDER_WINDOW past the next expected one and
not repeat one waiting, and a data message must name a slot this side does not hold; credits
must name a slot in use. A malformed notification counts against the agent that sent it,
never against another peer's channel. A WRITE lands before its notification, so a peer that
writes into a slot still held has spoiled that slot by the time it is caught: its own slots
only, since every channel has its own region.

`send` returns once the write is done (the staging slot is then free again). Each agent
runs NIXL's progress thread, napping 100 us between polls (`_new_agent` says why), so a
message moves while either end computes; the endpoint also polls while it waits, since
notifications do not wake a selector. The control connection stays open only to notice a
peer that goes away.

Here NIXL runs on host memory over UCX's shared-memory and TCP transports; on a cluster
UCX picks RDMA verbs without code changes. A receive region may be placed on a CUDA device
(registered as VRAM); `Endpoint` keeps slots in host memory today.
"""

from __future__ import annotations

import secrets
import socket
import struct
import threading
from collections import deque

import numpy as np

from transport.errors import BackendUnavailable, HandshakeError, PeerClosed
from transport.shm import PAYLOAD_OFFSET, slot_stride
from transport.wire import HEADER, HEADER_BYTES, SEQ_MASK, Header, recv_json, send_json
from transport.wire_rules import InboundRules, broke

NOTIF_DATA, NOTIF_CREDIT = b"D", b"C"
NO_SLOT = -1  # a header-only message: it travels in its notification and occupies no slot
CREDIT_SLOT = struct.Struct("<H")
PROGRESS_THREAD_DELAY_US = 100  # the progress thread's nap between polls of the UCX worker
# How far past the next expected sequence number a notification may arrive (header-only ones
# overtake a write's; they hold no slot, so the slots do not bound this); beyond it, a skip.
REORDER_WINDOW = 1024


def _api():
    """NIXL's Python module: the `nixl` meta package where installed, else the CUDA 12 build."""
    try:
        import nixl._api as api
    except ImportError:
        import nixl_cu12._api as api
    return api


_CONSTRUCTING = threading.Lock()


def _new_agent(name: str):
    """A NIXL agent with UCX and a progress thread that naps PROGRESS_THREAD_DELAY_US between
    polls. NIXL's Python wrapper hard-codes a delay of 0, a busy-spinning thread: measured on
    this 2-core host a notification then took 6 ms (p50), against 80 us with the nap. The
    wrapper builds its config object and hands it to the binding's agent constructor; that
    one call is intercepted to set the delay."""
    api = _api()
    binding = api.nixlBind
    make_agent = binding.nixlAgent

    def with_delay(agent_name, config):
        config.pthrDelay = PROGRESS_THREAD_DELAY_US
        return make_agent(agent_name, config)

    # Strict sync: an endpoint's connector and acceptor threads handshake at once, beside the
    # progress thread.
    config = api.nixl_agent_config(enable_prog_thread=True, backends=[],  # UCX added below, with its parameters
                                   sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
    with _CONSTRUCTING:
        binding.nixlAgent = with_delay
        try:
            agent = api.nixl_agent(name, config)
        finally:
            binding.nixlAgent = make_agent
    # No UCX peer-error mode: with it UCX keeps shared memory out of active messages (shm has
    # no peer failure handler), so on one host every notification went over TCP loopback
    # (7.6 us a notification against 2.2 us here). A failed peer is ours to notice: the
    # control connection closes (PeerClosed) and every wait has a deadline (PeerTimeout).
    agent.create_backend("UCX", {"ucx_error_handling_mode": "none"})
    return agent


def available() -> tuple[bool, str]:
    """(True, "") where NIXL imports with a UCX plugin; otherwise (False, the reason)."""
    try:
        _api()
    except ImportError:
        return False, 'NIXL is not installed (pip install -e ".[nixl]", which installs nixl-cu12)'
    except OSError as exc:  # a shared library the wheel needs is missing
        return False, f"NIXL does not load ({exc})"
    return True, ""


class NixlAgent:
    """This endpoint's agent: registers regions, knows its peers' agents, sorts notifications
    into per-peer queues (data for inbound channels, credits for outbound ones)."""

    def __init__(self, endpoint_name: str) -> None:
        ok, reason = available()
        if not ok:
            raise BackendUnavailable(f"nixl: {reason}")
        # Agent names must be unique among the agents that meet: an endpoint name plus a token.
        self.name = f"{endpoint_name}.{secrets.token_hex(4)}"
        try:
            self.agent = _new_agent(self.name)
        except RuntimeError as exc:
            raise BackendUnavailable(f"nixl: cannot start an agent with the UCX backend ({exc})") from None
        if "UCX" not in self.agent.backends:
            raise BackendUnavailable("nixl: the UCX plugin is missing from this NIXL installation")
        self.data: dict[str, deque[bytes]] = {}
        self.credits: dict[str, list[int]] = {}
        self.violations: dict[str, str] = {}  # peer agent -> what its malformed notification was
        self._channels: dict[str, int] = {}  # peer agent -> channels using it (in and out share one)
        self._sources: list[tuple[int, int, object]] = []  # registered send buffers: (start, end, the buffer)
        self._setup = threading.Lock()  # handshakes run on two threads (Endpoint.connect)
        self._registered = []

    def add_peer(self, metadata_hex: str, regions_hex: str = "") -> str:
        """Learn a peer's agent from its full metadata the first time; after that only load
        `regions_hex` (partial metadata of newly registered regions, no connection info):
        loading full metadata again re-creates the UCX endpoints and cancels what is in
        flight on them (seen as "UCX AM send failed ... Request canceled" and lost
        notifications)."""
        with self._setup:
            try:
                name, full = self._split(metadata_hex)
                if self._channels.get(name, 0) == 0:
                    self.agent.add_remote_agent(full)
                elif regions_hex:
                    self.agent.add_remote_agent(bytes.fromhex(regions_hex))
            except ValueError as exc:
                raise HandshakeError(f"nixl: malformed agent metadata ({exc})") from None
            self.data.setdefault(name, deque())
            self.credits.setdefault(name, [])
            self._channels[name] = self._channels.get(name, 0) + 1
            return name

    @staticmethod
    def _split(metadata: str) -> tuple[str, bytes]:
        """'name:hex' (see `metadata`) -> (the agent's name, its metadata)."""
        name, sep, body = metadata.partition(":")
        if not sep or not name:
            raise ValueError("no agent name before the metadata")
        return name, bytes.fromhex(body)

    def register_source(self, buffer) -> None:
        """Registers a host buffer messages are sent from (a contiguous CPU torch tensor kept
        alive here), so a send whose payload lies in it is written from it directly, without
        the staging copy."""
        start = buffer.data_ptr()
        if any(s <= start < e for s, e, _ in self._sources):
            return
        self.register(buffer)
        self._sources.append((start, start + buffer.numel() * buffer.element_size(), buffer))

    def source_of(self, address: int, length: int) -> bool:
        """True when [address, address + length) lies in a registered send buffer."""
        return any(s <= address and address + length <= e for s, e, _ in self._sources)

    def metadata(self) -> str:
        """This agent's name and full metadata (connection info and every registered region)."""
        with self._setup:
            return f"{self.name}:{self.agent.get_agent_metadata().hex()}"

    def region_metadata(self, descs) -> str:
        """Partial metadata: the regions `descs` only, no connection info."""
        with self._setup:
            return self.agent.get_partial_agent_metadata(descs, False).hex()

    def register(self, region):
        """Registers `region` once; returns its descriptor list (for `region_metadata`)."""
        with self._setup:
            descs = self.agent.register_memory(region)
            self._registered.append(descs)
            return descs

    def pump(self) -> None:
        """Move every notification that has arrived into its peer's queue."""
        try:
            arrived = self.agent.get_new_notifs()
        except Exception as exc:  # nixl's own error types
            raise PeerClosed(f"nixl: reading notifications failed ({type(exc).__name__}: {exc})") from None
        for remote, notes in arrived.items():
            remote = remote.decode() if isinstance(remote, bytes) else remote
            for note in notes:
                kind, body = note[:1], note[1:]
                if kind == NOTIF_DATA:
                    self.data.setdefault(remote, deque()).append(body)
                elif kind == NOTIF_CREDIT and len(body) == CREDIT_SLOT.size:
                    self.credits.setdefault(remote, []).append(CREDIT_SLOT.unpack(body)[0])
                else:  # that agent's channels fail on their next look, no other peer's
                    self.violations.setdefault(remote, f"a malformed {len(note)}-byte notification "
                                                       f"({bytes(note[:16]).hex()}...)")

    def check(self, peer_agent: str, peer: str) -> None:
        """Raises the violation `peer_agent`'s notifications committed, if any."""
        if self.violations and peer_agent in self.violations:
            raise broke(peer, self.violations[peer_agent])

    def write(self, local: tuple[int, int, int], remote: tuple[int, int, int], peer_agent: str, remote_type: str,
              note: bytes):
        """Post one WRITE of local host memory (addr, len, device) to the peer's (addr, len,
        device) of `remote_type` (DRAM or VRAM) with a notification; returns the handle."""
        agent = self.agent
        try:
            handle = agent.initialize_xfer("WRITE", agent.get_xfer_descs([local], "DRAM"),
                                           agent.get_xfer_descs([remote], remote_type), peer_agent, note)
        except Exception as exc:  # nixl's own error types (nixlNotFoundError, ...): the peer is unknown or gone
            raise PeerClosed(f"nixl: cannot write to agent {peer_agent} ({type(exc).__name__}: {exc})") from None
        if agent.transfer(handle) == "ERR":
            agent.release_xfer_handle(handle)
            raise PeerClosed(f"nixl: a write to agent {peer_agent} failed to post")
        return handle

    def done(self, handle, peer: str) -> bool:
        try:
            state = self.agent.check_xfer_state(handle)
        except Exception as exc:  # nixl's own error types (nixlRemoteDisconnectError, ...)
            raise PeerClosed(f"nixl: a write to {peer} failed ({type(exc).__name__}: {exc})") from None
        if state == "ERR":
            raise PeerClosed(f"nixl: a write to {peer} failed (the peer or its link is gone)")
        return state == "DONE"

    def release(self, handle) -> None:
        try:
            self.agent.release_xfer_handle(handle)
        except Exception:  # a transfer still failing against a dead peer: its handle goes with the agent
            pass

    def notify(self, peer_agent: str, note: bytes) -> None:
        try:
            self.agent.send_notif(peer_agent, note)
        except Exception as exc:  # nixl's own error types
            raise PeerClosed(f"nixl: cannot notify agent {peer_agent} ({type(exc).__name__}: {exc})") from None

    def forget(self, peer_agent: str) -> None:
        """One channel to `peer_agent` closed; the agent is removed with the last."""
        with self._setup:
            left = self._channels.get(peer_agent, 0) - 1
            if left > 0:
                self._channels[peer_agent] = left
                return
            self._channels.pop(peer_agent, None)
            self.data.pop(peer_agent, None)
            self.credits.pop(peer_agent, None)
            self.violations.pop(peer_agent, None)
            try:
                self.agent.remove_remote_agent(peer_agent)
            except Exception:  # nixl raises its own error types; the peer is going away either way
                pass

    def close(self) -> None:
        for descs in self._registered:
            try:
                self.agent.deregister_memory(descs)
            except Exception:  # best effort at shutdown
                pass
        self._registered.clear()


def slot_region(num_slots: int, slot_bytes: int, device=None):
    """A contiguous region of `num_slots` slots (torch uint8; host memory unless `device`)."""
    import torch

    return torch.zeros(slot_stride(slot_bytes) * num_slots, dtype=torch.uint8, device=device or "cpu")


def _address_of(payload: memoryview) -> int:
    """The address of a bytes-like payload's first byte (read-only ones too), without a copy."""
    return np.frombuffer(payload, dtype=np.uint8).ctypes.data


def _where(region) -> tuple[int, int, str]:
    """(base address, device id, NIXL memory type) of a region tensor."""
    return region.data_ptr(), max(region.get_device(), 0), "VRAM" if region.is_cuda else "DRAM"


class NixlInbound:
    """peer -> this endpoint: owns the registered slot region the peer writes into."""

    kind = "nixl"

    def __init__(self, peer: str, sender: int, slot_bytes: int, num_slots: int, agent: NixlAgent,
                 control: socket.socket, device=None) -> None:
        self.peer, self.slot_bytes, self.num_slots, self.agent, self.control = peer, slot_bytes, num_slots, agent, \
            control
        self.stride = slot_stride(slot_bytes)
        self.region = slot_region(num_slots, slot_bytes, device)
        self.descs = agent.register(self.region)
        self.view = memoryview(self.region.numpy()) if not self.region.is_cuda else None
        self.peer_agent = ""
        self.rules = InboundRules(peer, sender, slot_bytes, num_slots)
        self.bare_held = 0  # header-only messages handed out (or waiting) and not released
        self._early: dict[int, Header] = {}  # arrived ahead of an earlier message still in flight
        self._failure: PeerClosed | None = None  # met after messages that the last poll returned

    @property
    def outstanding(self) -> int:
        return len(self.rules.held) + self.bare_held

    @classmethod
    def accept(cls, agent: NixlAgent, peer: str, sender: int, slot_bytes: int, num_slots: int, sock: socket.socket,
               ack: dict) -> "NixlInbound":
        """Registers the slots, sends their place and this agent's metadata (taken after the
        registration, so it covers them), and learns the sender's agent for credits."""
        channel = cls(peer, sender, slot_bytes, num_slots, agent, sock)
        addr, device, mem_type = _where(channel.region)
        send_json(sock, {**ack, "nixl": {"metadata": agent.metadata(), "regions": agent.region_metadata(channel.descs),
                                         "addr": addr, "device": device, "mem_type": mem_type,
                                         "stride": channel.stride}})
        try:
            channel.peer_agent = agent.add_peer(str(recv_json(sock)["nixl"]["metadata"]))
        except (KeyError, TypeError) as exc:
            raise HandshakeError(f"nixl: malformed agent metadata from {peer} ({exc!r})") from None
        return channel

    def poll(self) -> list[tuple[int, Header]]:
        """Messages that continue the sequence; a violation after some of them is raised by the
        next poll, once they are handed out."""
        if self._failure is not None:
            raise self._failure.with_traceback(None)
        self.agent.pump()
        done: list[tuple[int, Header]] = []
        try:
            self.agent.check(self.peer_agent, self.peer)
            self._sort_arrivals()
            self._in_order(done)
        except PeerClosed as exc:
            if not done:
                raise
            self._failure = exc
        return done

    def _sort_arrivals(self) -> None:
        """Checks each arrived header and files it by sequence number."""
        rules, early = self.rules, self._early
        queue = self.agent.data.get(self.peer_agent)
        while queue:
            body = queue.popleft()
            if len(body) != HEADER_BYTES:
                raise broke(self.peer, f"a {len(body)}-byte header in a data notification ({HEADER_BYTES} expected)")
            header = rules.check(HEADER.unpack_from(body))
            if rules.ahead(header.seq) >= REORDER_WINDOW or header.seq in early:
                raise rules.sequence_refusal(header.seq)
            early[header.seq] = header

    def _in_order(self, done: list) -> None:
        rules, early = self.rules, self._early
        while rules.next_seq in early:
            header = early.pop(rules.next_seq)
            if header.byte_length:
                slot = rules.occupy(header)
            else:
                slot = NO_SLOT
                self.bare_held += 1
            rules.next_seq = (rules.next_seq + 1) & SEQ_MASK
            done.append((slot, header))

    def payload(self, slot: int, length: int) -> memoryview:
        if slot == NO_SLOT:
            return memoryview(b"")
        start = slot * self.stride + PAYLOAD_OFFSET
        return self.view[start:start + length]

    def release(self, slot: int) -> None:
        if slot == NO_SLOT:  # a header-only message held no slot: nothing to credit
            self.bare_held -= 1
            return
        self.rules.free(slot)
        try:
            self.agent.notify(self.peer_agent, NOTIF_CREDIT + CREDIT_SLOT.pack(slot))
        except PeerClosed:  # the peer is gone; its own side reports it
            pass

    def close(self) -> None:
        self.agent.forget(self.peer_agent)


class NixlOutbound:
    """this endpoint -> peer: a registered staging region, one WRITE per message."""

    kind = "nixl"

    def __init__(self, peer: str, slot_bytes: int, num_slots: int, agent: NixlAgent, control: socket.socket,
                 remote: dict) -> None:
        self.peer, self.slot_bytes, self.num_slots, self.agent, self.control = peer, slot_bytes, num_slots, agent, \
            control
        self.stride = slot_stride(slot_bytes)
        if int(remote["stride"]) != self.stride:
            raise HandshakeError(f"nixl: {peer}'s slot stride {remote['stride']} differs from {self.stride}")
        self.peer_agent = agent.add_peer(str(remote["metadata"]), str(remote.get("regions", "")))
        self.remote_addr, self.remote_device = int(remote["addr"]), int(remote["device"])
        self.mem_type = str(remote["mem_type"])
        self.staging = slot_region(num_slots, slot_bytes)
        agent.register(self.staging)
        self.staging_view = memoryview(self.staging.numpy())
        self.busy = [False] * num_slots
        self._writing = None  # the current message's write, until NIXL reports it done

    @classmethod
    def connect(cls, agent: NixlAgent, peer: str, slot_bytes: int, num_slots: int, sock: socket.socket,
                remote: dict) -> "NixlOutbound":
        try:
            channel = cls(peer, slot_bytes, num_slots, agent, sock, remote)
        except (KeyError, TypeError, ValueError) as exc:
            raise HandshakeError(f"nixl: malformed region info from {peer} ({exc!r})") from None
        send_json(sock, {"nixl": {"metadata": agent.metadata()}})
        return channel

    def _take_credits(self) -> None:
        self.agent.pump()
        self.agent.check(self.peer_agent, self.peer)
        credits = self.agent.credits.get(self.peer_agent)
        while credits:
            slot = credits.pop()
            if slot >= self.num_slots or not self.busy[slot]:
                raise broke(self.peer, f"a credit for slot {slot} of {self.num_slots}, which is not in use")
            self.busy[slot] = False

    def unreleased(self) -> int:
        """Slots written whose credit has not come back, after taking the credits waiting."""
        self._take_credits()
        return sum(self.busy)

    @property
    def unsent(self) -> int:
        """Nonzero while the current message's write is in flight (see `flush`)."""
        return 1 if self._writing is not None else 0

    def try_send(self, header: Header, payload) -> bool:
        """Start a message into its slot: False while the peer holds the slot; True once the
        write is posted (a header-only message: once its notification is sent, holding no
        slot). The endpoint then calls `flush` until the write is done: NIXL sends a write's
        notification only once the initiator has seen it complete, and the staging slot (or
        the registered buffer the payload lies in) may be reused only then."""
        if self._writing is not None:
            raise RuntimeError(f"a message to {self.peer} is still being written: flush it first")
        note = NOTIF_DATA + header.pack()
        n = header.byte_length
        if n == 0:  # the header rides in the notification: no slot is written, none is held
            self.agent.notify(self.peer_agent, note)
            return True
        slot = header.micro_batch % self.num_slots
        if self.busy[slot]:
            self._take_credits()
            if self.busy[slot]:
                return False
        start = slot * self.stride + PAYLOAD_OFFSET
        address = _address_of(payload)
        if self.agent.source_of(address, n):  # written from where it lies: no staging copy
            local = (address, n, 0)
        else:
            self.staging_view[start:start + n] = payload
            local = (self.staging.data_ptr() + start, n, 0)
        remote = (self.remote_addr + start, n, self.remote_device)
        self._writing = self.agent.write(local, remote, self.peer_agent, self.mem_type, note)
        self.flush()
        self.busy[slot] = True
        return True

    def flush(self) -> bool:
        """True once the current write is done (its notification then goes out); never waits."""
        if self._writing is None:
            return True
        if not self.agent.done(self._writing, self.peer):
            return False
        self.agent.release(self._writing)
        self._writing = None
        return True

    def close(self) -> None:
        if self._writing is not None:
            self.agent.release(self._writing)
            self._writing = None
        self.agent.forget(self.peer_agent)
