"""A host of M2N endpoints driven by JSON lines, for tests that run it in a network namespace
(tests/transport/test_two_hosts.py):

    python -m tests.transport.netns_peer        # from the checkout's root (on PYTHONPATH)

Each endpoint runs on its own thread; the main thread reads commands from stdin and hands
them to every endpoint's thread. One JSON object a line each way; "op" names its shape:

    in (stdin)                                   out (stdout)
    start      endpoints, secret                 listening  addresses, host, env
    connect    peers {endpoint: {peer: address}} connected  one per endpoint (or failed)
    reconnect                                    connected  one per endpoint (or failed)
    exchange   tag, seed, rounds [[size, ...]]   sent/received one per message, then done
                                                 (or failed) per endpoint
    close                                        closed, then the process exits

An exchange round sends, for each micro-batch k (its size rounds[r][k]), one message from
every "initiator" endpoint to each of its peers, all micro-batches before any answer is
read; a "responder" endpoint receives each, checks it byte for byte against the payload
both sides derive from (seed, sender, receiver, round, micro-batch), and answers with its
own payload of the same size, which the initiator checks the same way. Every message is
reported with its SHA-256 by both its sender and its receiver, so the driver can match them.
A failure ends the endpoint's exchange with `failed`: the exception's type and message, and
when it happened (time.monotonic(), one clock for every namespace of the machine).
"""

from __future__ import annotations

import faulthandler
import hashlib
import json
import logging
import os
import queue
import random
import sys
import threading
import time
from dataclasses import asdict, dataclass

from transport import Endpoint, EndpointSpec, Header, host_id


# -- the messages ---------------------------------------------------------------------------
@dataclass
class EndpointConfig:
    name: str
    rank: int
    role: str  # "initiator" | "responder"
    listen: str  # host:port, port 0 for any
    backend: str = "tcp"
    slot_bytes: int = 1 << 20
    num_slots: int = 2
    timeout_s: float = 20.0  # EndpointSpec.timeout_s: bounds connect() and reconnect()
    op_timeout_s: float = 3.0  # every send's and recv's `timeout`


@dataclass
class Start:
    endpoints: list[EndpointConfig]
    secret: str  # hex
    op: str = "start"


@dataclass
class Connect:
    peers: dict[str, dict[str, str]]  # endpoint -> {peer: address}
    op: str = "connect"


@dataclass
class Reconnect:
    op: str = "reconnect"


@dataclass
class Exchange:
    tag: str
    seed: int
    rounds: list[list[int]]  # rounds[r][k]: the size of micro-batch k's messages in round r
    op: str = "exchange"


@dataclass
class Close:
    op: str = "close"


@dataclass
class Listening:
    addresses: dict[str, str]
    host: str  # transport.endpoint.host_id() in this namespace
    env: dict[str, str]  # the UCX settings this process runs with
    op: str = "listening"


@dataclass
class Connected:
    endpoint: str
    choices: dict[str, list[str]]  # peer -> [backend, reason] (Endpoint.choices)
    outbound: dict[str, str]  # peer -> Endpoint.backend_of(peer)
    inbound: dict[str, str]  # peer -> the kind of the channel it writes into
    op: str = "connected"


@dataclass
class Transferred:
    """One message, as its sender (op "sent") or its receiver (op "received") saw it."""

    op: str
    endpoint: str
    peer: str
    tag: str
    round: int
    micro_batch: int
    size: int
    sha256: str


@dataclass
class Done:
    endpoint: str
    tag: str
    seconds: float
    op: str = "done"


@dataclass
class Failed:
    endpoint: str
    tag: str  # the exchange's tag, or "connect" / "reconnect"
    error_type: str
    error: str
    at: float  # time.monotonic() when it was raised
    op: str = "failed"


@dataclass
class Closed:
    op: str = "closed"


INBOUND = {"start": Start, "connect": Connect, "reconnect": Reconnect, "exchange": Exchange, "close": Close}
OUTBOUND = {"listening": Listening, "connected": Connected, "sent": Transferred, "received": Transferred,
            "done": Done, "failed": Failed, "closed": Closed}


def encode(message) -> str:
    return json.dumps(asdict(message), separators=(",", ":"))


def decode(line: str, shapes: dict[str, type]):
    """A JSON line -> the dataclass its "op" names (unknown fields are an error)."""
    data = json.loads(line)
    shape = shapes[data["op"]]
    if shape is Start:
        data["endpoints"] = [EndpointConfig(**e) for e in data["endpoints"]]
    return shape(**data)


def payload(seed: int, sender: str, receiver: str, round_: int, micro_batch: int, size: int) -> bytes:
    """The bytes `sender` sends `receiver` in that round and micro-batch: both sides derive them."""
    return random.Random(f"{seed}:{sender}:{receiver}:{round_}:{micro_batch}").randbytes(size)


class Mismatch(AssertionError):
    """A received message differs from what its sender sent."""


