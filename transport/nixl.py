"""NIXL channels: one-sided writes through NVIDIA's Inference Xfer Library (UCX underneath).

Each endpoint owns one NIXL agent (transport/nixl_agent.py), made when the first peer pair
chooses nixl. The receiver of a channel registers its slot region with the agent once; the
sender registers a staging region of the same shape once. Their agents' metadata and the
slot region's address cross over the authenticated control connection; the sender then
prepares two descriptor lists per peer, once (NIXL's prep_xfer_dlist): its staging slots and
the peer's slots, each slot's payload cut into BLOCK_BYTES blocks, so a message is a
`make_prepped_xfer` of its slot's first blocks (NIXL merges the neighbours into one write)
and no descriptor is built per send. Then:

    sender                                   receiver
    copy payload into staging slot k
    WRITE staging[k] -> region[k],
      notification = DATA | header  ----->   notification arrives after the bytes:
                                             the message is in slot k, read in place
                                   <-----    release: notification CREDIT | k
    slot k may be written again

A message is written whole blocks at a time: up to BLOCK_BYTES - 1 bytes past its end, from
its own staging slot into its own slot of the peer, which reads only the header's length.
A payload lying in a buffer declared with `Endpoint.register` is written from where it lies
(no staging copy); its address is arbitrary, so that write's descriptors are made per call.

`send` returns once the write is posted, never waiting for it: the agent's writes
(transport/nixl_writes.py) complete it later (the next call on any of its channels, or the
completer thread), and NIXL sends the
notification then, after the bytes. A staging slot is written again only once its credit is
back (which follows its notification, so the write completed) and the agent has seen the
write's handle finish (the notification can arrive before the sender's UCX has seen it
leave); a write that failed is raised by the channel's next call. A payload sent from a registered buffer must
stay as it is until the receiver has the message (its answer came back, or its slot was
released): the deployment's pinned staging is rewritten only after the answer to the
message it held.

A header-only message (no payload) is a bare notification: it writes no slot, so it holds
none and its release returns no credit. Notifications are the only signal either way; they
carry 1 kind byte, then the 32-byte message header (DATA) or the u16 slot (CREDIT). Writes
complete out of order (a header-only notification, or a small write, can overtake a large
write still in flight): a receiver hands messages out in sequence order.

Each header is checked as its notification arrives (transport/wire_rules.py: magic, sender,
length), its sequence number must lie within REORDER_WINDOW past the next expected one and
not repeat one waiting, and a data message must name a slot this side does not hold; credits
must name a slot in use. A malformed notification counts against the agent that sent it,
never against another peer's channel. A WRITE lands before its notification, so a peer that
writes into a slot still held has spoiled that slot by the time it is caught: its own slots
only, since every channel has its own region.

Each agent runs NIXL's progress thread, napping 100 us between polls (transport/nixl_agent.py
says why); the endpoint polls while it waits, since notifications do not wake a selector.
The control connection stays open only to notice a peer that goes away.

Here NIXL runs on host memory over UCX's shared-memory and TCP transports; on a cluster UCX
picks RDMA verbs without code changes. A receive region may be placed on a CUDA device
(registered as VRAM); `Endpoint` keeps slots in host memory today.
"""

from __future__ import annotations

import socket

import numpy as np

from transport.errors import HandshakeError, PeerClosed
from transport.nixl_agent import CREDIT_SLOT, NOTIF_CREDIT, NOTIF_DATA, NixlAgent, available
from transport.shm import PAYLOAD_OFFSET, slot_stride
from transport.wire import HEADER, HEADER_BYTES, SEQ_MASK, Header, recv_json, send_json
from transport.wire_rules import InboundRules, broke

__all__ = ["NOTIF_CREDIT", "NOTIF_DATA", "NixlAgent", "NixlInbound", "NixlOutbound", "available", "slot_region"]

