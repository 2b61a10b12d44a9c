"""TCP channels: peers on other hosts (or anywhere, when asked for).

One persistent connection per direction and peer; the authenticated control connection
becomes the data connection. The sender writes header and payload with one `sendmsg`;
the receiver reads the header, then the payload straight into the slot its micro-batch
selects. Released slots flow back as credit frames on the same connection, so a sender
never overwrites a slot its consumer still holds.

Both ends read without blocking (a small state machine), so the endpoint's single
thread can wait on many connections at once.
"""

from __future__ import annotations

import socket

from transport.errors import PeerClosed
from transport.wire import CREDIT, CREDIT_MAGIC, HEADER_BYTES, Header


def tune(sock: socket.socket, slot_bytes: int) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    # Room for a couple of slots in flight without the sender stalling on the kernel.
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, max(4 * slot_bytes, 1 << 20))
        except OSError:
            pass


def read_available(sock: socket.socket, into: memoryview, peer: str) -> int | None:
    """Bytes read without blocking, None if none are waiting; PeerClosed when the peer is gone."""
    try:
        n = sock.recv_into(into, len(into), socket.MSG_DONTWAIT)
    except BlockingIOError:
        return None
    except ConnectionError as exc:
        raise PeerClosed(f"peer {peer} dropped the connection ({exc})") from None
    if n == 0:
        raise PeerClosed(f"peer {peer} closed its connection (process exited or shut down)")
    return n


class TcpInbound:
    """peer -> this endpoint."""

    kind = "tcp"

    def __init__(self, peer: str, slot_bytes: int, num_slots: int, sock: socket.socket) -> None:
        self.peer = peer
        self.slot_bytes = slot_bytes
        self.num_slots = num_slots
        self.sock = sock
        self.control = sock
        self.buffer = bytearray(slot_bytes * num_slots)
        self.view = memoryview(self.buffer)
        self._header = bytearray(HEADER_BYTES)
        self._got = 0  # bytes of the current header (while _current is None) or payload
        self._current: Header | None = None

    def poll(self) -> list[tuple[int, Header]]:
        """Read whatever has arrived; return the messages it completed."""
        done = []
        while True:
            if self._current is None:
                n = self._read(memoryview(self._header)[self._got:])
                if n is None:
                    return done
                self._got += n
                if self._got < HEADER_BYTES:
                    continue
                self._current, self._got = Header.unpack_from(self._header), 0
                if self._current.byte_length > self.slot_bytes:
                    raise PeerClosed(f"peer {self.peer} sent {self._current.byte_length} bytes into a "
                                     f"{self.slot_bytes}-byte slot: protocol violation, connection dropped")
            h = self._current
            if self._got < h.byte_length:
                slot = h.micro_batch % self.num_slots
                start = slot * self.slot_bytes + self._got
                n = self._read(self.view[start:slot * self.slot_bytes + h.byte_length])
                if n is None:
                    return done
                self._got += n
                if self._got < h.byte_length:
                    continue
            done.append((h.micro_batch % self.num_slots, h))
            self._current, self._got = None, 0

    def _read(self, into: memoryview) -> int | None:
        return read_available(self.sock, into, self.peer)

    def payload(self, slot: int, length: int) -> memoryview:
        return self.view[slot * self.slot_bytes:slot * self.slot_bytes + length]

    def release(self, slot: int) -> None:
        try:
            self.sock.sendall(CREDIT.pack(CREDIT_MAGIC, slot, 0))
        except OSError:
            pass  # the peer is gone; its own side reports it

    def close(self) -> None:
        self.sock.close()


class TcpOutbound:
    """this endpoint -> peer."""

    kind = "tcp"

    def __init__(self, peer: str, slot_bytes: int, num_slots: int, sock: socket.socket) -> None:
        self.peer = peer
        self.slot_bytes = slot_bytes
        self.num_slots = num_slots
        self.sock = sock
        self.control = sock
        self.busy = [False] * num_slots  # slot sent into and not yet credited back
        self._credits = bytearray(CREDIT.size * 64)
        self._pending = b""

    def drain_credits(self) -> None:
        while True:
            n = read_available(self.sock, memoryview(self._credits), self.peer)
            if n is None:
                return
            data = self._pending + bytes(self._credits[:n])
            whole = len(data) - len(data) % CREDIT.size
            for off in range(0, whole, CREDIT.size):
                magic, slot, _ = CREDIT.unpack_from(data, off)
                if magic != CREDIT_MAGIC or slot >= self.num_slots:
                    raise PeerClosed(f"peer {self.peer} sent a malformed credit frame; connection dropped")
                self.busy[slot] = False
            self._pending = data[whole:]

    def try_send(self, header: Header, payload) -> bool:
        slot = header.micro_batch % self.num_slots
        if self.busy[slot]:
            self.drain_credits()
            if self.busy[slot]:
                return False
        head = header.pack()
        try:
            sent = self.sock.sendmsg([head, payload] if header.byte_length else [head])
            if sent < HEADER_BYTES + header.byte_length:  # the kernel took part: finish in place
                if sent < HEADER_BYTES:
                    self.sock.sendall(head[sent:])
                    sent = HEADER_BYTES
                self.sock.sendall(payload[sent - HEADER_BYTES:])
        except (BrokenPipeError, ConnectionError) as exc:
            raise PeerClosed(f"peer {self.peer} is gone ({exc})") from None
        self.busy[slot] = True
        return True

    def close(self) -> None:
        self.sock.close()
