"""The M2N microbenchmark: M senders and N receivers as separate processes.

One measurement protocol for every system, so the numbers compare (transport/bench_loop.py
describes the patterns and the duplex mode). Throughput is the payload bytes of the timed
iterations over their wall time, across all processes and directions (clocks are one
host's monotonic clock).

Systems: `m2n` (an Endpoint over shm, tcp, rdma or nixl), `torch` (transport.baseline,
batch_isend_irecv over gloo/nccl), and `floor` (transport/bench_floor.py): the same bytes
moved the same way with no protocol, the lower bound M2N is judged against.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import secrets
import socket
from dataclasses import asdict
from typing import Callable

import numpy as np

from transport.bench_loop import recv, send
from transport.bench_worker import worker
from transport.bench_spec import BenchSpec, Result, Role, names

__all__ = ["BenchSpec", "Result", "measure"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _floor_regions(spec: BenchSpec) -> dict[str, str]:
    """The shm floor's regions, one per pair and direction, made by the parent."""
    senders, receivers = names(spec)
    pairs = [f"{s}-{r}" for s in senders for r in receivers]
    regions = {}
    for pair in pairs + ["back-" + p for p in pairs]:
        path = f"/dev/shm/megainfer-floor-{secrets.token_hex(8)}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.ftruncate(fd, 64 + max(spec.sizes))
        os.close(fd)
        regions[pair] = path
    return regions


def measure(system: str, spec: BenchSpec, progress: Callable[[str], None] | None = None) -> list[Result]:
    """Run one system (m2n, torch, floor) over every size; one process per endpoint."""
    ctx = mp.get_context("spawn")
    senders, receivers = names(spec)
    extra: dict = {}
    if system == "m2n":
        extra["secret"] = secrets.token_hex(32)
    elif system == "torch":
        extra["port"] = _free_port()
    elif system == "floor" and spec.backend == "shm":
        extra["regions"] = _floor_regions(spec)
    procs, conns = {}, {}
    try:
        for i, name in enumerate(senders + receivers):
            sender = i < spec.senders
            role = Role(system, name, i if sender else i - spec.senders, sender, asdict(spec), extra)
            parent, child = ctx.Pipe()
            p = ctx.Process(target=worker, args=(json.dumps(asdict(role)), child), daemon=True)
            p.start()
            child.close()
            procs[name], conns[name] = p, parent
        _wire_up(system, spec, conns, senders, receivers)
        results = []
        for size in spec.sizes:
            for name in conns:
                _expect(conns[name], name, spec, "ready")
            for conn in conns.values():
                send(conn, {"go": size})
            reports = {name: _expect(conns[name], name, spec, "size") for name in conns}
            results.append(_summarise(system, spec, size, reports))
            if progress:
                progress(f"{system} {size} B")
        for conn in conns.values():
            send(conn, {"done": True})
        return results
    finally:
        for p in procs.values():
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        for path in extra.get("regions", {}).values():
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


def _expect(conn, name: str, spec: BenchSpec, key: str) -> dict:
    if not conn.poll(spec.timeout_s + 30):
        raise TimeoutError(f"benchmark process {name} sent nothing for {spec.timeout_s + 30:g} s")
    msg = recv(conn)
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
            send(conn, {"peers": addresses})
    elif system == "floor" and spec.backend == "tcp":
        addresses = {name: _expect(conns[name], name, spec, "address")["address"] for name in receivers}
        for name in senders:
            send(conns[name], {"peers": addresses})
    elif system == "floor" and spec.backend == "rdma":
        infos = {name: _expect(conn, name, spec, "qp")["qp"] for name, conn in conns.items()}
        for name, conn in conns.items():
            send(conn, {"qp": {peer: infos[peer] for peer in infos[name]}})
    elif system == "floor" and spec.backend == "nixl":
        infos = {name: _expect(conn, name, spec, "nixl")["nixl"] for name, conn in conns.items()}
        for name, conn in conns.items():
            send(conn, {"nixl": {peer: {"metadata": infos[peer]["metadata"], "inbox": infos[peer]["inbox"][name]}
                                 for peer in infos[name]["inbox"]}})


def _summarise(system: str, spec: BenchSpec, size: int, reports: dict) -> Result:
    lat = np.array([x for r in reports.values() for x in r["latencies_ns"]], dtype=np.float64) / 1e3
    start = min(r["start"] for r in reports.values())
    end = max(r["end"] for r in reports.values())
    wall = max(end - start, 1) / 1e9
    iters = next(iter(reports.values()))["iters"]
    messages = spec.messages_per_iteration() * iters
    p50, p99, p999 = np.percentile(lat, [50, 99, 99.9]) if lat.size else (float("nan"),) * 3
    backend = "gloo" if system == "torch" else spec.backend
    return Result(system, backend, spec.pattern, spec.senders, spec.receivers, size, spec.duplex, iters, float(p50),
                  float(p99), float(p999), messages * size / wall / 1e9, messages / wall)
