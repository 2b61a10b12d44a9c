"""An endpoint's channel set: a channel to and from each peer, the backend each pair chose,
and which peers are gone.

`connect` builds the set (dialing every peer while the listener accepts them back,
transport/peering.py); `close` ends it (every channel closed, the set emptied for a
reconnect). A peer whose connection dropped, or that broke the protocol, is `drop`ped: every
later wait on it raises, with the first reason recorded, while every other peer's channels
stay as they are. The dicts here are the endpoint's own (`Endpoint.outbound`, `.inbound`,
`.choices`): they are emptied and refilled, never replaced.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from functools import partial

from transport.core_tcp import CoreTcpInbound
from transport.errors import PeerClosed, PeerTimeout, ProtocolViolation
from transport.peering import Acceptor, dial
from transport.selection import Choice
from transport.tcp import TcpInbound, TcpOutbound
from transport.wakeups import Wakeups

__all__ = ["PeerChannels"]

# The endpoint's logger: the pair choices and protocol violations logged here are the endpoint's.
logger = logging.getLogger("transport.endpoint")


class PeerChannels:
    """The channels of one endpoint to and from its peers, their set-up and teardown, and the
    peers found gone (`dead`: peer -> the first reason) or dropped for breaking the protocol
    (`violators`: never read again)."""

    def __init__(self, spec, backends, listener: socket.socket, wakeups: Wakeups) -> None:
        self.spec = spec
        self.backends = backends
        self.listener = listener
        self.wakeups = wakeups
        self.outbound: dict[str, object] = {}
        self.inbound: dict[str, object] = {}
        self.seq: dict[str, int] = {}  # peer -> the sequence number of the next message to it
        self.choices: dict[str, Choice] = {}  # peer -> the backend its pair uses and why
        self.dead: dict[str, str] = {}  # peer -> why it is gone (the first reason)
        self.violators: set[str] = set()  # peers dropped for breaking the protocol: never read again

    # -- set-up ----------------------------------------------------------------------------
    def connect(self, peers: dict[str, str]) -> None:
        """Authenticate a connection to and from every peer; returns when all are up."""
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
                self.seq[peer] = 0
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

    def watch(self, collect) -> None:
        """Has the wakeups watch the doorbell and every connection: inbound tcp data is read
        into its slots (`collect(peer)`), tcp credits taken, and any other control connection
        (shm, rdma, nixl), which says something only when it closes, checked for that."""
        doorbell = self.backends.doorbell
        if doorbell is not None:
            self.wakeups.watch(doorbell.sock, lambda sock: doorbell.drain())
        for peer, ch in self.inbound.items():
            if isinstance(ch, CoreTcpInbound):  # read into the core; a round or a receive takes it there
                handler = partial(self._admit, peer)
            elif isinstance(ch, TcpInbound):
                handler = lambda sock, peer=peer: collect(peer)  # noqa: E731
            else:
                handler = partial(self._notice_closed, peer)
            self.wakeups.watch(ch.control, handler)
        for peer, ch in self.outbound.items():
            self.wakeups.watch(ch.control, partial(self._take_credits if isinstance(ch, TcpOutbound)
                                                   else self._notice_closed, peer))

    def kinds(self) -> set[str]:
        """The backends of the channels now connected."""
        return {ch.kind for ch in list(self.inbound.values()) + list(self.outbound.values())}

    # -- peers gone --------------------------------------------------------------------------
    def drop(self, peer: str, exc: PeerClosed, quiet_socket: socket.socket | None = None) -> None:
        """`peer` is gone: waits on it raise PeerClosed with the first reason recorded. A peer
        that broke the protocol also has its connections shut (it sees them drop) and is never
        read again; every other peer's channels, slots and pending messages stay as they are.
        `quiet_socket`, a connection at its end, stops waking the selector."""
        if quiet_socket is not None:
            self.wakeups.unwatch(quiet_socket)
        if peer not in self.dead:
            self.dead[peer] = str(exc)
        if isinstance(exc, ProtocolViolation) and peer not in self.violators:
            logger.warning("endpoint %s: %s", self.spec.name, exc)
            self.violators.add(peer)
            for channel in (self.inbound.get(peer), self.outbound.get(peer)):
                if channel is not None and channel.control is not None:
                    self.wakeups.unwatch(channel.control)
                    try:
                        channel.control.shutdown(socket.SHUT_RDWR)
                    except OSError:  # already gone
                        pass

    def check_alive(self, peers) -> None:
        """A wait on one peer fails as soon as it is dead; a wait on any of several, once all are."""
        dead = [p for p in peers if p in self.dead]
        if dead and (len(peers) == 1 or len(dead) == len(peers)):
            error = ProtocolViolation if self.violators.issuperset(dead) else PeerClosed
            raise error(f"endpoint {self.spec.name}: " + "; ".join(self.dead[p] for p in dead))

    def dead_error(self, peer: str) -> PeerClosed:
        error = ProtocolViolation if peer in self.violators else PeerClosed
        return error(f"endpoint {self.spec.name}: {self.dead[peer]}")

    def _take_credits(self, peer: str, sock: socket.socket) -> None:
        try:
            self.outbound[peer].drain_credits()
        except PeerClosed as exc:
            self.drop(peer, exc, sock)

    def _admit(self, peer: str, sock: socket.socket) -> None:
        if peer in self.dead:
            return
        try:
            self.inbound[peer].admit()
        except PeerClosed as exc:
            self.drop(peer, exc, sock)

    def _notice_closed(self, peer: str, sock: socket.socket) -> None:
        try:
            alive = sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b""
        except BlockingIOError:
            alive = True
        except OSError:
            alive = False
        if not alive:
            self.drop(peer, PeerClosed(f"peer {peer} closed its connection (process exited or shut down)"), sock)

    # -- teardown ----------------------------------------------------------------------------
    def close(self) -> None:
        """Closes every channel (and the control connections tcp does not own) and empties the set."""
        for ch in list(self.outbound.values()) + list(self.inbound.values()):
            ch.close()
            if getattr(ch, "control", None) is not None and ch.kind != "tcp":
                ch.control.close()
        self.outbound.clear()
        self.inbound.clear()
        self.seq.clear()
        self.dead.clear()
        self.violators.clear()
        self.choices.clear()

    def sever(self) -> None:
        """Shuts every connection down as a failing network would (fault injection)."""
        for ch in list(self.outbound.values()) + list(self.inbound.values()):
            for sock in {getattr(ch, "sock", None), getattr(ch, "control", None)} - {None}:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:  # already closed
                    pass
