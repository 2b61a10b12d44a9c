"""What a receiver accepts from an authenticated peer: the rules every message header is held
to before its payload is trusted. A peer that proved the secret may still be buggy or
compromised; what it can do is then bounded to its own channel.

Per message, on fields already unpacked (integer comparisons, no hashing of payloads):
    magic        MAGIC (another protocol, a version mismatch, or bytes out of step)
    sender       the rank the peer announced in its hello
    byte_length  at most the slot's size
    seq          the next one of this channel (from 0, wrapping at 2**32): a replayed,
                 duplicated or skipped message is refused
    slot         not still held by this endpoint (arrived and not released): a sender may
                 reuse a slot only after its credit

A message that breaks one raises `ProtocolViolation` (a `PeerClosed`) naming the peer and
the rule; the endpoint then drops that peer's channels and keeps serving the others.
"""

from __future__ import annotations

from transport.errors import ProtocolViolation
from transport.wire import MAGIC, SEQ_MASK, Header

# positions in wire.HEADER.unpack's tuple (the magic first, then Header's fields)
MAGIC_AT, MICRO_BATCH_AT, SENDER_AT, SEQ_AT, LENGTH_AT = 0, 3, 4, 7, 8


def broke(peer: str, what: str) -> ProtocolViolation:
    """The error that drops `peer`'s channel because of `what`."""
    return ProtocolViolation(f"peer {peer} broke the M2N protocol: {what}; its channel is dropped")


class InboundRules:
    """One inbound channel's rules and the state they need: the next sequence number and the
    slots that hold a message (from its header's arrival until its release)."""

    __slots__ = ("peer", "sender", "slot_bytes", "num_slots", "next_seq", "held")

    def __init__(self, peer: str, sender: int, slot_bytes: int, num_slots: int) -> None:
        self.peer = peer
        self.sender = sender  # the rank the peer's hello announced
        self.slot_bytes = slot_bytes
        self.num_slots = num_slots
        self.next_seq = 0
        self.held: dict[int, int] = {}  # slot -> seq of the message in it, until released

    def check(self, fields: tuple) -> Header:
        """Magic, sender and length of an arriving header (wire.HEADER.unpack's tuple)."""
        if fields[MAGIC_AT] != MAGIC or fields[SENDER_AT] != self.sender or fields[LENGTH_AT] > self.slot_bytes:
            raise self._refusal(fields)
        return Header._make(fields[1:])

    def admit(self, fields: tuple) -> tuple[int, Header]:
        """The next message of an in-order channel (tcp, shm, rdma): checked, in sequence, into a
        free slot; returns (its slot, its header) with the slot marked held. (`check` and
        `occupy` written out: this runs for every message.)"""
        seq = fields[SEQ_AT]
        if fields[MAGIC_AT] != MAGIC or fields[SENDER_AT] != self.sender or fields[LENGTH_AT] > self.slot_bytes \
                or seq != self.next_seq:
            raise self._refusal(fields)
        slot = fields[MICRO_BATCH_AT] % self.num_slots
        if slot in self.held:
            raise self._held_refusal(seq, fields[MICRO_BATCH_AT])
        self.held[slot] = seq
        self.next_seq = (seq + 1) & SEQ_MASK
        return slot, Header._make(fields[1:])

    def occupy(self, header: Header) -> int:
        """Marks the slot of `header` held; refused while it still holds an earlier message."""
        slot = header.micro_batch % self.num_slots
        if slot in self.held:
            raise self._held_refusal(header.seq, header.micro_batch)
        self.held[slot] = header.seq
        return slot

    def ahead(self, seq: int) -> int:
        """How far `seq` lies past the next expected one (0: it is the next one)."""
        return (seq - self.next_seq) & SEQ_MASK

    def free(self, slot: int) -> int | None:
        """Releases `slot`; returns the seq of the message it held (None if it held none)."""
        return self.held.pop(slot, None)

    def sequence_refusal(self, seq: int) -> ProtocolViolation:
        ahead = self.ahead(seq)
        why = "a message was skipped" if ahead < 1 << 31 else "a replayed or duplicated message"
        return broke(self.peer, f"sequence number {seq} where {self.next_seq} was expected ({why})")

    def _held_refusal(self, seq: int, micro_batch: int) -> ProtocolViolation:
        slot = micro_batch % self.num_slots
        return broke(self.peer, f"message seq {seq} went into slot {slot} (micro-batch {micro_batch}), which still "
                                f"holds message seq {self.held[slot]}, not released yet: it would overwrite data in use")

    def _refusal(self, fields: tuple) -> ProtocolViolation:
        """The first rule `fields` breaks (the slow path: only once a check failed)."""
        if fields[MAGIC_AT] != MAGIC:
            return broke(self.peer, f"header magic 0x{fields[MAGIC_AT]:08x} is not 0x{MAGIC:08x} (another protocol "
                                    "or version, or bytes out of step)")
        if fields[SENDER_AT] != self.sender:
            return broke(self.peer, f"header names sender rank {fields[SENDER_AT]}, but the peer announced rank "
                                    f"{self.sender} in its hello")
        if fields[LENGTH_AT] > self.slot_bytes:
            return broke(self.peer, f"header announces {fields[LENGTH_AT]} payload bytes for a {self.slot_bytes}-byte "
                                    "slot")
        return self.sequence_refusal(fields[SEQ_AT])
