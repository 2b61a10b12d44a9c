"""What `megainfer bench m2n` measures and reports: the spec every benchmark process gets,
the result of one system at one size, and the timestamp carried in every message."""

from __future__ import annotations

import struct
import time
from dataclasses import dataclass, field

PATTERNS = ("m2n", "one-to-n", "ping-pong")
BACKENDS = ("shm", "tcp", "rdma", "nixl")
STAMP = struct.Struct("<q")  # the send time, CLOCK_MONOTONIC ns, in a message's first 8 bytes
# Sizes above this run fewer iterations (see `BenchSpec.iterations`): the same bytes, not the same count.
FULL_ITERATIONS_UP_TO = 1 << 20
MIN_ITERATIONS = 50


def now_ns() -> int:
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


@dataclass
class BenchSpec:
    backend: str  # shm | tcp | rdma | nixl (the M2N backend, and the floor's)
    senders: int
    receivers: int
    sizes: list[int]  # bytes per message
    iters: int = 200
    warmup: int = 20
    pattern: str = "m2n"
    slots: int = 2
    timeout_s: float = 60.0
    duplex: bool = False  # both directions at once: every process sends `size` bytes to each peer, then receives

    def __post_init__(self) -> None:
        if self.pattern not in PATTERNS:
            raise ValueError(f"pattern {self.pattern!r} is not one of {', '.join(PATTERNS)}")
        if self.backend not in BACKENDS + ("torch",):
            raise ValueError(f"backend {self.backend!r} is not one of {', '.join(BACKENDS)}, torch")
        if self.pattern == "ping-pong" and (self.senders, self.receivers) != (1, 1):
            raise ValueError("the ping-pong pattern runs 1 sender and 1 receiver (--senders 1 --receivers 1)")
        if self.pattern == "one-to-n" and self.senders != 1:
            raise ValueError("the one-to-n pattern has exactly one sender (--senders 1)")
        if self.duplex and self.pattern != "m2n":
            raise ValueError("--duplex runs the m2n pattern (both directions of every pair at once); "
                             "ping-pong already alternates directions")
        if self.senders < 1 or self.receivers < 1 or self.iters < 1 or self.warmup < 0:
            raise ValueError("senders, receivers and iters must be at least 1, warmup at least 0")
        if min(self.sizes) < STAMP.size:
            raise ValueError(f"message sizes must be at least {STAMP.size} bytes (they carry a timestamp)")

    def iterations(self, size: int) -> tuple[int, int]:
        """(warm-up, timed) iterations at `size`: `iters` up to 1 MiB, then as many as move the
        same bytes as `iters` at 1 MiB (at least 50), so 16 MiB runs do not take minutes."""
        if size <= FULL_ITERATIONS_UP_TO:
            return self.warmup, self.iters
        scale = FULL_ITERATIONS_UP_TO / size
        return max(1, round(self.warmup * scale)) if self.warmup else 0, \
            max(min(self.iters, MIN_ITERATIONS), round(self.iters * scale))

    def messages_per_iteration(self) -> int:
        if self.pattern == "ping-pong":
            return 2
        return self.senders * self.receivers * (2 if self.duplex else 1)


@dataclass
class Result:
    system: str  # "m2n", "torch" or "floor"
    backend: str  # the M2N backend (m2n, floor) or the torch.distributed one (gloo)
    pattern: str
    senders: int
    receivers: int
    bytes: int
    duplex: bool
    iters: int  # timed iterations at this size
    p50_us: float
    p99_us: float
    p999_us: float
    gbps: float  # GB/s of payload, all pairs and directions together
    msg_rate: float  # messages per second, all pairs together


@dataclass
class Role:
    """One benchmark process: which system, which endpoint, the spec, and wiring extras."""

    system: str
    name: str
    index: int
    sender: bool
    spec: dict
    extra: dict = field(default_factory=dict)


def names(spec: BenchSpec) -> tuple[list[str], list[str]]:
    return [f"s{i}" for i in range(spec.senders)], [f"r{j}" for j in range(spec.receivers)]
