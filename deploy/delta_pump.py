"""A thread per attention node that long-polls the node's outbox and hands each token delta
to the frontend, a batch at a time (`DeltaBatch`'s columns): tokens ride Ray's control plane, a
few bytes per request and step. Each poll
acknowledges what the last one returned (delta_outbox.py), so a poll lost to a timeout loses
no delta."""

from __future__ import annotations

import threading
import time
from typing import Callable

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from megainfer.messages import DeltaBatch

POLL_S = 0.05  # the node answers a poll after this long with nothing to say
POLL_TIMEOUT_S = 10.0
RETRY_S = 0.2  # after a failed poll: the supervisor handles the node, the pump keeps listening


class DeltaPump:
    def __init__(self, node, index: int, deliver: Callable[[int, DeltaBatch], None]) -> None:
        """deliver(index, batch): a poll answer of attention node number `index` (its columns)."""
        self.node = node
        self.index = index
        self.deliver = deliver
        self._incarnation: str | None = None  # the node process the cursor counts in
        self._cursor = 0
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"deltas-{index}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                batch = ray.get(self.node.poll.remote(self._incarnation, self._cursor, POLL_S),
                                timeout=POLL_TIMEOUT_S)
            except (RayActorError, GetTimeoutError):
                time.sleep(RETRY_S)
                continue
            self._incarnation, self._cursor = batch.incarnation, batch.last
            if len(batch):
                self.deliver(self.index, batch)

    def stop(self) -> None:
        self._stop.set()

    def join(self, timeout_s: float) -> None:
        self.thread.join(timeout_s)
