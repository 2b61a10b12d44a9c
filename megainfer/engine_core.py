"""An engine served by a step loop of its own, fed through an input queue (vLLM's
`EngineCore`): any thread submits or aborts; the loop drains the queue between steps.

A request is checked and tokenized on the caller's thread (a bad one raises there, at once)
and queued without waiting for the step that holds the engine, so submission never waits
on compute (or, on an attention node, on the M2N exchanges of a whole step). The queue
carries prepared sequences and aborts in the order they were made, so an abort never
overtakes its request.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass

from megainfer.engine import Engine, Prompt
from megainfer.errors import RequestError
from megainfer.messages import RequestDelta
from megainfer.sampling_params import SamplingParams
from megainfer.sequence import Sequence


@dataclass(frozen=True)
class _Abort:
    request_id: str


class EngineCore:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._inbox: queue.SimpleQueue[Sequence | _Abort] = queue.SimpleQueue()
        # Ids submitted and not yet ended, queued or in the engine: ids stay unique without
        # asking the engine (which the step holds).
        self._live: set[str] = set()
        self._live_lock = threading.Lock()
        self._arrived = threading.Event()  # something was queued since the loop last drained

    # -- any thread ---------------------------------------------------------------------------
    def submit(self, request_id: str, prompt: Prompt, params: SamplingParams | None = None) -> Sequence:
        """Check and queue a request; raises RequestError for a bad one. The loop hands it to
        the scheduler before its next step."""
        seq = self.engine.prepare_request(request_id, prompt, params)
        with self._live_lock:
            if request_id in self._live:
                raise RequestError(f"request id {request_id!r} is already in use")
            self._live.add(request_id)
        self._inbox.put(seq)
        self._arrived.set()
        return seq

    def abort(self, request_id: str) -> bool:
        """Cancel a request (its KV blocks are freed before the next step). False if it is
        unknown or already ended."""
        with self._live_lock:
            known = request_id in self._live
        if known:
            self._inbox.put(_Abort(request_id))
            self._arrived.set()
        return known

    def wait_for_work(self, timeout: float) -> bool:
        """Block until something is queued or `timeout` passes (an idle loop's sleep)."""
        return self._arrived.wait(timeout)

    def wake(self) -> None:
        """End a `wait_for_work` early (the loop is stopping)."""
        self._arrived.set()

    @property
    def num_queued(self) -> int:
        return self._inbox.qsize()

    # -- the step loop ------------------------------------------------------------------------
    def has_work(self) -> bool:
        return not self._inbox.empty() or self.engine.has_unfinished_requests()

    def step(self) -> list[RequestDelta]:
        """Drain the queue into the engine, then one engine step."""
        self.drain()
        return self._ended(self.engine.step())

    def drain(self) -> None:
        self._arrived.clear()
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, _Abort):
                self.engine.abort(item.request_id)
                with self._live_lock:
                    self._live.discard(item.request_id)
            else:
                self.engine.add_sequence(item)

    def fail_all(self, error: str) -> list[RequestDelta]:
        """Fail every request, queued or running (the node cannot serve them)."""
        self.drain()
        return self._ended(self.engine.fail_all(error))

    def _ended(self, deltas: list[RequestDelta]) -> list[RequestDelta]:
        finished = [d.request_id for d in deltas if d.finished]
        if finished:
            with self._live_lock:
                self._live.difference_update(finished)
        return deltas
