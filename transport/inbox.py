"""An endpoint's inbox: messages taken off the inbound channels and not handed out yet, and
how a receive finds one (`poll_once`) or waits for it (`wait`).

Messages are taken off a channel whenever the endpoint looks at it (a receive, or a tcp
connection found readable while a send waits), so one from another peer, or for another
micro-batch, than the caller asked for waits here, in arrival order, for the receive that
asks for it.
"""

from __future__ import annotations

import os
import time

from transport.errors import PeerClosed, PeerTimeout, TransportError
from transport.message import Message
from transport.peer_channels import PeerChannels
from transport.wakeups import Wakeups

__all__ = ["Inbox"]


class Inbox:
    """Received messages not handed out yet (`pending`, arrival order), taken from the
    channels of `channels`; waits go through `wakeups`."""

    def __init__(self, spec, channels: PeerChannels, wakeups: Wakeups) -> None:
        self.spec = spec
        self.channels = channels
        self.wakeups = wakeups
        self.pending: list[Message] = []
        # The channel set's own dict and set (emptied and refilled, never replaced), held here
        # so the receive path looks them up once.
        self.inbound = channels.inbound
        self.violators = channels.violators

    def poll_once(self, peer: str | None, micro_batch: int | None) -> Message | None:
        """One look for a matching message: already collected ones first, then the channels."""
        if self.pending:
            msg = self.take(peer, micro_batch)
            if msg is not None:
                return msg
        inbound = self.inbound
        for name in ((peer,) if peer is not None else inbound):
            if name not in inbound:
                return None
            self.collect(name)
        return self.take(peer, micro_batch) if self.pending else None

    def collect(self, peer: str) -> None:
        """Takes every message that has arrived from `peer` off its channel."""
        if peer in self.violators:
            return
        channel = self.inbound[peer]
        try:
            done = channel.poll()
        except PeerClosed as exc:
            self.channels.drop(peer, exc, channel.control if channel.kind == "tcp" else None)
            return
        for slot, header in done:
            self.pending.append(Message(peer, header, channel.payload(slot, header.byte_length), channel, slot))

    def take(self, peer: str | None, micro_batch: int | None) -> Message | None:
        pending = self.pending
        if peer is None and micro_batch is None:
            return pending.pop(0)
        for i, msg in enumerate(pending):
            if (peer is None or msg.peer == peer) and (micro_batch is None or msg.header.micro_batch == micro_batch):
                return pending.pop(i)
        return None

    def holds_from(self, peers) -> bool:
        """Messages of these peers taken by recv/poll and not handed out yet."""
        return bool(self.pending) and any(m.peer in peers for m in self.pending)

    def wait(self, peer: str | None, micro_batch: int | None, timeout: float | None) -> Message:
        """`Endpoint.recv` once its first look found nothing: spin, then sleep, until a
        matching message arrives, every awaited peer is gone, or the timeout passes."""
        inbound = self.inbound
        if peer is not None and peer not in inbound:
            raise TransportError(f"endpoint {self.spec.name} has no peer {peer!r}; peers: {', '.join(inbound)}")
        limit = self.spec.timeout_s if timeout is None else timeout
        deadline = time.monotonic() + limit
        spin_until = time.monotonic() + self.wakeups.spin_s
        peers = (peer,) if peer is not None else tuple(inbound)
        spins = 0
        while True:
            msg = self.poll_once(peer, micro_batch)
            if msg is not None:
                return msg
            spins += 1
            if spins & 15:  # a tight spin: the clock and liveness every 16 looks
                continue
            os.sched_yield()  # let a peer sharing this core run (oversubscribed hosts)
            self.channels.check_alive(peers)
            now = time.monotonic()
            if now >= deadline:
                what = f"from {peer}" if peer else f"from any of {', '.join(peers)}"
                mb = f" for micro-batch {micro_batch}" if micro_batch is not None else ""
                raise PeerTimeout(f"endpoint {self.spec.name}: no message {what}{mb} within {limit:g} s")
            if now >= spin_until:
                def arrived() -> bool:
                    for p in peers:
                        self.collect(p)
                    return any((peer is None or m.peer == peer) and (micro_batch is None or m.header.micro_batch ==
                                                                     micro_batch) for m in self.pending)
                self.wakeups.block(deadline, arrived, asleep=[inbound[p] for p in peers])

    def clear(self) -> None:
        self.pending.clear()
