"""The floors: the same bytes moved the same way with no protocol, the lower bound M2N is
judged against. shm: a copy into shared memory and a spinning flag; tcp: bare sendall and
recv_into on plain sockets; rdma: bare write-with-immediate; nixl: one prepared NIXL write
per message with a notification, re-posted each iteration. Each floor plugs into
transport.bench_loop.loop as the M2N runner does.
"""

from __future__ import annotations

import mmap
import os
import socket
import struct
import threading

from transport.bench_loop import loop, recv, send
from transport.bench_spec import STAMP, BenchSpec, Role, names, now_ns

FLOOR_FLAG = struct.Struct("<Q")


def _map(path: str, size: int) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR)
    try:
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


def run_floor_shm(role: Role, spec: BenchSpec, conn) -> None:
    """Raw shared memory per (sender, receiver) pair and direction: [flag u64 | 56 reserved |
    payload]. A writer waits for the flag to clear, copies in and sets it; the reader spins on
    it, reads the stamp and clears it. Acknowledgements (and ping-pong's echo, and the reverse
    direction of a duplex run) go through the pair's reverse region."""
    senders, receivers = names(spec)
    others = receivers if role.sender else senders
    size = 64 + max(spec.sizes)
    pair = {peer: f"{role.name}-{peer}" if role.sender else f"{peer}-{role.name}" for peer in others}
    forward = {peer: _map(role.extra["regions"][pair[peer]], size) for peer in others}
    back = {peer: _map(role.extra["regions"]["back-" + pair[peer]], size) for peer in others}
    outgoing = forward if role.sender else back  # where this process writes its messages
    incoming = back if role.sender else forward
    sent_at = [0]

    def spin_until(region, value):
        while FLOOR_FLAG.unpack_from(region, 0)[0] != value:
            os.sched_yield()

    def write(region, payload, it):
        spin_until(region, 0)  # the previous message in this region has been read
        region[64:64 + len(payload)] = payload
        FLOOR_FLAG.pack_into(region, 0, it + 1)

    def send_all(payload, it):
        sent_at[0] = now_ns()  # one stamp per round, as M2N's rounds are timed
        STAMP.pack_into(payload, 0, sent_at[0])
        for peer in others:
            write(outgoing[peer], payload, it)

    def wait_acks(it, size):
        for peer in others:
            spin_until(back[peer], it + 1)
            FLOOR_FLAG.pack_into(back[peer], 0, 0)
        return now_ns() - sent_at[0]

    def receive_all(it, size):
        stamps = []
        pending = list(others)
        while pending:
            for peer in list(pending):
                r = incoming[peer]
                if FLOOR_FLAG.unpack_from(r, 0)[0] == it + 1:
                    stamps.append(STAMP.unpack_from(r, 64)[0])
                    FLOOR_FLAG.pack_into(r, 0, 0)  # read: the writer may reuse the region
                    pending.remove(peer)
            if pending:
                os.sched_yield()
        done = now_ns()  # the round is in: every message's latency ends here, as M2N's collect does
        return [done - stamp for stamp in stamps]

    def ack_all(it, echo):
        for peer in others:
            write(back[peer], echo if echo is not None else b"", it)

    loop(role, spec, conn, send_all, receive_all, ack_all, wait_acks)


def run_floor_tcp(role: Role, spec: BenchSpec, conn) -> None:
    """Plain sockets, one per pair: sendall the bytes, recv_into them, an 8-byte ack back. In
    a duplex run the sends go from a thread, as a plain-socket program must to avoid both
    ends blocking in sendall."""
    senders, receivers = names(spec)
    socks = _tcp_pairs(role, conn, senders, receivers)
    others = receivers if role.sender else senders
    buffers: dict[int, bytearray] = {}  # size -> receive buffer
    ack = bytes(8)
    sent_at = [0]
    sender: list[threading.Thread] = []

    def send_each(payload):
        sent_at[0] = now_ns()  # one stamp per round, as M2N's rounds are timed
        STAMP.pack_into(payload, 0, sent_at[0])
        for peer in others:
            socks[peer].sendall(payload)

    def send_all(payload, it):
        if spec.duplex:
            sender[:] = [threading.Thread(target=send_each, args=(payload,), daemon=True)]
            sender[0].start()
        else:
            send_each(payload)

    def wait_acks(it, size):
        for peer in others:
            _recv_into_exact(socks[peer], buffers.setdefault(size, bytearray(size)) if spec.pattern == "ping-pong"
                             else bytearray(8))
        return now_ns() - sent_at[0]

    def receive_all(it, size):
        buf = buffers.setdefault(size, bytearray(size))
        stamps = []
        for peer in others:
            _recv_into_exact(socks[peer], buf)
            stamps.append(STAMP.unpack_from(buf, 0)[0])
        done = now_ns()  # the round is in
        if sender:
            sender.pop().join()
        return [done - stamp for stamp in stamps]

    def ack_all(it, echo):
        for peer in others:
            socks[peer].sendall(echo if echo is not None else ack)

    loop(role, spec, conn, send_all, receive_all, ack_all, wait_acks)
    for s in socks.values():
        s.close()