# -- the peer -------------------------------------------------------------------------------
class Peer:
    def __init__(self, out) -> None:
        self.out = out  # the protocol's stream: the process's original stdout
        self.out_lock = threading.Lock()
        self.endpoints: dict[str, Endpoint] = {}
        self.configs: dict[str, EndpointConfig] = {}
        self.queues: dict[str, queue.Queue] = {}
        self.workers: list[threading.Thread] = []

    def emit(self, message) -> None:
        line = encode(message) + "\n"
        with self.out_lock:
            self.out.write(line)
            self.out.flush()

    def start(self, cmd: Start) -> None:
        secret = bytes.fromhex(cmd.secret)
        for cfg in cmd.endpoints:
            spec = EndpointSpec(name=cfg.name, rank=cfg.rank, secret=secret, listen=cfg.listen, backend=cfg.backend,
                                slot_bytes=cfg.slot_bytes, num_slots=cfg.num_slots, timeout_s=cfg.timeout_s)
            self.endpoints[cfg.name] = Endpoint(spec)
            self.configs[cfg.name] = cfg
            self.queues[cfg.name] = queue.Queue()
            worker = threading.Thread(target=self.work, args=(cfg.name,), name=f"peer-{cfg.name}", daemon=True)
            worker.start()
            self.workers.append(worker)
        env = {k: v for k, v in os.environ.items() if k.startswith("UCX_")}
        self.emit(Listening({n: ep.address for n, ep in self.endpoints.items()}, host_id(), env))

    def work(self, name: str) -> None:
        while True:
            cmd = self.queues[name].get()
            if cmd is None:
                return
            tag = cmd.tag if isinstance(cmd, Exchange) else cmd.op
            try:
                if isinstance(cmd, Connect):
                    self.endpoints[name].connect(cmd.peers[name])
                    self.report_connected(name)
                elif isinstance(cmd, Reconnect):
                    self.endpoints[name].reconnect()
                    self.report_connected(name)
                else:
                    start = time.monotonic()
                    self.exchange(name, cmd)
                    self.emit(Done(name, cmd.tag, time.monotonic() - start))
            except Exception as exc:  # reported, and the thread waits for the next command
                logging.getLogger("netns_peer").warning("%s: %s failed", name, tag, exc_info=True)
                self.emit(Failed(name, tag, type(exc).__name__, str(exc), time.monotonic()))

    def report_connected(self, name: str) -> None:
        ep = self.endpoints[name]
        self.emit(Connected(name, {p: [c.backend, c.reason] for p, c in ep.choices.items()},
                            {p: ep.backend_of(p) for p in ep.outbound}, {p: ch.kind for p, ch in ep.inbound.items()}))

    def exchange(self, name: str, cmd: Exchange) -> None:
        ep, cfg = self.endpoints[name], self.configs[name]
        peers = sorted(ep.outbound)
        for r, sizes in enumerate(cmd.rounds):
            if cfg.role == "initiator":
                for k, size in enumerate(sizes):
                    for peer in peers:
                        self.send(ep, cmd, peer, r, k, size)
                for k, size in enumerate(sizes):
                    for peer in peers:
                        self.receive(ep, cmd, peer, r, k, size)
            else:
                for k, size in enumerate(sizes):
                    for peer in peers:
                        self.receive(ep, cmd, peer, r, k, size)
                        self.send(ep, cmd, peer, r, k, size)

    def send(self, ep: Endpoint, cmd: Exchange, peer: str, r: int, k: int, size: int) -> None:
        data = payload(cmd.seed, ep.spec.name, peer, r, k, size)
        ep.send(peer, data, step=r, layer=k + 1, micro_batch=k, token_count=size,
                timeout=self.configs[ep.spec.name].op_timeout_s)
        self.emit(Transferred("sent", ep.spec.name, peer, cmd.tag, r, k, size, hashlib.sha256(data).hexdigest()))

    def receive(self, ep: Endpoint, cmd: Exchange, peer: str, r: int, k: int, size: int) -> None:
        with ep.recv(peer, micro_batch=k, timeout=self.configs[ep.spec.name].op_timeout_s) as msg:
            h: Header = msg.header
            got = (h.step, h.layer, h.micro_batch, h.token_count, h.byte_length)
            if got != (r, k + 1, k, size, size):
                raise Mismatch(f"{ep.spec.name} got from {peer} a header (step, layer, micro_batch, token_count, "
                               f"byte_length) = {got}, expected {(r, k + 1, k, size, size)}")
            data = bytes(msg.data)
        expected = payload(cmd.seed, peer, ep.spec.name, r, k, size)
        if data != expected:
            first = next((i for i, (x, y) in enumerate(zip(data, expected)) if x != y), min(len(data), size))
            raise Mismatch(f"{ep.spec.name} got from {peer} in round {r}, micro-batch {k}: {len(data)} bytes "
                           f"differing from the {size} sent at offset {first}")
        self.emit(Transferred("received", ep.spec.name, peer, cmd.tag, r, k, size, hashlib.sha256(data).hexdigest()))

    def close(self) -> None:
        for q in self.queues.values():
            q.put(None)
        for worker in self.workers:
            worker.join(10)
        for ep in self.endpoints.values():
            ep.close()
        self.emit(Closed())


def main() -> None:
    # The protocol keeps stdout to itself: what anything else prints there (NIXL logs its
    # agents' start to stdout) goes to stderr instead.
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    faulthandler.enable()  # a crash in a native library (NIXL, UCX) leaves its Python stacks on stderr
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(process)d %(threadName)s %(name)s: %(message)s")
    peer = Peer(out)
    for line in sys.stdin:
        if not line.strip():
            continue
        cmd = decode(line, INBOUND)
        if isinstance(cmd, Start):
            peer.start(cmd)
        elif isinstance(cmd, Close):
            break
        else:
            for q in peer.queues.values():
                q.put(cmd)
    peer.close()
    out.flush()
    os._exit(0)  # NIXL/UCX threads must not keep the process alive


if __name__ == "__main__":
    main()
