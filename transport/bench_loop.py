"""The benchmark processes: one measurement loop, and how M2N and torch.distributed plug
into it (the floors, in transport/bench_floor.py, plug in the same way).

M2N runs its exchanges as rounds, as the deployment's data plane does (one call posts to every
peer, one collects from every peer). Each iteration, by pattern:
  m2n / one-to-n  every sender writes one message to every receiver, then waits for an
                  empty acknowledgement from each; a receiver records one-way latency
                  (receive time minus the send time in the message's first 8 bytes).
  ping-pong       1x1: A sends, B echoes the same bytes back; latency is half the round trip.
  --duplex (m2n)  every process sends a message to each peer, then receives one from each:
                  both directions of every pair at once, as the ping-pong pipeline runs
                  (dispatch of micro-batch j+1 beside the answer for j).
"""

from __future__ import annotations

import json
import os
from typing import Callable

import numpy as np

from transport.bench_spec import STAMP, BenchSpec, Role, names, now_ns


def send(conn, obj) -> None:
    conn.send_bytes(json.dumps(obj).encode())


def recv(conn) -> dict:
    return json.loads(conn.recv_bytes().decode())


def loop(role: Role, spec: BenchSpec, conn, send_all: Callable, receive_all: Callable, ack_all: Callable,
         wait_acks: Callable, register: Callable | None = None) -> None:
    """The shared measurement loop: the system supplies how to send, receive and acknowledge.
    In duplex mode every process runs send_all then receive_all, and no acknowledgements."""
    for size in spec.sizes:
        warmup, iters = spec.iterations(size)
        payload = bytearray(os.urandom(size))
        if register is not None:
            register(payload)
        send(conn, {"ready": size})
        recv(conn)  # go: every process is at this size
        latencies = []
        start = 0
        for it in range(warmup + iters):
            if it == warmup:
                start = now_ns()
            timed = it >= warmup
            if spec.duplex:
                send_all(payload, it)
                stamps = receive_all(it, size)
                if timed:
                    latencies.extend(stamps)
            elif role.sender:
                send_all(payload, it)
                rtt = wait_acks(it, size)
                if spec.pattern == "ping-pong" and timed:
                    latencies.append(rtt / 2)
            else:
                stamps = receive_all(it, size)
                if spec.pattern != "ping-pong" and timed:
                    latencies.extend(stamps)
                ack_all(it, payload if spec.pattern == "ping-pong" else None)
        send(conn, {"size": size, "iters": iters, "latencies_ns": latencies, "start": start, "end": now_ns()})
    recv(conn)  # done: every process has finished, so closing now disturbs no one


def run_m2n(role: Role, spec: BenchSpec, conn) -> None:
    from transport.endpoint import Endpoint, EndpointSpec

    senders, receivers = names(spec)
    ep = Endpoint(EndpointSpec(name=role.name, secret=bytes.fromhex(role.extra["secret"]), rank=role.index,
                               slot_bytes=max(spec.sizes), num_slots=spec.slots, backend=spec.backend,
                               timeout_s=spec.timeout_s))
    send(conn, {"address": ep.address})
    peers = recv(conn)["peers"]
    others = tuple(receivers if role.sender else senders)
    ep.connect({p: peers[p] for p in others})
    # The data plane runs in rounds (transport/rounds.py): one call posts to every peer, one
    # collects from every peer; every peer gets the whole payload.
    import torch

    starts, ones = np.zeros(len(others), dtype=np.int64), np.ones(len(others), dtype=np.int64)
    rounds: dict[int, tuple] = {}  # id(payload) -> (the payload as a tensor, each peer's end): one per size
    empty = (torch.empty(0, dtype=torch.uint8), starts)
    sent_at = [0]

    def post(payload, it) -> None:
        data, ends = empty if payload is None else rounds.get(id(payload)) or round_of(payload)
        ep.post_round(others, data, starts, ends, ones, micro_batch=it % spec.slots, step=it)

    def round_of(payload) -> tuple:
        rounds.clear()  # the previous size's payload is gone
        rounds[id(payload)] = torch.frombuffer(payload, dtype=torch.uint8), starts + len(payload)
        return rounds[id(payload)]

    def send_all(payload, it):
        sent_at[0] = now_ns()
        STAMP.pack_into(payload, 0, sent_at[0])
        post(payload, it)

    def wait_acks(it, size):
        ep.collect_round(others, micro_batch=it % spec.slots).release()
        return now_ns() - sent_at[0]

    def receive_all(it, size):
        with ep.collect_round(others, micro_batch=it % spec.slots) as arrivals:
            arrived = now_ns()
            return [arrived - STAMP.unpack_from(arrivals.payload(i), 0)[0] for i in range(len(others))]

    def ack_all(it, echo):
        post(echo, it)

    def register(payload):  # as a deployment registers its pinned send staging
        import torch

        ep.register(torch.frombuffer(payload, dtype=torch.uint8))

    loop(role, spec, conn, send_all, receive_all, ack_all, wait_acks, register)
    ep.close()


def run_torch(role: Role, spec: BenchSpec, conn) -> None:
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

    pending: list[int] = []  # a duplex send's received stamps, handed out by receive_all

    def stamps_of(recvs) -> list[int]:
        t1 = now_ns()
        return [t1 - STAMP.unpack_from(recvs[p].numpy(), 0)[0] for p in others]

    def send_all(payload, it):
        sent_at[0] = now_ns()
        STAMP.pack_into(payload, 0, sent_at[0])
        tensor = torch.frombuffer(payload, dtype=torch.uint8)
        if spec.duplex:  # both directions in one batch, as M2N's duplex exchange overlaps them
            recvs = {p: buffer(p, len(payload)) for p in others}
            ex.exchange({p: tensor for p in others}, recvs)
            pending[:] = stamps_of(recvs)
        else:
            ex.exchange({p: tensor for p in others}, {})

    def wait_acks(it, size):
        echo = spec.pattern == "ping-pong"
        ex.exchange({}, {p: buffer(p, size) if echo else acks[p] for p in others})
        return now_ns() - sent_at[0]

    def receive_all(it, size):
        if spec.duplex:
            return list(pending)
        recvs = {p: buffer(p, size) for p in others}
        ex.exchange({}, recvs)
        return stamps_of(recvs)

    def ack_all(it, echo):
        if echo is not None:
            tensor = torch.frombuffer(echo, dtype=torch.uint8)
            ex.exchange({p: tensor for p in others}, {})
        else:
            ex.exchange({p: acks[p] for p in others}, {})

    loop(role, spec, conn, send_all, receive_all, ack_all, wait_acks)
    ex.close()
