"""The M2N microbenchmark: M senders and N receivers as separate processes.

One measurement protocol for every system, so the numbers compare:
  m2n / one-to-n  each iteration every sender writes one message of `size` bytes (its
                  first 8 bytes the send time, CLOCK_MONOTONIC ns) to every receiver, then
                  waits for an empty acknowledgement from each; a receiver records one-way
                  latency (receive time minus send time) per message, then acknowledges.
  ping-pong       1x1: A sends, B echoes the same bytes back; latency is half the round trip.
Throughput is the payload bytes of the timed iterations over their wall time, across all
processes (clocks are one host's monotonic clock).

Systems: `m2n` (an Endpoint over shm, tcp or rdma), `torch` (transport.baseline,
batch_isend_irecv over gloo/nccl), and `floor`: the same bytes moved the same way with no
protocol (shm: a copy into shared memory and a spinning flag; tcp: bare sendall/recv_into
on plain sockets; rdma: bare write-with-immediate), the lower bound M2N is judged against.
"""

from __future__ import annotations

import json
import mmap
import multiprocessing as mp
import os
import secrets
import socket
import struct
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import numpy as np

PATTERNS = ("m2n", "one-to-n", "ping-pong")
STAMP = struct.Struct("<q")
FLOOR_FLAG = struct.Struct("<Q")


def now_ns() -> int:
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


@dataclass
class BenchSpec:
    backend: str  # shm | tcp | rdma (the M2N backend, and the floor's)
    senders: int
    receivers: int
    sizes: list[int]  # bytes per message
    iters: int = 200
    warmup: int = 20
    pattern: str = "m2n"
    slots: int = 2
    timeout_s: float = 60.0
    baseline: str | None = None  # "torch" to run the torch.distributed exchange too

    def __post_init__(self) -> None:
        if self.pattern not in PATTERNS:
            raise ValueError(f"pattern {self.pattern!r} is not one of {', '.join(PATTERNS)}")
        if self.backend not in ("shm", "tcp", "rdma", "torch"):
            raise ValueError(f"backend {self.backend!r} is not one of shm, tcp, rdma, torch")
        if self.pattern == "ping-pong" and (self.senders, self.receivers) != (1, 1):
            raise ValueError("the ping-pong pattern runs 1 sender and 1 receiver (--senders 1 --receivers 1)")
        if self.pattern == "one-to-n" and self.senders != 1:
            raise ValueError("the one-to-n pattern has exactly one sender (--senders 1)")
        if self.senders < 1 or self.receivers < 1 or self.iters < 1 or self.warmup < 0:
            raise ValueError("senders, receivers and iters must be at least 1, warmup at least 0")
        if min(self.sizes) < STAMP.size:
            raise ValueError(f"message sizes must be at least {STAMP.size} bytes (they carry a timestamp)")


@dataclass
class Result:
    system: str  # "m2n", "torch" or "floor"
    pattern: str
    senders: int
    receivers: int
    bytes: int
    p50_us: float
    p99_us: float
    p999_us: float
    gbps: float  # GB/s of payload, all pairs together
    msg_rate: float  # messages per second, all pairs together


@dataclass
class _Role:
    system: str
    name: str
    index: int
    sender: bool
    spec: dict
    extra: dict = field(default_factory=dict)


def _names(spec: BenchSpec) -> tuple[list[str], list[str]]:
    return [f"s{i}" for i in range(spec.senders)], [f"r{j}" for j in range(spec.receivers)]


# -- workers ----------------------------------------------------------------------------------
def _worker(role_json: str, conn) -> None:
    role = _Role(**json.loads(role_json))
    spec = BenchSpec(**role.spec)
    try:
        runner = {"m2n": _run_m2n, "torch": _run_torch, "floor": _FLOOR_RUNNERS[spec.backend]}[role.system]
        runner(role, spec, conn)
    except BaseException as exc:  # report, never hang the parent
        conn.send_bytes(json.dumps({"error": f"{role.name}: {type(exc).__name__}: {exc}"}).encode())
    finally:
        conn.close()


def _send(conn, obj) -> None:
    conn.send_bytes(json.dumps(obj).encode())


def _recv(conn) -> dict:
    return json.loads(conn.recv_bytes().decode())