NO_SLOT = -1  # a header-only message: it travels in its notification and occupies no slot
BLOCK_BYTES = 4096  # the unit of a prepared write: a message is written in whole blocks of its slot
# How far past the next expected sequence number a notification may arrive (header-only ones
# overtake a write's; they hold no slot, so the slots do not bound this); beyond it, a skip.
REORDER_WINDOW = 1024


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
    """this endpoint -> peer: a registered staging region, prepared descriptor lists of it and
    of the peer's slots, one WRITE per message, posted without waiting."""

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
        # Prepared once: slot k's blocks are indices [k * blocks_per_slot, (k + 1) * blocks_per_slot)
        # of both lists.
        self.blocks_per_slot = -(-slot_bytes // BLOCK_BYTES)
        self._local = agent.prepare("", slot_blocks(self.staging.data_ptr(), self.stride, slot_bytes, num_slots, 0),
                                    "DRAM")
        self._remote = agent.prepare(self.peer_agent, slot_blocks(self.remote_addr, self.stride, slot_bytes, num_slots,
                                                                  self.remote_device), self.mem_type)
        self._blocks = np.arange(num_slots * self.blocks_per_slot, dtype=np.int32)
        self._failure: PeerClosed | None = None  # a write that failed after its send returned

    @classmethod
    def connect(cls, agent: NixlAgent, peer: str, slot_bytes: int, num_slots: int, sock: socket.socket,
                remote: dict) -> "NixlOutbound":
        try:
            channel = cls(peer, slot_bytes, num_slots, agent, sock, remote)
        except (KeyError, TypeError, ValueError) as exc:
            raise HandshakeError(f"nixl: malformed region info from {peer} ({exc!r})") from None
        send_json(sock, {"nixl": {"metadata": agent.metadata()}})
        return channel

    def fail(self, exc: PeerClosed) -> None:
        """A write of this channel failed after its send returned (the agent found it): the
        next call raises it."""
        if self._failure is None:
            self._failure = exc

    def _check(self) -> None:
        if self._failure is not None:
            raise self._failure.with_traceback(None)

    def _take_credits(self) -> None:
        self.agent.pump()
        self.agent.check(self.peer_agent, self.peer)
        self._check()
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
        """Always 0: a message is out once posted (the endpoint never waits for a write)."""
        return 0

    @property
    def in_flight(self) -> int:
        """This channel's writes posted and not yet seen complete."""
        return self.agent.writes.in_flight(self)

    def try_send(self, header: Header, payload) -> bool:
        """Post a message into its slot: False while the peer holds the slot; True once the
        write is posted (a header-only message: once its notification is sent, holding no
        slot). Never waits for the write."""
        self._check()
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
        if self.agent.writes.writing(self, slot):  # its notification left (its credit is back), UCX has not seen it go
            return False
        self._check()  # the last look may have found a write of this channel failed
        start = slot * self.stride + PAYLOAD_OFFSET
        address = _address_of(payload)
        if self.agent.source_of(address, n):  # written from where it lies: no staging copy
            self.agent.writes.write(self, slot, (address, n, 0), (self.remote_addr + start, n, self.remote_device),
                             self.mem_type, note)
        else:
            self.staging_view[start:start + n] = payload
            first = slot * self.blocks_per_slot
            blocks = self._blocks[first:first + -(-n // BLOCK_BYTES)]
            self.agent.writes.write_prepared(self, slot, self._local, self._remote, blocks, note)
        self.busy[slot] = True
        return True

    def flush(self) -> bool:
        """True once none of this channel's writes is in flight (completing those done); never waits."""
        self.agent.writes.complete()
        self._check()
        return self.agent.writes.in_flight(self) == 0

    def close(self) -> None:
        """Waits (a little: transport/nixl_writes.DRAIN_S) for this channel's writes to leave,
        so the peer has them before the control connection closes; never releases one in
        flight (the agent's close decides)."""
        self.agent.writes.drain(self)
        self._local = self._remote = None
        self.agent.forget(self.peer_agent)


def slot_blocks(base: int, stride: int, slot_bytes: int, num_slots: int, device: int) -> np.ndarray:
    """Descriptors (N x 3: address, bytes, device) of every slot's payload cut into
    BLOCK_BYTES blocks, slot by slot; each slot's last block is shorter where BLOCK_BYTES does
    not divide slot_bytes."""
    starts = np.arange(0, slot_bytes, BLOCK_BYTES, dtype=np.uint64)
    lengths = np.minimum(np.uint64(BLOCK_BYTES), np.uint64(slot_bytes) - starts)
    slots = np.arange(num_slots, dtype=np.uint64)[:, None] * np.uint64(stride)
    addresses = (np.uint64(base + PAYLOAD_OFFSET) + slots + starts[None, :]).ravel()
    return np.stack([addresses, np.tile(lengths, num_slots), np.full(addresses.size, device, dtype=np.uint64)],
                    axis=1)
