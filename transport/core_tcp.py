"""The compiled M2N core (transport/csrc/tcp_channels.cpp) as tcp channels.

The core does per round what transport/tcp.py does per message: the same wire, credits and
rules, in C++ with the GIL released, so a round to 32 tcp peers is one call (`transport.rounds`).
A send writes what the kernel takes at once and leaves the rest to the endpoint's progress
thread (`native.TcpProgress`, one per endpoint, made with its first core tcp channel): it
returns once the bytes are in the kernel or in the channel's queue, so the caller may reuse
its buffer and never waits for the peer to read (`unsent` is always 0). `CoreTcpOutbound` and
`CoreTcpInbound` keep the reference classes' set-up and interface, so `Endpoint.send`, `recv`
and `poll` work on them unchanged; whether an endpoint uses them is `EndpointSpec.core`, as
for shm (transport/core.py).
"""

from __future__ import annotations

import logging
import os
import socket

from transport.core import CoreInbound, CoreOutbound, native
from transport.errors import PeerClosed
from transport.tcp import TcpInbound, TcpOutbound
from transport.wire import CREDIT, HEADER_BYTES
from transport.wire_rules import InboundRules, broke

__all__ = ["CoreTcpInbound", "CoreTcpOutbound", "tcp_error"]

logger = logging.getLogger(__name__)


def tcp_error(channel, code: int, a: int, b: int, fields: tuple) -> PeerClosed:
    """A core tcp channel's failure, in the reference's words (transport/tcp.py, wire_rules.py):
    a ProtocolViolation where the peer broke a rule, a PeerClosed where it left."""
    peer = channel.peer
    if code == native.CLOSED:
        return PeerClosed(f"peer {peer} closed its connection (process exited or shut down)")
    if code == native.DROPPED:
        return PeerClosed(f"peer {peer} dropped the connection ({os.strerror(a)})")
    if code == native.TRUNCATED:
        part = f"{a} of {HEADER_BYTES} header bytes" if fields[0] else f"{a} of {b} payload bytes"
        return broke(peer, f"the connection closed in the middle of a message ({part} arrived)")
    if code == native.BAD_CREDIT:
        frame = a.to_bytes(8, "little")
        magic, slot, _ = CREDIT.unpack(frame)
        return broke(peer, f"malformed credit frame {frame.hex()} (magic 0x{magic:08x}, slot {slot} of "
                           f"{channel.num_slots}, {'in use' if b else 'not in use'})")
    rules = InboundRules(peer, channel.rules.sender, channel.slot_bytes, channel.num_slots)
    rules.next_seq = a if code == native.BAD_HEADER else fields[7]
    if code == native.HELD_SLOT:
        rules.held[a] = b
        return rules._held_refusal(fields[7], fields[3])
    return rules._refusal(tuple(fields))


class CoreTcpOutbound(CoreOutbound, TcpOutbound):
    """this endpoint -> peer over tcp, written by the core (which stamps the sequence numbers)."""

    core_driven = True

    def __init__(self, peer: str, slot_bytes: int, num_slots: int, sock: socket.socket, rank: int,
                 progress, linger_s: float) -> None:
        super().__init__(peer, slot_bytes, num_slots, sock)
        self.core = native.TcpOutChannel(sock.fileno(), slot_bytes, num_slots, rank, progress)
        self.linger_s = linger_s  # how long a close waits for queued bytes to leave (the endpoint's timeout)

    @property
    def unsent(self) -> int:
        return 0  # what the kernel did not take is queued in the core, written by its progress thread

    def failure(self) -> PeerClosed:
        return tcp_error(self, *self.core.failure(), (0,) * 9)

    def flush(self) -> bool:
        return True

    def drain_credits(self) -> None:
        if not self.core.drain_credits():
            raise self.failure()

    def close(self) -> None:
        # What was sent leaves before the socket closes, as the kernel sends what a closed socket
        # holds; then the progress thread lets go of the socket.
        left = self.core.close(self.linger_s)
        if left:
            logger.warning("tcp channel to %s closed with %d bytes unsent: the peer read nothing for %g s",
                           self.peer, left, self.linger_s)
        super().close()


class CoreTcpInbound(CoreInbound, TcpInbound):
    """peer -> this endpoint over tcp, read by the core into this channel's slot buffer."""

    core_driven = True

    def __init__(self, peer: str, sender: int, slot_bytes: int, num_slots: int, sock: socket.socket) -> None:
        super().__init__(peer, sender, slot_bytes, num_slots, sock)
        self.core = native.TcpInChannel(self.buffer, sock.fileno(), slot_bytes, num_slots, sender)

    def error(self) -> PeerClosed:
        return tcp_error(self, *self.core.violation_info())

    def admit(self) -> None:
        """Takes in what has arrived (a readable socket, found by the endpoint's selector),
        without handing it out: a round or a receive takes it from the core."""
        if not self.core.admit():
            raise self.error()

    def close(self) -> None:
        self.core.close()
        super().close()

