"""How two endpoints become a peer pair: the connecting side dials the other's control
listener, both authenticate (transport/handshake.py), the connecting side says hello
(`wire.Hello`), and the accepting side checks it, chooses the pair's backend
(transport/selection.py) and acknowledges; the backend's channel is then built on the same
connection.

The listener serves each connection on a thread of its own, at most MAX_HANDSHAKES at once,
with HANDSHAKE_TIMEOUT_S to authenticate and say hello: a stranger, a garbage or truncated
frame, a replayed transcript (the fresh nonce makes its proof wrong), a malformed hello or a
peer that stalls mid-handshake is refused and logged, and never keeps a real peer waiting
for long or stops the listener.
"""

from __future__ import annotations

import logging
import socket
import threading
import time

from transport.backends import BackendSet
from transport.errors import BackendUnavailable, HandshakeError, PeerTimeout
from transport.handshake import authenticate
from transport.selection import Choice, NoBackend, choose
from transport.wire import Hello, recv_json, send_json

logger = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT_S = 5.0  # to authenticate and say hello; a real peer takes milliseconds
MAX_HANDSHAKES = 32  # connections served at once; more wait in the listen backlog
CHANNEL_KINDS = ("shm", "tcp", "rdma", "nixl")
MAX_REASON = 1000  # characters of a peer's stated reason or refusal kept


def parse_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"address {address!r} is not host:port")
    return host.strip("[]"), int(port)


def dial(me: str, rank: int, wanted: str, secret: bytes, backends: BackendSet, peer: str, address: str,
         channel_id: int, deadline: float, timeout_s: float):
    """This endpoint -> `peer` at `address`: (the outbound channel, the backend choice the peer made)."""
    host, port = parse_address(address)
    while True:
        try:
            sock = socket.create_connection((host, port), timeout=max(0.05, deadline - time.monotonic()))
            break
        except (ConnectionRefusedError, socket.timeout, OSError) as exc:
            if time.monotonic() >= deadline:
                raise PeerTimeout(f"endpoint {me}: cannot reach peer {peer} at {address} within {timeout_s:g} s "
                                  f"({exc})") from None
            time.sleep(0.02)
    try:
        sock.settimeout(max(0.05, deadline - time.monotonic()))
        authenticate(sock, secret, initiator=True)
        send_json(sock, backends.hello(me, rank, wanted, channel_id).fields())
        ack = recv_json(sock)
        if ack.get("ok") is not True:
            raise HandshakeError(f"peer {peer} refused endpoint {me}: {str(ack.get('error'))[:MAX_REASON]}")
        if ack.get("name") != peer:
            raise HandshakeError(f"the endpoint at {address} is {str(ack.get('name'))[:80]!r}, not {peer!r}")
        kind = ack.get("backend")
        if kind not in CHANNEL_KINDS:
            raise HandshakeError(f"peer {peer} chose backend {str(kind)[:40]!r}, not one of {', '.join(CHANNEL_KINDS)}")
        choice = Choice(kind, str(ack.get("reason", ""))[:MAX_REASON])
        channel = backends.outbound(kind, peer, channel_id, ack, sock)
        sock.settimeout(None)
        return channel, choice
    except (OSError, KeyError, ValueError, TypeError) as exc:
        sock.close()
        raise HandshakeError(f"endpoint {me}: handshake with {peer} at {address} failed ({exc!r})") from None
    except BaseException:
        sock.close()
        raise


class Acceptor:
    """Accepts the expected peers on `listener` until each has a channel or the deadline
    passes (`run`, on a thread of its own); `accepted` then maps peer name -> inbound channel."""

    def __init__(self, me: str, wanted: str, secret: bytes, backends: BackendSet, listener: socket.socket,
                 expected: set[str], deadline: float, slot_bytes: int, num_slots: int) -> None:
        self.me, self.wanted, self.secret, self.backends, self.listener = me, wanted, secret, backends, listener
        self.expected, self.deadline = expected, deadline
        self.slot_bytes, self.num_slots = slot_bytes, num_slots
        self.accepted: dict[str, object] = {}
        self.errors: list[BaseException] = []  # the listener's own failures (surfaced by connect)
        self._claimed: set[str] = set()  # names being set up or accepted: one channel per peer
        self._finished = False
        self._lock = threading.Lock()
        self._handshakes = threading.BoundedSemaphore(MAX_HANDSHAKES)

    def run(self) -> None:
        self.listener.settimeout(0.1)
        try:
            while not self._all_in() and time.monotonic() < self.deadline:
                if not self._handshakes.acquire(timeout=0.1):
                    continue
                try:
                    sock, addr = self.listener.accept()
                except socket.timeout:
                    self._handshakes.release()
                    continue
                threading.Thread(target=self._serve, args=(sock, addr), daemon=True,
                                 name=f"m2n-handshake-{self.me}").start()
        except BaseException as exc:  # surfaced by connect()
            self.errors.append(exc)
        finally:
            with self._lock:
                self._finished = True

    def _all_in(self) -> bool:
        with self._lock:
            return set(self.accepted) == self.expected

    def _serve(self, sock: socket.socket, addr) -> None:
        """One connection, whatever it sends: a channel for an expected peer, else a refusal
        in the log. Nothing it does reaches the listener or another connection."""
        try:
            self._handshake(sock)
        except Exception as exc:  # noqa: BLE001 - a connection's failure ends with that connection
            what = str(exc) if isinstance(exc, (HandshakeError, BackendUnavailable)) else f"{type(exc).__name__}: {exc}"
            logger.warning("endpoint %s refused a connection from %s: %s", self.me, addr, what[:MAX_REASON])
            sock.close()
        finally:
            self._handshakes.release()

    def _handshake(self, sock: socket.socket) -> None:
        sock.settimeout(max(0.05, min(HANDSHAKE_TIMEOUT_S, self.deadline - time.monotonic())))
        authenticate(sock, self.secret, initiator=False)
        hello = Hello.parse(recv_json(sock))
        if not self._claim(hello.name):
            send_json(sock, {"ok": False, "error": f"{hello.name!r} is not an expected peer of {self.me} or is "
                                                   "already connected"})
            raise HandshakeError(f"unexpected or duplicate peer {hello.name!r}")
        try:
            sock.settimeout(max(0.05, self.deadline - time.monotonic()))
            channel, choice = self._open(sock, hello)
            sock.settimeout(None)
        except BaseException:
            with self._lock:
                self._claimed.discard(hello.name)
            raise
        with self._lock:
            late = self._finished
            if not late:
                self.accepted[hello.name] = channel
        if late:
            channel.close()
            raise HandshakeError(f"peer {hello.name} finished its handshake after connect() gave up waiting")
        logger.info("endpoint %s <- %s over %s (%s)", self.me, hello.name, choice.backend, choice.reason)

    def _claim(self, name: str) -> bool:
        with self._lock:
            if name not in self.expected or name in self._claimed or self._finished:
                return False
            self._claimed.add(name)
            return True

    def _open(self, sock: socket.socket, hello: Hello):
        try:
            choice = choose(self.wanted, hello.backend, self.backends.capabilities,
                            self.backends.peer_capabilities(hello), self.me, hello.name)
        except NoBackend as exc:
            send_json(sock, {"ok": False, "error": str(exc)})
            raise BackendUnavailable(str(exc)) from None
        ack = {"ok": True, "name": self.me, "backend": choice.backend, "reason": choice.reason,
               "slot_bytes": self.slot_bytes, "num_slots": self.num_slots}
        return self.backends.inbound(choice.backend, hello, ack, sock), choice
