"""The engine requests behind one API request (each prompt times n), bridged into asyncio.

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
from dataclasses import dataclass, field
from functools import partial

from megainfer.messages import FinishReason, PositionLogprobs, RequestDelta
from megainfer.sampling_params import SamplingParams
from megainfer.server.backend import GenerationBackend, RequestStream
from megainfer.server.metrics import ServingMetrics

logger = logging.getLogger(__name__)


@dataclass
class Choice:
    """One engine request: choice `index` of the response, generating for `prompt`."""

    index: int
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    prompt_text: str = ""  # what echo prepends
    stream: RequestStream | None = None
    # What came back so far
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, delta: RequestDelta) -> None:
        self.text.append(delta.new_text)
        self.token_ids += delta.new_token_ids
        self.logprobs += delta.logprobs or []
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        if delta.finished:
            self.finish_reason = delta.finish_reason
            self.stop_reason = delta.stop_reason


class LoopWakes:
    """The wakes of every stream read on one event loop, gathered: the delivering thread appends
    (group, choice) and schedules one drain while none is pending, so a poll answer of thousands
    of deltas costs the loop one `call_soon_threadsafe` (a self-pipe write), not one each."""

    _of_loop: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopWakes]" = weakref.WeakKeyDictionary()
    _made = threading.Lock()

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._woken: deque[tuple[ChoiceStreams, Choice]] = deque()
        self._scheduled = False

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> "LoopWakes":
        with cls._made:
            wakes = cls._of_loop.get(loop)
            if wakes is None:
                wakes = cls._of_loop[loop] = cls(loop)
            return wakes

    def wake(self, group: "ChoiceStreams", choice: Choice) -> None:
        """On the delivering thread."""
        self._woken.append((group, choice))
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
            group, choice = woken.popleft()
            group.take(choice)


class ChoiceStreams:
    def __init__(self, backend: GenerationBackend, metrics: ServingMetrics | None, executor: Executor) -> None:
        self.backend = backend
        self.metrics = metrics
        self.executor = executor
        self.loop = asyncio.get_running_loop()
        self.choices: list[Choice] = []
        self._queue: asyncio.Queue[tuple[Choice, RequestDelta]] = asyncio.Queue()
        self._wakes = LoopWakes.of(self.loop)
        self._lock = threading.Lock()  # choices submitted vs. closed, across the submitting thread
        self._closed = False

    async def submit(self, choices: list[Choice]) -> None:
        """Start every choice's request; if one is refused, abort those already started and raise."""
        await self.loop.run_in_executor(self.executor, self._submit_all, choices)

    def _submit_all(self, choices: list[Choice]) -> None:
        for choice in choices:
            try:
                choice.stream = self.backend.submit(choice.request_id, choice.prompt_ids, choice.params)
            except BaseException:
                self._abort([c.request_id for c in self.choices])
                self.choices = []
                raise
            with self._lock:
                self.choices.append(choice)
                closed = self._closed
            if closed:  # the client left while its requests were being submitted
                self._abort([choice.request_id])
                continue
            choice.stream.listen(partial(self._wakes.wake, self, choice))

    def take(self, choice: Choice) -> None:
        """On the loop: `choice`'s next delta (one wake's) into the group's queue."""
        delta = choice.stream.pop()
        if delta is not None:  # else a delta announced twice (`RequestStream.listen`)
            self._queue.put_nowait((choice, delta))

    async def deltas(self) -> AsyncIterator[tuple[Choice, RequestDelta]]:
        """Every choice's deltas as they come, each added to its choice first, until all finished."""
        pending = sum(not c.finished for c in self.choices)
        while pending:
            choice, delta = await self._queue.get()
            if choice.finished:
                continue
            self._observe(choice, delta)
            choice.add(delta)
            pending -= delta.finished
            yield choice, delta

    def _observe(self, choice: Choice, delta: RequestDelta) -> None:
        now = time.monotonic()
        if delta.new_token_ids:
            if choice.last_token_at is not None and self.metrics is not None:
                self.metrics.observe_token_gap(now - choice.last_token_at)
            choice.first_token_at = choice.first_token_at or now
            choice.last_token_at = now
        if delta.finished:
            self._observe_request(choice, delta, now)

    def _observe_request(self, choice: Choice, final: RequestDelta, now: float) -> None:
        if self.metrics is None or choice.stream is None:
            return
        arrival = choice.stream.arrival
        tokens = len(choice.token_ids) + len(final.new_token_ids)
        ttft = None if choice.first_token_at is None else choice.first_token_at - arrival
        tpot = (choice.last_token_at - choice.first_token_at) / (tokens - 1) if tokens > 1 else None
        self.metrics.observe_request(final, ttft, tpot, now - arrival)

    def close(self) -> None:
        """Abort every choice that has not finished (in the executor: a deployment's abort waits
        on its node). Harmless after they all finished."""
        with self._lock:
            self._closed = True
            open_choices = [c for c in self.choices if not c.finished]
        if not open_choices:
            return
        now = time.monotonic()
        for choice in open_choices:
            choice.finish_reason = FinishReason.ABORT
            self._observe_request(choice, RequestDelta(choice.request_id, [], "", True, FinishReason.ABORT), now)
        self.executor.submit(self._abort, [c.request_id for c in open_choices])

    def _abort(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            try:
                self.backend.abort(request_id)
            except Exception:  # one abort failing (a node gone) must not keep the others' blocks
                logger.exception("abort of %s failed", request_id)
