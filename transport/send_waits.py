"""What a send waits for, off its fast path: the peer's slot to be freed (`until_free`), and
the rest of its bytes to leave (`until_sent`). Each wait ends in PeerTimeout after its limit
or PeerClosed as soon as the peer is gone: never a hang."""

from __future__ import annotations

import os
import select
import time

from transport.errors import PeerTimeout
from transport.inbox import Inbox
from transport.peer_channels import PeerChannels
from transport.tcp import TcpInbound
from transport.wakeups import MAX_SLEEP_S, POLLED_NAP_S, Wakeups
from transport.wire import Header

__all__ = ["SendWaits"]


class SendWaits:
    """The slow paths of `Endpoint.send`."""

    def __init__(self, spec, channels: PeerChannels, inbox: Inbox, wakeups: Wakeups) -> None:
        self.spec = spec
        self.channels = channels
        self.inbox = inbox
        self.wakeups = wakeups

    def until_free(self, channel, header: Header, data: memoryview, limit: float) -> None:
        """The peer still holds the slot: spin, then sleep, until it frees and the message is written."""
        peer = channel.peer
        deadline = time.monotonic() + limit
        spin_until = time.monotonic() + self.wakeups.spin_s
        while True:
            self.channels.check_alive((peer,))
            now = time.monotonic()
            if now >= deadline:
                raise PeerTimeout(f"endpoint {self.spec.name}: peer {peer} has not released its slot for micro-batch "
                                  f"{header.micro_batch} within {limit:g} s (it stopped consuming, or died)")
            if now < spin_until:
                os.sched_yield()
            sent = channel.try_send(header, data) if now < spin_until else \
                self.wakeups.block(deadline, lambda: channel.try_send(header, data), asleep=[channel])
            if sent:
                return

    def until_sent(self, channel, limit: float) -> None:
        """The rest of a message: for tcp, what the kernel could not take at once, written as
        the socket drains, while every inbound tcp connection is read into its slots, so a
        peer that is sending to this endpoint at the same time is never left waiting for a
        reader (full duplex: two senders never block each other). Returns once the message is
        all out, so the caller may reuse its buffer. (nixl never comes here: its send returns
        once the write is posted, transport/nixl.py.)"""
        peer = channel.peer
        deadline = time.monotonic() + limit
        dead = self.channels.dead
        readers = {ch.sock: name for name, ch in self.channels.inbound.items()
                   if isinstance(ch, TcpInbound) and name not in dead}  # a dead one's socket is at its end
        writing = [channel.sock] if channel.kind == "tcp" else []
        # A NIXL write completes without this thread (UCX's progress thread moves the bytes):
        # poll it briefly, then sleep in small steps.
        step = MAX_SLEEP_S if writing else 0.0
        spin_until = time.monotonic() + self.wakeups.spin_s
        while not channel.flush():
            self.channels.check_alive((peer,))
            now = time.monotonic()
            if now >= deadline:
                what = f"read {channel.unsent} bytes of" if writing else "completed the write of"
                raise PeerTimeout(f"endpoint {self.spec.name}: peer {peer} has not {what} a message within "
                                  f"{limit:g} s (it stopped reading, or its host is unreachable)")
            if not writing:
                step = 0.0 if now < spin_until else POLLED_NAP_S
            readable, _, _ = select.select(list(readers), writing, [], step)
            for sock in readable:
                self.inbox.collect(readers[sock])
