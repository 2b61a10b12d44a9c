"""An attention node's token deltas, waiting for the driver's pump to take them.

Delivery is acknowledged: each delta gets a sequence number, a poll names the last one its
poller received (the cursor), and only then are those dropped. A poll is a Ray call: when the
node is stopped (SIGSTOP, a frozen host) the driver's call times out, but the call itself still
runs once the node resumes, and its answer goes nowhere. Had it taken the deltas, they would be
lost (requests streaming nothing, never ending); acknowledged, the next poll returns them again.
"""

from __future__ import annotations

import os
import threading
import uuid

from megainfer.messages import DeltaBatch, RequestDelta


class DeltaOutbox:
    def __init__(self) -> None:
        self.incarnation = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"  # this process's: a restart counts anew
        self._ready = threading.Condition()
        self._deltas: list[tuple[int, RequestDelta]] = []  # (sequence number, delta), oldest first
        self._next = 1

    def put(self, deltas: list[RequestDelta]) -> None:
        if not deltas:
            return
        with self._ready:
            for delta in deltas:
                self._deltas.append((self._next, delta))
                self._next += 1
            self._ready.notify_all()

    def poll(self, incarnation: str | None, after: int, timeout: float) -> DeltaBatch:
        """The deltas after `after` (all of them when `incarnation` is not this process's:
        the poller's cursor counted another process's deltas); waits up to `timeout` for one."""
        if incarnation != self.incarnation:
            after = 0
        with self._ready:
            self._deltas = [(seq, d) for seq, d in self._deltas if seq > after]  # acknowledged: gone
            if not self._deltas:
                self._ready.wait(timeout)
            if not self._deltas:
                return DeltaBatch(self.incarnation, max(after, self._next - 1))
            return DeltaBatch.of(self.incarnation, self._deltas[-1][0], [d for _, d in self._deltas])