def _loop(role: _Role, spec: BenchSpec, conn, send_all: Callable, receive_all: Callable, ack_all: Callable,
          wait_acks: Callable) -> None:
    """The shared measurement loop: the system supplies how to send, receive and acknowledge."""
    for size in spec.sizes:
        payload = bytearray(os.urandom(size))
        _send(conn, {"ready": size})
        _recv(conn)  # go: every process is at this size
        latencies = []
        start = 0
        for it in range(spec.warmup + spec.iters):
            if it == spec.warmup:
                start = now_ns()
            if role.sender:
                send_all(payload, it)
                rtt = wait_acks(it, size)
                if spec.pattern == "ping-pong" and it >= spec.warmup:
                    latencies.append(rtt / 2)
            else:
                stamps = receive_all(it, size)
                if spec.pattern != "ping-pong" and it >= spec.warmup:
                    latencies.extend(stamps)
                ack_all(it, payload if spec.pattern == "ping-pong" else None)
        _send(conn, {"size": size, "latencies_ns": latencies, "start": start, "end": now_ns()})
    _recv(conn)  # done: every process has finished, so closing now disturbs no one


def _run_m2n(role: _Role, spec: BenchSpec, conn) -> None:
    from transport.endpoint import Endpoint, EndpointSpec

    senders, receivers = _names(spec)
    ep = Endpoint(EndpointSpec(name=role.name, secret=bytes.fromhex(role.extra["secret"]), rank=role.index,
                               slot_bytes=max(spec.sizes), num_slots=spec.slots, backend=spec.backend,
                               timeout_s=spec.timeout_s))
    _send(conn, {"address": ep.address})
    peers = _recv(conn)["peers"]
    ep.connect({p: peers[p] for p in (receivers if role.sender else senders)})
    others = receivers if role.sender else senders
    sent_at = {}

    def send_all(payload, it):
        for peer in others:
            sent_at[peer] = now_ns()
            STAMP.pack_into(payload, 0, sent_at[peer])
            ep.send(peer, payload, micro_batch=it % spec.slots, step=it)

    def wait_acks(it, size):
        for _ in others:
            msg = ep.recv()
            msg.release()
        return now_ns() - sent_at[others[0]]

    def receive_all(it, size):
        stamps = []
        for _ in others:
            msg = ep.recv()
            stamps.append(now_ns() - STAMP.unpack_from(msg.data, 0)[0])
            msg.release()
        return stamps

    def ack_all(it, echo):
        for peer in others:
            ep.send(peer, echo if echo is not None else b"", micro_batch=it % spec.slots, step=it)

    _loop(role, spec, conn, send_all, receive_all, ack_all, wait_acks)
    ep.close()


def _run_torch(role: _Role, spec: BenchSpec, conn) -> None:
    import torch

    from transport.baseline import TorchP2PExchange

    rank = role.index if role.sender else spec.senders + role.index
    ex = TorchP2PExchange(rank, spec.senders + spec.receivers, "127.0.0.1", role.extra["port"],
                          timeout_s=spec.timeout_s)
    others = list(range(spec.senders, spec.senders + spec.receivers)) if role.sender else list(range(spec.senders))
    acks = {p: torch.zeros(8, dtype=torch.uint8) for p in others}
    inbox: dict[tuple[int, int], torch.Tensor] = {}  # (peer, size) -> receive buffer
    sent_at = [0]

    def buffer(peer: int, size: int) -> torch.Tensor:
        return inbox.setdefault((peer, size), torch.empty(size, dtype=torch.uint8))

    def send_all(payload, it):
        sent_at[0] = now_ns()
        STAMP.pack_into(payload, 0, sent_at[0])
        tensor = torch.frombuffer(payload, dtype=torch.uint8)
        ex.exchange({p: tensor for p in others}, {})

    def wait_acks(it, size):
        echo = spec.pattern == "ping-pong"
        ex.exchange({}, {p: buffer(p, size) if echo else acks[p] for p in others})
        return now_ns() - sent_at[0]

    def receive_all(it, size):
        recvs = {p: buffer(p, size) for p in others}
        ex.exchange({}, recvs)
        t1 = now_ns()
        return [t1 - STAMP.unpack_from(recvs[p].numpy(), 0)[0] for p in others]

    def ack_all(it, echo):
        if echo is not None:
            tensor = torch.frombuffer(echo, dtype=torch.uint8)
            ex.exchange({p: tensor for p in others}, {})
        else:
            ex.exchange({p: acks[p] for p in others}, {})

    _loop(role, spec, conn, send_all, receive_all, ack_all, wait_acks)
    ex.close()