def _tcp_pairs(role: Role, conn, senders, receivers) -> dict[str, socket.socket]:
    """The tcp floor's sockets, peer -> socket: a sender dials every receiver (the addresses
    come through `conn`) and names itself in 16 bytes; a receiver accepts every sender."""
    socks = {}
    if role.sender:
        peers = recv(conn)["peers"]
        for peer in receivers:
            host, port = peers[peer].rsplit(":", 1)
            s = socket.create_connection((host, int(port)))
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            s.sendall(role.name.encode().ljust(16))
            socks[peer] = s
    else:
        listener = socket.create_server(("127.0.0.1", 0))
        send(conn, {"address": "127.0.0.1:%d" % listener.getsockname()[1]})
        for _ in senders:
            s, _ = listener.accept()
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            name = _recv_exact(s, 16).decode().strip()
            socks[name] = s
        listener.close()
    return socks


def run_floor_rdma(role: Role, spec: BenchSpec, conn) -> None:
    """Bare write-with-immediate: the M2N rdma channel's verbs with no header, slots or credits
    beyond one outstanding message per pair (acks are writes-with-immediate too)."""
    from transport.rdma import RdmaContext, _QueuePair
    from transport.wire import QPInfo

    if spec.duplex:
        raise ValueError("the rdma floor has no duplex mode (one region per pair serves both directions)")
    senders, receivers = names(spec)
    others = receivers if role.sender else senders
    rc = RdmaContext.open()
    qps = {peer: _QueuePair(rc, max(spec.sizes) + 64, 1) for peer in others}
    send(conn, {"qp": {peer: qp.info().pack().hex() for peer, qp in qps.items()}})
    remote = recv(conn)["qp"]
    for peer, qp in qps.items():
        qp.to_rts(QPInfo.unpack(bytes.fromhex(remote[peer][role.name])))
    sent_at = [0]

    def wait_for(qp, peer):
        while not qp.completions(peer):
            pass

    def send_all(payload, it):
        sent_at[0] = now_ns()  # one stamp per round, as M2N's rounds are timed
        STAMP.pack_into(payload, 0, sent_at[0])
        for peer, qp in qps.items():
            qp.mr.write(bytes(payload), len(payload), 96)
            qp.write_with_imm(96, len(payload), 96, 0)

    def wait_acks(it, size):
        for peer, qp in qps.items():
            wait_for(qp, peer)
        return now_ns() - sent_at[0]

    def receive_all(it, size):
        stamps = []
        for peer, qp in qps.items():
            wait_for(qp, peer)
            stamps.append(STAMP.unpack_from(qp.mr.read(8, 96), 0)[0])
        done = now_ns()  # the round is in
        return [done - stamp for stamp in stamps]

    def ack_all(it, echo):
        for peer, qp in qps.items():
            if echo is not None:
                qp.mr.write(bytes(echo), len(echo), 96)
            qp.write_with_imm(96, len(echo) if echo is not None else 0, 96, 0)

    loop(role, spec, conn, send_all, receive_all, ack_all, wait_acks)
    for qp in qps.values():
        qp.close()
    rc.close()


