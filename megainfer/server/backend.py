"""What the servers need from whatever generates: submit, abort, stream deltas, info.

`deploy.deployment.Deployment` (attention and expert nodes on Ray), `deploy.replicas.ReplicaSet`
and `EngineBackend` (one colocated engine in a thread) provide it; `StreamRegistry` is the
per-request queue plumbing they share.
"""

from __future__ import annotations

from collections import deque
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from megainfer.messages import (DeltaColumns, ErrorCode, ExpertLoadReport, FinishReason, NodeRole, NodeStatus,
                                RequestDelta)
from megainfer.sampling_params import SamplingParams

# What both frontends answer when asked to reset a prefix cache that is not there.
PREFIX_CACHING_OFF = ("prefix caching is off on this server (started with --no-enable-prefix-caching, or a model "
                      "it does not serve); there is nothing to reset")


@dataclass(slots=True)
class RequestStream:
    """One request's deltas, in order, read by its consumer: a thread that calls `get`, or one
    woken through `listen` (a fan-in queue, an event loop) that then calls `pop`.

    The driver delivers every request's delta of every step, so a delivery is one deque append
    and one wake, with no lock and no object built (`StreamRegistry.deliver_batch` queues a
    plain delta as its token and its text; `pop` makes the `RequestDelta` on the reading thread,
    as it writes the response). Order needs no lock: one thread delivers to a stream and only
    its consumer pops.

    Small on purpose: a plan's serving process holds one per request in flight (9,420 at the
    Qwen3-235B plan's scale) and its delivery touches each once a step, so slots and no
    condition variable until a `get` needs one: the fan-out of a step then reads about 40% less
    memory (`megainfer bench host`'s driver row)."""

    request_id: str
    prompt_tokens: int = 0
    arrival: float = field(default_factory=time.monotonic)
    # Deltas, a plain one as two items (token, text: `StreamRegistry.deliver_batch`)
    deltas: deque[RequestDelta | int | str] = field(default_factory=deque)
    _wake: Callable[[], None] | None = field(default=None, repr=False)
    # Made by the first `get` (its consumer's thread, the only one that makes it). A delivery
    # that finds none yet wakes nobody: the `get` that makes it looks at the deltas after.
    _ready: threading.Condition | None = field(default=None, repr=False)

    def put(self, delta: RequestDelta) -> None:
        """Deliver a delta (from the thread that pumps the engine's output)."""
        self.deltas.append(delta)
        self.woken()

    def woken(self) -> None:
        """A delta was appended: tell the consumer."""
        wake = self._wake
        if wake is not None:
            wake()
            return
        ready = self._ready
        if ready is not None:
            with ready:
                ready.notify()

    def listen(self, wake: Callable[[], None]) -> None:
        """Call `wake()` for every delta from now on (and now, once per delta already queued).
        It runs on the delivering thread and must not block; the consumer then calls `pop`. A
        delta delivered while this runs may be announced twice, so a wake may find nothing."""
        self._wake = wake
        for item in list(self.deltas):
            if not isinstance(item, str):  # a delta, or a plain one's token (its text follows)
                wake()

    def pop(self) -> RequestDelta | None:
        """The next delta, or None if there is none."""
        deltas = self.deltas
        try:
            item = deltas.popleft()
        except IndexError:
            return None
        if isinstance(item, RequestDelta):
            return item
        return RequestDelta(self.request_id, [item], deltas.popleft())  # a plain delta: its token, then its text

    def get(self, timeout: float) -> RequestDelta | None:
        ready = self._ready
        if ready is None:
            ready = self._ready = threading.Condition()
        with ready:  # the deltas looked at only now: one delivered before `_ready` was set is seen
            if not self.deltas and not ready.wait_for(lambda: self.deltas, timeout):
                return None
        return self.pop()

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


def foreign_places(request_ids: list[str], owner: Mapping[str, int], node: int) -> list[int]:
    """The places in `request_ids` (a poll answer of node `node`) of requests `owner` does not
    place at `node`: one lookup each in C, then a look at each place only when some differ."""
    owners = list(map(owner.get, request_ids))
    if owners.count(node) == len(owners):
        return []
    return [place for place, n in enumerate(owners) if n != node]


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

    def rebalance_experts(self):
        """Re-place the experts now (a `RebalanceReport`); ConfigError where there is nothing to
        re-place (a colocated engine, a plan whose experts cannot move, autoscaled replicas)."""

    def reset_prefix_cache(self) -> bool:
        """Forget every attention node's cached prefixes (vLLM's route, for benchmarks); False
        where prefix caching is off."""

    def expert_load(self) -> ExpertLoadReport | None:
        """The experts' load over the window a re-placement reads (each (layer, expert)'s pairs,
        decode and prefill apart): the expert nodes' own counts in a deployment, the gating
        kernel's in a colocated engine; None before any step was counted."""

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

    def deliver_batch(self, batch: DeltaColumns) -> None:
        """Every delta of a step (or of a poll answer) to its stream, in order. A plain delta
        costs a lookup, an append and a wake (`RequestStream`); the others go through `deliver`."""
        taken = 0
        for before, delta in batch.others:
            self._deliver_plain(batch, taken, before)
            self.deliver(delta)
            taken = before
        self._deliver_plain(batch, taken, len(batch.request_ids))

    def _deliver_plain(self, batch: DeltaColumns, start: int, stop: int) -> None:
        if start == stop:
            return
        # Lock-free reads of the dict: a plain delta never ends its stream, and a stream closed
        # meanwhile only gets a delta nobody reads.
        lookup = self._streams.get
        ids, tokens, texts = batch.request_ids, batch.token_ids, batch.texts
        if start or stop != len(ids):
            ids, tokens, texts = ids[start:stop], tokens[start:stop], texts[start:stop]
        # A plain delta is queued as its token then its text, one atomic `extend`: nothing is
        # allocated that outlives the call, so thousands of deltas a step start no collection
        # of the garbage collector's older generations (a tuple each did, every few steps).
        for stream, token, text in zip(map(lookup, ids), tokens, texts):
            if stream is not None:
                stream.deltas.extend((token, text))
                # `stream.woken()` written out: the call costs 0.5 ms per 11,450 deltas here.
                wake = stream._wake
                if wake is not None:
                    wake()
                else:
                    stream.woken()

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
