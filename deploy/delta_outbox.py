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

from megainfer.messages import DeltaBatch, DeltaColumns, RequestDelta


class DeltaOutbox:
    def __init__(self) -> None:
        self.incarnation = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"  # this process's: a restart counts anew
        self._ready = threading.Condition()
        # Each step's deltas, in columns, with the sequence number of the last of them, oldest
        # first. A poll answers whole entries, so a cursor always falls between two.
        self._steps: list[tuple[int, DeltaColumns]] = []
        self._next = 1

    def put(self, deltas: DeltaColumns | list[RequestDelta]) -> None:
        columns = deltas if isinstance(deltas, DeltaColumns) else DeltaColumns.of(deltas)
        if not len(columns):
            return
        with self._ready:
            self._next += len(columns)
            self._steps.append((self._next - 1, columns))
            self._ready.notify_all()

    def poll(self, incarnation: str | None, after: int, timeout: float) -> DeltaBatch:
        """The deltas after `after` (all of them when `incarnation` is not this process's:
        the poller's cursor counted another process's deltas); waits up to `timeout` for one."""
        if incarnation != self.incarnation:
            after = 0
        with self._ready:
            self._steps = [(last, columns) for last, columns in self._steps if last > after]  # acknowledged: gone
            if not self._steps:
                self._ready.wait(timeout)
            if not self._steps:
                return DeltaBatch(self.incarnation, max(after, self._next - 1))
            if len(self._steps) == 1:
                return DeltaBatch(self.incarnation, self._steps[0][0], self._steps[0][1])
            merged = DeltaColumns()
            for _, columns in self._steps:
                merged.extend(columns)
            return DeltaBatch(self.incarnation, self._steps[-1][0], merged)