def _run_floor_shm(role: _Role, spec: BenchSpec, conn) -> None:
    """Raw shared memory per (sender, receiver) pair and direction: [flag u64 | 56 reserved |
    payload]. The sender copies in and sets the flag; the receiver spins on it, reads the
    stamp, clears it, and acknowledges through the reverse region, as M2N does."""
    senders, receivers = _names(spec)
    regions = {}
    others = receivers if role.sender else senders
    for peer in others:
        pair = f"{role.name}-{peer}" if role.sender else f"{peer}-{role.name}"
        path = role.extra["regions"][pair]
        fd = os.open(path, os.O_RDWR)
        regions[peer] = mmap.mmap(fd, 64 + max(spec.sizes))
        os.close(fd)
    back = {}  # the reverse direction of each pair: acknowledgements, or ping-pong's echo
    for peer in others:
        pair = f"{role.name}-{peer}" if role.sender else f"{peer}-{role.name}"
        fd = os.open(role.extra["regions"]["back-" + pair], os.O_RDWR)
        back[peer] = mmap.mmap(fd, 64 + max(spec.sizes))
        os.close(fd)
    sent_at = [0]

    def spin_until(region, value):
        while FLOOR_FLAG.unpack_from(region, 0)[0] != value:
            os.sched_yield()

    def send_all(payload, it):
        for peer in others:
            sent_at[0] = now_ns()
            STAMP.pack_into(payload, 0, sent_at[0])
            r = regions[peer]
            r[64:64 + len(payload)] = payload
            FLOOR_FLAG.pack_into(r, 0, it + 1)

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
                r = regions[peer]
                if FLOOR_FLAG.unpack_from(r, 0)[0] == it + 1:
                    stamps.append(now_ns() - STAMP.unpack_from(r, 64)[0])
                    pending.remove(peer)
            if pending:
                os.sched_yield()
        return stamps

    def ack_all(it, echo):
        for peer in others:
            FLOOR_FLAG.pack_into(regions[peer], 0, 0)  # the data region is free again
            b = back[peer]
            spin_until(b, 0)  # the previous acknowledgement has been seen
            if echo is not None:
                b[64:64 + len(echo)] = echo
            FLOOR_FLAG.pack_into(b, 0, it + 1)

    _loop(role, spec, conn, send_all, receive_all, ack_all, wait_acks)


def _run_floor_tcp(role: _Role, spec: BenchSpec, conn) -> None:
    """Plain sockets, one per pair: sendall the bytes, recv_into them, an 8-byte ack back."""
    senders, receivers = _names(spec)
    socks = {}
    if role.sender:
        peers = _recv(conn)["peers"]
        for peer in receivers:
            host, port = peers[peer].rsplit(":", 1)
            s = socket.create_connection((host, int(port)))
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            s.sendall(role.name.encode().ljust(16))
            socks[peer] = s
    else:
        listener = socket.create_server(("127.0.0.1", 0))
        _send(conn, {"address": "127.0.0.1:%d" % listener.getsockname()[1]})
        for _ in senders:
            s, _ = listener.accept()
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            name = _recv_exact(s, 16).decode().strip()
            socks[name] = s
        listener.close()
    others = receivers if role.sender else senders
    buffers: dict[int, bytearray] = {}  # size -> receive buffer
    ack = bytes(8)
    sent_at = [0]

    def send_all(payload, it):
        for peer in others:
            sent_at[0] = now_ns()
            STAMP.pack_into(payload, 0, sent_at[0])
            socks[peer].sendall(payload)

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
            stamps.append(now_ns() - STAMP.unpack_from(buf, 0)[0])
        return stamps

    def ack_all(it, echo):
        for peer in others:
            socks[peer].sendall(echo if echo is not None else ack)

    _loop(role, spec, conn, send_all, receive_all, ack_all, wait_acks)
    for s in socks.values():
        s.close()


def _run_floor_rdma(role: _Role, spec: BenchSpec, conn) -> None:
    """Bare write-with-immediate: the M2N rdma channel's verbs with no header, slots or credits
    beyond one outstanding message per pair (acks are zero-byte writes-with-immediate)."""
    from transport.rdma import RdmaContext, _QueuePair
    from transport.wire import QPInfo

    senders, receivers = _names(spec)
    others = receivers if role.sender else senders
    rc = RdmaContext.open()
    qps = {peer: _QueuePair(rc, max(spec.sizes) + 64, 1) for peer in others}
    _send(conn, {"qp": {peer: qp.info().pack().hex() for peer, qp in qps.items()}})
    remote = _recv(conn)["qp"]
    for peer, qp in qps.items():
        qp.to_rts(QPInfo.unpack(bytes.fromhex(remote[peer][role.name])))
    sent_at = [0]

    def wait_for(qp, peer):
        while not qp.completions(peer):
            pass

    def send_all(payload, it):
        for peer, qp in qps.items():
            sent_at[0] = now_ns()
            STAMP.pack_into(payload, 0, sent_at[0])
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
            stamps.append(now_ns() - STAMP.unpack_from(qp.mr.read(8, 96), 0)[0])
        return stamps

    def ack_all(it, echo):
        for peer, qp in qps.items():
            if echo is not None:
                qp.mr.write(bytes(echo), len(echo), 96)
            qp.write_with_imm(96, len(echo) if echo is not None else 0, 96, 0)

    _loop(role, spec, conn, send_all, receive_all, ack_all, wait_acks)
    for qp in qps.values():
        qp.close()
    rc.close()


