"""Whether a backend serves: every node it reports is SERVING. Read from `backend.info()` at most
once per `ttl_s` (a deployment asks every node actor), so the HTTP /health probe and the gRPC
health service's poller stay cheap however often they are asked."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from megainfer.messages import NodeStatus
from megainfer.server.backend import GenerationBackend

logger = logging.getLogger(__name__)

READINESS_TTL_S = 1.0


@dataclass(frozen=True)
class Ready:
    ok: bool
    reason: str  # why not ("attention0 wiring, expert1 dead: ..."), "" when ok
    checked_at: float  # time.monotonic() of the info() read


class Readiness:
    def __init__(self, backend: GenerationBackend, ttl_s: float = READINESS_TTL_S) -> None:
        self.backend = backend
        self.ttl_s = ttl_s
        self._last: Ready | None = None
        self._lock = threading.Lock()  # one info() read at a time; the others take its answer

    def check(self) -> Ready:
        with self._lock:
            if self._last is None or time.monotonic() - self._last.checked_at >= self.ttl_s:
                self._last = self._read()
            return self._last

    def _read(self) -> Ready:
        """The backend's answer, stamped when it arrived: a slow read (a node actor dying makes
        info() wait) still holds for a whole TTL, so callers queued behind it take that answer
        instead of each starting another slow read that may land only after the outage."""
        try:
            nodes = self.backend.info().nodes
        except Exception as exc:  # a backend that cannot say how it is does not serve
            logger.warning("readiness: backend info failed: %s", exc)
            return Ready(False, f"backend info failed: {exc}", time.monotonic())
        down = [n for n in nodes if n.state is not NodeStatus.SERVING]
        if not nodes:
            return Ready(False, "no nodes", time.monotonic())
        reason = ", ".join(f"{n.name} {n.state.value}" + (f": {n.detail}" if n.detail else "") for n in down)
        return Ready(not down, reason, time.monotonic())
