"""The engine requests behind one API request (a `RequestGroup`: each prompt times n), bridged
into asyncio.

Submitting may block (a deployment's submit waits on its attention node), so it runs in the
server's executor; each request's deltas then arrive on the engine's (or the pump's) thread,
whose wakes are gathered per event loop (`LoopWakes`: one `call_soon_threadsafe` per burst, not
per delta) and read on the loop into one queue for the whole group, so the loop never waits on
the engine. `close()` aborts whatever has not finished (the client left, or
one choice failed), freeing its KV blocks.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import AsyncIterator
from concurrent.futures import Executor
from functools import partial

from megainfer.messages import RequestDelta
from megainfer.request_group import Completion, RequestGroup
from megainfer.sampling_params import SamplingParams
from megainfer.server.backend import GenerationBackend, RequestStream
from megainfer.server.metrics import ServingMetrics, take_delta

logger = logging.getLogger(__name__)


class LoopWakes:
    """The wakes of every stream read on one event loop, gathered: the delivering thread appends
    (group, completion index) and schedules one drain while none is pending, so a poll answer of thousands
    of deltas costs the loop one `call_soon_threadsafe` (a self-pipe write), not one each."""

    _of_loop: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopWakes]" = weakref.WeakKeyDictionary()
    _made = threading.Lock()

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._woken: deque[tuple[ChoiceStreams, int]] = deque()
        self._scheduled = False

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> "LoopWakes":
        with cls._made:
            wakes = cls._of_loop.get(loop)
            if wakes is None:
                wakes = cls._of_loop[loop] = cls(loop)
            return wakes

    def wake(self, group: "ChoiceStreams", index: int) -> None:
        """On the delivering thread."""
        self._woken.append((group, index))
        if not self._scheduled:
            self._scheduled = True
            try:
                self.loop.call_soon_threadsafe(self._drain)
            except RuntimeError:  # the loop is closed: the HTTP server stopped
                pass

    def _drain(self) -> None:
        # Cleared before draining: a wake appended from here on schedules a drain of its own.
        self._scheduled = False
        woken = self._woken
        while woken:
            group, index = woken.popleft()
            group.take(index)


class ChoiceStreams:
    def __init__(self, backend: GenerationBackend, metrics: ServingMetrics | None, executor: Executor,
                 group: RequestGroup) -> None:
        self.backend = backend
        self.metrics = metrics
        self.executor = executor
        self.group = group
        self.loop = asyncio.get_running_loop()
        self.streams: list[RequestStream] = []  # by completion index, as submitted
        self._queue: asyncio.Queue[tuple[Completion, RequestDelta]] = asyncio.Queue()
        self._wakes = LoopWakes.of(self.loop)
        self._lock = threading.Lock()  # streams submitted vs. closed, across the submitting thread
        self._closed = False

    @property
    def completions(self) -> list[Completion]:
        return self.group.completions

    async def submit(self) -> None:
        """Start every completion's request; if one is refused, abort those already started and raise."""
        await self.loop.run_in_executor(self.executor, self._submit_all)

    def _submit_all(self) -> None:
        self.group.start(self._submit_one, self.backend.abort)

    def _submit_one(self, request_id: str, prompt, params: SamplingParams) -> RequestStream:
        stream = self.backend.submit(request_id, prompt, params)
        with self._lock:
            index = len(self.streams)
            self.streams.append(stream)
            closed = self._closed
        if closed:  # the client left while its requests were being submitted
            self._abort([request_id])
        else:
            stream.listen(partial(self._wakes.wake, self, index))
        return stream

    def take(self, index: int) -> None:
        """On the loop: completion `index`'s next delta (one wake's) into the group's queue."""
        delta = self.streams[index].pop()
        if delta is not None:  # else a delta announced twice (`RequestStream.listen`)
            self._queue.put_nowait((self.group.completions[index], delta))

    async def deltas(self) -> AsyncIterator[tuple[Completion, RequestDelta]]:
        """Every completion's deltas in the order the group shows them (`RequestGroup.arrived`),
        each added to its completion first, until all finished."""
        group = self.group
        while not group.finished:
            c, delta = await self._queue.get()
            for pair in take_delta(self.metrics, group, c, delta, time.monotonic()):
                yield pair

    def close(self) -> None:
        """Abort every completion that has not finished (in the executor: a deployment's abort
        waits on its node). Harmless after they all finished."""
        with self._lock:
            self._closed = True
            submitted = len(self.streams)  # those not yet submitted are aborted by the submitting thread
            ending = self.group.abort_deltas()
        open_ids = [c.engine_id for c, _ in ending if c.index < submitted]
        if not open_ids:
            return
        now = time.monotonic()
        for c, abort in ending:  # nobody reads them any more: they end here
            take_delta(self.metrics, self.group, c, abort, now)
        self.executor.submit(self._abort, open_ids)

    def _abort(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            try:
                self.backend.abort(request_id)
            except Exception:  # one abort failing (a node gone) must not keep the others' blocks
                logger.exception("abort of %s failed", request_id)
