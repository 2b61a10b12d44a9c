"""What the servers need from whatever generates: submit, abort, stream deltas, info.

`deploy.deployment.Deployment` (attention and expert nodes on Ray), `deploy.replicas.ReplicaSet`
and `EngineBackend` (one colocated engine in a thread) provide it; `StreamRegistry` is the
per-request queue plumbing they share.
"""

from __future__ import annotations

from collections import deque
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from megainfer.messages import ErrorCode, FinishReason, NodeRole, NodeStatus, RequestDelta
from megainfer.sampling_params import SamplingParams


@dataclass
class RequestStream:
    """One request's deltas, in order: queued for a thread that calls `get`, or handed to a
    listener (an event loop's, through `loop.call_soon_threadsafe`) once one is set."""

    request_id: str
    prompt_tokens: int = 0
    arrival: float = field(default_factory=time.monotonic)
    # Queued deltas and their one lock (a deque and a condition, not a queue.Queue: the driver
    # puts every request's delta of every step, and a Queue takes a second lock per put).
    deltas: deque[RequestDelta] = field(default_factory=deque)
    _listener: Callable[[RequestDelta], None] | None = field(default=None, repr=False)
    _ready: threading.Condition = field(default_factory=threading.Condition, repr=False)

    def put(self, delta: RequestDelta) -> None:
        """Deliver a delta (from the thread that pumps the engine's output)."""
        with self._ready:  # held while the listener runs, so no delta overtakes one being handed over
            if self._listener is None:
                self.deltas.append(delta)
                self._ready.notify()
            else:
                self._listener(delta)

    def listen(self, listener: Callable[[RequestDelta], None]) -> None:
        """Hand every delta to `listener` from now on, those already queued first. It runs on
        the delivering thread and must not block (e.g. `loop.call_soon_threadsafe(q.put_nowait, d)`)."""
        with self._ready:
            while self.deltas:
                listener(self.deltas.popleft())
            self._listener = listener

    def get(self, timeout: float) -> RequestDelta | None:
        with self._ready:
            if not self.deltas and not self._ready.wait_for(lambda: self.deltas, timeout):
                return None
            return self.deltas.popleft()

    def wait_finished(self, stall_s: float) -> RequestDelta:
        """Consume deltas until the last one and return it. Raises DataPlaneError if the
        request failed, or if no delta came for `stall_s` seconds."""
        from megainfer.errors import DataPlaneError

        while True:
            delta = self.get(stall_s)
            if delta is None:
                raise DataPlaneError(f"request {self.request_id} stalled: nothing for {stall_s:g} s")
            if delta.finished:
                if delta.finish_reason is FinishReason.ERROR:
                    raise DataPlaneError(f"request {self.request_id} failed: {delta.error}")
                return delta


@dataclass
class NodeInfo:
    """One node (or rank) as ServerInfo shows it."""

    name: str
    role: NodeRole
    state: NodeStatus
    detail: str = ""


@dataclass
class BackendInfo:
    model: str
    plan_yaml: str  # "" for a colocated engine
    nodes: list[NodeInfo]


class GenerationBackend(Protocol):
    def submit(self, request_id: str, prompt, params: SamplingParams) -> RequestStream:
        """Start a request. Raises RequestError (bad request), Overloaded (queue full) or
        DataPlaneError (temporarily unavailable)."""

    def abort(self, request_id: str) -> bool: ...

    def info(self) -> BackendInfo: ...

    def metrics_snapshot(self):
        """A `megainfer.server.metrics.MetricsSnapshot`, read at each scrape."""

    def close(self) -> None: ...


class StreamRegistry:
    """Open request streams by id; deliver deltas to them; forget finished ones."""

    def __init__(self, max_open: int) -> None:
        self.max_open = max_open  # beyond this, new requests are refused (backpressure)
        self._streams: dict[str, RequestStream] = {}
        self._lock = threading.Lock()

    def open(self, request_id: str) -> RequestStream:
        from megainfer.errors import Overloaded, RequestError

        with self._lock:
            if request_id in self._streams:
                raise RequestError(f"request id {request_id!r} is already in use")
            if len(self._streams) >= self.max_open:
                raise Overloaded(f"{len(self._streams)} requests in flight (limit {self.max_open}); retry later")
            stream = self._streams[request_id] = RequestStream(request_id)
            return stream

    def close(self, request_id: str) -> None:
        with self._lock:
            self._streams.pop(request_id, None)

    def deliver(self, delta: RequestDelta) -> None:
        with self._lock:
            stream = self._streams.get(delta.request_id)
            if stream is not None and delta.finished:
                del self._streams[delta.request_id]
        if stream is not None:
            stream.put(delta)

    def fail_all(self, error: str, code: ErrorCode = ErrorCode.INTERNAL) -> None:
        """End every open stream with a failure (what produced their deltas is gone)."""
        with self._lock:
            open_ids = list(self._streams)
        for request_id in open_ids:
            self.deliver(RequestDelta.failure(request_id, error, code))

    def is_open(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._streams

    def __len__(self) -> int:
        return len(self._streams)
