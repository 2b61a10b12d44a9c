"""TCP channels: peers on other hosts (or anywhere, when asked for).

One persistent connection per direction and peer; the authenticated control connection
becomes the data connection. The sender writes header and payload with `sendmsg`; the
receiver reads the header, then the payload straight into the slot its micro-batch
selects. Released slots flow back as credit frames on the same connection, so a sender
never overwrites a slot its consumer still holds.

Full duplex by construction: nothing here blocks on the network. A send writes what the
kernel takes now and keeps the rest (`unsent`); the endpoint finishes it while reading
every inbound connection (`SendWaits.until_sent`), so two nodes sending each other
multi-megabyte messages at once (the ping-pong with m >= 2) both make progress instead of
both waiting in `sendmsg` for a reader. Reads are non-blocking too (a small state
machine), so the endpoint's single thread can wait on many connections at once. Socket
buffers are left to the kernel's autotuning unless a size is configured: setting them
turns autotuning off and caps them near the kernel's maximum (about 200 KB by default).

Every header is checked (transport/wire_rules.py) before a payload byte is read into a slot,
so a misbehaving peer cannot write into a slot still held; a credit is checked before it
frees a slot; a connection that closes in the middle of a message is a protocol violation.
"""

from __future__ import annotations

import socket

from transport.errors import PeerClosed
from transport.wire import CREDIT, CREDIT_MAGIC, HEADER, HEADER_BYTES, Header
from transport.wire_rules import InboundRules, broke

READ_CHUNK = 1 << 20  # a waiting endpoint wakes for a large payload once this much of it has arrived


def tune(sock: socket.socket, buffer_bytes: int | None) -> None:
    """No Nagle delay (headers are small and latency-bound); socket buffers of `buffer_bytes`
    when given, else the kernel's autotuning."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if buffer_bytes:
        for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            sock.setsockopt(socket.SOL_SOCKET, opt, buffer_bytes)


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

    def __init__(self, peer: str, sender: int, slot_bytes: int, num_slots: int, sock: socket.socket) -> None:
        self.peer = peer
        self.slot_bytes = slot_bytes
        self.num_slots = num_slots
        self.sock = sock
        self.control = sock
        self.rules = InboundRules(peer, sender, slot_bytes, num_slots)
        self.buffer = bytearray(slot_bytes * num_slots)
        self.view = memoryview(self.buffer)
        self._header = bytearray(HEADER_BYTES)
        self._got = 0  # bytes of the current header (while _current is None) or payload
        self._current: Header | None = None
        self._slot = 0  # the slot the current message is read into
        self._failure: PeerClosed | None = None  # met after messages that the last poll returned
        self._mark = 1  # the socket's receive low-water mark (bytes)

    @property
    def outstanding(self) -> int:
        """Messages received whole and not released yet (a message still arriving is not one)."""
        return len(self.rules.held) - (self._current is not None)

    def poll(self) -> list[tuple[int, Header]]:
        """Read whatever has arrived; return the messages it completed. A failure after some
        completed is raised by the next poll, once they are handed out."""
        if self._failure is not None:
            raise self._failure.with_traceback(None)
        done: list[tuple[int, Header]] = []
        try:
            while True:
                if self._current is None:
                    n = self._read(memoryview(self._header)[self._got:])
                    if n is None:
                        return done
                    self._got += n
                    if self._got < HEADER_BYTES:
                        continue
                    self._slot, self._current = self.rules.admit(HEADER.unpack_from(self._header))
                    self._got = 0
                h = self._current
                if self._got < h.byte_length:
                    self._low_water(h.byte_length - self._got)
                    start = self._slot * self.slot_bytes
                    n = self._read(self.view[start + self._got:start + h.byte_length])
                    if n is None:
                        return done
                    self._got += n
                    if self._got < h.byte_length:
                        continue
                done.append((self._slot, h))
                self._current, self._got = None, 0
                self._low_water(1)
        except PeerClosed as exc:
            if not done:
                raise
            self._failure = exc
            return done

    def _low_water(self, remaining: int) -> None:
        """Wake a waiting endpoint only once a large payload's next chunk is in (SO_RCVLOWAT):
        fewer, larger reads than waking for every segment, while the sender still has CPU."""
        mark = min(remaining, READ_CHUNK)
        if mark != self._mark:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, mark)
            self._mark = mark

    def _read(self, into: memoryview) -> int | None:
        try:
            return read_available(self.sock, into, self.peer)
        except PeerClosed:
            if self._current is None and not self._got:
                raise  # between messages: an ordinary close
            part = f"{self._got} of {self._current.byte_length} payload bytes" if self._current is not None else \
                f"{self._got} of {HEADER_BYTES} header bytes"
            raise broke(self.peer, f"the connection closed in the middle of a message ({part} arrived)") from None

    def payload(self, slot: int, length: int) -> memoryview:
        return self.view[slot * self.slot_bytes:slot * self.slot_bytes + length]

    def release(self, slot: int) -> None:
        self.rules.free(slot)
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
        self._unsent: list[memoryview] = []  # the current message's bytes the kernel has not taken yet

    @property
    def unsent(self) -> int:
        return sum(len(part) for part in self._unsent)

    def drain_credits(self) -> None:
        while True:
            n = read_available(self.sock, memoryview(self._credits), self.peer)
            if n is None:
                return
            data = self._pending + bytes(self._credits[:n])
            whole = len(data) - len(data) % CREDIT.size
            for off in range(0, whole, CREDIT.size):
                magic, slot, reserved = CREDIT.unpack_from(data, off)
                if magic != CREDIT_MAGIC or reserved or slot >= self.num_slots or not self.busy[slot]:
                    in_use = "in use" if slot < self.num_slots and self.busy[slot] else "not in use"
                    raise broke(self.peer, f"malformed credit frame {data[off:off + CREDIT.size].hex()} (magic "
                                           f"0x{magic:08x}, slot {slot} of {self.num_slots}, {in_use})")
                self.busy[slot] = False
            self._pending = data[whole:]

    def unreleased(self) -> int:
        """Slots sent into whose credit has not come back, after reading the credits waiting."""
        self.drain_credits()
        return sum(self.busy)

    def try_send(self, header: Header, payload) -> bool:
        """Start sending a message into its slot: False while the peer holds the slot; True once
        started, with what the kernel did not take yet left in `unsent` (see `flush`)."""
        if self._unsent:
            raise RuntimeError(f"a message to {self.peer} is still being sent: flush it first")
        slot = header.micro_batch % self.num_slots
        if self.busy[slot]:
            self.drain_credits()
            if self.busy[slot]:
                return False
        self.busy[slot] = True
        self._unsent = [memoryview(header.pack())] + ([memoryview(payload)] if header.byte_length else [])
        self.flush()
        return True

    def flush(self) -> bool:
        """Write what the kernel takes now of the current message, never waiting; True once it
        is all out."""
        while self._unsent:
            try:
                sent = self.sock.sendmsg(self._unsent, [], socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                return False
            except (BrokenPipeError, ConnectionError) as exc:
                raise PeerClosed(f"peer {self.peer} is gone ({exc})") from None
            while sent and self._unsent:
                part = self._unsent[0]
                if sent >= len(part):
                    sent -= len(part)
                    self._unsent.pop(0)
                else:
                    self._unsent[0] = part[sent:]
                    sent = 0
        return True

    def close(self) -> None:
        self.sock.close()