_FLOOR_RUNNERS = {"shm": _run_floor_shm, "tcp": _run_floor_tcp, "rdma": _run_floor_rdma}


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


# -- the parent ---------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(system: str, spec: BenchSpec, progress: Callable[[str], None] | None = None) -> list[Result]:
    """Run one system (m2n, torch, floor) over every size; one process per endpoint."""
    ctx = mp.get_context("spawn")
    senders, receivers = _names(spec)
    extra: dict = {}
    region_paths: list[str] = []
    if system == "m2n":
        extra["secret"] = secrets.token_hex(32)
    elif system == "torch":
        extra["port"] = _free_port()
    elif system == "floor" and spec.backend == "shm":
        extra["regions"] = {}
        pairs = [f"{s}-{r}" for s in senders for r in receivers]
        pairs += ["back-" + p for p in pairs]
        for pair in pairs:
            path = f"/dev/shm/megainfer-floor-{secrets.token_hex(8)}"
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            os.ftruncate(fd, 64 + max(spec.sizes))
            os.close(fd)
            extra["regions"][pair] = path
            region_paths.append(path)
    procs, conns = {}, {}
    try:
        for i, name in enumerate(senders + receivers):
            sender = i < spec.senders
            role = _Role(system, name, i if sender else i - spec.senders, sender, asdict(spec), extra)
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker, args=(json.dumps(asdict(role)), child), daemon=True)
            p.start()
            child.close()
            procs[name], conns[name] = p, parent
        _wire_up(system, spec, conns, senders, receivers)
        results = []
        for size in spec.sizes:
            for name in conns:
                _expect(conns[name], name, spec, "ready")
            for conn in conns.values():
                _send(conn, {"go": size})
            reports = {name: _expect(conns[name], name, spec, "size") for name in conns}
            results.append(_summarise(system, spec, size, reports, senders, receivers))
            if progress:
                progress(f"{system} {size} B")
        for conn in conns.values():
            _send(conn, {"done": True})
        return results
    finally:
        for p in procs.values():
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        for path in region_paths:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


def _expect(conn, name: str, spec: BenchSpec, key: str) -> dict:
    if not conn.poll(spec.timeout_s + 30):
        raise TimeoutError(f"benchmark process {name} sent nothing for {spec.timeout_s + 30:g} s")
    msg = _recv(conn)
    if "error" in msg:
        raise RuntimeError(msg["error"])
    if key not in msg:
        raise RuntimeError(f"benchmark process {name} answered {sorted(msg)} where {key!r} was expected")
    return msg


def _wire_up(system: str, spec: BenchSpec, conns: dict, senders: list[str], receivers: list[str]) -> None:
    """Hand every process its peers' addresses (the only coordination M2N needs)."""
    if system == "m2n":
        addresses = {name: _expect(conn, name, spec, "address")["address"] for name, conn in conns.items()}
        for conn in conns.values():
            _send(conn, {"peers": addresses})
    elif system == "floor" and spec.backend == "tcp":
        addresses = {name: _expect(conns[name], name, spec, "address")["address"] for name in receivers}
        for name in senders:
            _send(conns[name], {"peers": addresses})
    elif system == "floor" and spec.backend == "rdma":
        infos = {name: _expect(conn, name, spec, "qp")["qp"] for name, conn in conns.items()}
        for name, conn in conns.items():
            _send(conn, {"qp": {peer: infos[peer] for peer in infos[name]}})


def _summarise(system: str, spec: BenchSpec, size: int, reports: dict, senders, receivers) -> Result:
    lat = np.array([x for r in reports.values() for x in r["latencies_ns"]], dtype=np.float64) / 1e3
    start = min(r["start"] for r in reports.values())
    end = max(r["end"] for r in reports.values())
    wall = max(end - start, 1) / 1e9
    if spec.pattern == "ping-pong":
        messages = 2 * spec.iters
    else:
        messages = len(senders) * len(receivers) * spec.iters
    p50, p99, p999 = np.percentile(lat, [50, 99, 99.9]) if lat.size else (float("nan"),) * 3
    return Result(system, spec.pattern, spec.senders, spec.receivers, size, float(p50), float(p99), float(p999),
                  messages * size / wall / 1e9, messages / wall)