def run_floor_nixl(role: Role, spec: BenchSpec, conn) -> None:
    """One NIXL agent per process; per peer a registered inbox (the peer writes into it) and a
    registered outbox (this process writes from it). A message is one WRITE prepared once per
    size and parity and re-posted, polled until done, its notification the signal; an
    acknowledgement is a bare notification. Iterations alternate between two halves of the
    inbox: a duplex peer may write iteration i+1 before this process has read i."""
    import torch

    senders, receivers = names(spec)
    others = receivers if role.sender else senders
    largest = max(spec.sizes)
    agent, inbox, outbox, inbox_address, peer_agent = _nixl_regions(role, conn, others, largest)
    api = agent.agent
    writes = _PreparedWrites(api, outbox, inbox_address, peer_agent, largest)
    write = writes.write
    arrived: dict[str, int] = {peer: 0 for peer in others}
    sent_at = [0]

    def wait_notes(kind: bytes) -> None:
        while any(arrived[p] == 0 for p in others):
            os.sched_yield()
            for name, notes in api.get_new_notifs().items():
                name = name.decode() if isinstance(name, bytes) else name
                peer = next(p for p, a in peer_agent.items() if a == name)
                arrived[peer] += sum(1 for n in notes if n[:1] == kind)
        for p in others:
            arrived[p] -= 1

    def send_all(payload, it):
        for peer in others:
            sent_at[0] = now_ns()
            STAMP.pack_into(payload, 0, sent_at[0])
            outbox[peer][:len(payload)] = torch.frombuffer(payload, dtype=torch.uint8)
            write(peer, len(payload), it)

    def wait_acks(it, size):
        wait_notes(b"m" if spec.pattern == "ping-pong" else b"a")
        return now_ns() - sent_at[0]

    def receive_all(it, size):
        wait_notes(b"m")
        t1 = now_ns()
        return [t1 - STAMP.unpack_from(inbox[p].numpy(), it % 2 * largest)[0] for p in others]

    def ack_all(it, echo):
        for peer in others:
            if echo is not None:
                outbox[peer][:len(echo)] = torch.frombuffer(echo, dtype=torch.uint8)
                write(peer, len(echo), it)
            else:
                api.send_notif(peer_agent[peer], b"a")

    loop(role, spec, conn, send_all, receive_all, ack_all, wait_acks)
    writes.release(agent)
    agent.close()


def _nixl_regions(role: Role, conn, others, largest: int):
    """The nixl floor's set-up: this process's agent, and per peer a registered inbox (two
    halves of `largest` bytes) and outbox, the metadata and inbox addresses swapped through
    `conn`. Returns (agent, inbox, outbox, peer -> its inbox's address for this process,
    peer -> its agent's name)."""
    import torch

    from transport.nixl import NixlAgent

    agent = NixlAgent(role.name)
    inbox = {peer: torch.zeros(2 * largest, dtype=torch.uint8) for peer in others}
    outbox = {peer: torch.zeros(largest, dtype=torch.uint8) for peer in others}
    for region in list(inbox.values()) + list(outbox.values()):
        agent.register(region)
    send(conn, {"nixl": {"metadata": agent.metadata(), "inbox": {p: t.data_ptr() for p, t in inbox.items()}}})
    remote = recv(conn)["nixl"]  # peer -> its metadata and its inbox address for this process
    peer_agent = {peer: agent.add_peer(remote[peer]["metadata"]) for peer in others}
    return agent, inbox, outbox, {peer: remote[peer]["inbox"] for peer in others}, peer_agent


class _PreparedWrites:
    """The nixl floor's messages: one WRITE per (peer, size, parity), prepared the first time
    and re-posted after, from the peer's outbox into that parity's half of its inbox; each
    post is polled until done."""

    def __init__(self, api, outbox: dict, inbox_address: dict[str, int], peer_agent: dict[str, str],
                 largest: int) -> None:
        self.api, self.outbox, self.inbox_address, self.peer_agent = api, outbox, inbox_address, peer_agent
        self.largest = largest
        self.handles: dict[tuple[str, int, int], object] = {}  # (peer, size, parity) -> prepared transfer

    def write(self, peer: str, size: int, it: int) -> None:
        api, key = self.api, (peer, size, it % 2)
        if key not in self.handles:
            local = api.get_xfer_descs([(self.outbox[peer].data_ptr(), size, 0)], "DRAM")
            far = api.get_xfer_descs([(self.inbox_address[peer] + it % 2 * self.largest, size, 0)], "DRAM")
            self.handles[key] = api.initialize_xfer("WRITE", local, far, self.peer_agent[peer], b"m")
        handle = self.handles[key]
        state = api.transfer(handle, b"m")
        while state == "PROC":
            os.sched_yield()  # four processes share two cores here: let the receiving one run
            state = api.check_xfer_state(handle)
        if state != "DONE":
            raise ConnectionError(f"nixl write to {peer} failed")

    def release(self, agent) -> None:
        for handle in self.handles.values():
            agent.writes.release(handle)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    _recv_into_exact(sock, buf)
    return bytes(buf)


def _recv_into_exact(sock: socket.socket, buf: bytearray) -> None:
    view, got = memoryview(buf), 0
    while got < len(buf):
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError("peer closed")
        got += k


FLOOR_RUNNERS = {"shm": run_floor_shm, "tcp": run_floor_tcp, "rdma": run_floor_rdma, "nixl": run_floor_nixl}
