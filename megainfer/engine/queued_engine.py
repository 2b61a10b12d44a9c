"""An `Engine` fed through an input queue, as vLLM's engine core is: any thread adds or aborts
a request; the step loop (`engine_steps.py`) drains the queue between steps. (Named for what
it is: vLLM calls the inner engine its core, which is megainfer's `Engine`.)

A request is checked and tokenized on the caller's thread (a bad one raises there, at once)
and queued without waiting for the step that holds the engine, so submission never waits
on compute (or, on an attention node, on the M2N exchanges of a whole step). The queue
carries prepared sequences and aborts in the order they were made, so an abort never
overtakes its request.
"""

from __future__ import annotations

import operator
import queue
import threading
from collections.abc import Callable
from functools import partial
from dataclasses import dataclass

from megainfer.engine.engine import Engine, Prompt
from megainfer.errors import RequestError
from megainfer.messages import DeltaColumns, ErrorCode, RequestDelta
from megainfer.sampling_params import SamplingParams
from megainfer.scheduling.sequence import Sequence


@dataclass(frozen=True)
class _Abort:
    seq: Sequence  # the request to cancel (not just its id: the id may be reused once it ended)


class QueuedEngine:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._inbox: queue.SimpleQueue[Sequence | _Abort] = queue.SimpleQueue()
        # Requests submitted and not yet ended or aborted, queued or in the engine, by id: ids
        # stay unique without asking the engine (which the step holds).
        self._live: dict[str, Sequence] = {}
        self._live_lock = threading.Lock()
        self._arrived = threading.Event()  # something was queued since the loop last drained

    # -- any thread ---------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams | None = None) -> Sequence:
        """Check and queue a request; raises RequestError for a bad one. The loop hands it to
        the scheduler before its next step."""
        seq = self.engine.prepare_request(request_id, prompt, params)
        with self._live_lock:
            if request_id in self._live:
                raise RequestError(f"request id {request_id!r} is already in use")
            self._live[request_id] = seq
        self._inbox.put(seq)
        self._arrived.set()
        return seq

    def abort(self, request_id: str) -> bool:
        """Cancel a request (its KV blocks are freed before the next step; its id may be used
        again at once). False if it is unknown or already ended."""
        with self._live_lock:
            seq = self._live.pop(request_id, None)
        if seq is not None:
            self._inbox.put(_Abort(seq))
            self._arrived.set()
        return seq is not None

    def wait_for_work(self, timeout: float) -> bool:
        """Block until something is queued or `timeout` passes (an idle loop's sleep)."""
        return self._arrived.wait(timeout)

    def wake(self) -> None:
        """End a `wait_for_work` early (the loop is stopping)."""
        self._arrived.set()

    @property
    def num_requests(self) -> int:
        """Requests it holds: running, waiting, or queued for the next step."""
        scheduler = self.engine.scheduler
        return scheduler.num_running + scheduler.num_waiting + self.num_queued

    @property
    def num_queued(self) -> int:
        return self._inbox.qsize()

    # -- the step loop ------------------------------------------------------------------------
    def has_work(self) -> bool:
        return not self._inbox.empty() or self.engine.has_unfinished_requests()

    def step(self) -> list[RequestDelta]:
        """Drain the queue into the engine, then one engine step."""
        return self.step_columns().deltas

    def step_columns(self, emit: Callable[[DeltaColumns], None] | None = None) -> DeltaColumns:
        """`step`, its deltas in columns (what an attention node hands the driver). With `emit`,
        deltas the engine makes mid-step (a step scheduled ahead, settled inside the next: see
        `Engine.step_columns`) are checked and handed to it at once."""
        refused = self.drain()
        sink = partial(self._emit_checked, emit) if emit is not None else None
        columns = self._checked(self.engine.step_columns(sink))
        if not refused:
            return columns
        out = DeltaColumns.of(refused)
        out.extend(columns)
        return out

    def _emit_checked(self, emit: Callable[[DeltaColumns], None], columns: DeltaColumns) -> None:
        emit(self._checked(columns))

    def _checked(self, columns: DeltaColumns) -> DeltaColumns:
        """The deltas of requests the callers still hold; the ids of those that ended forgotten."""
        columns = self._current_columns(columns)
        self._ended([d for _, d in columns.others])
        return columns

    def drain(self) -> list[RequestDelta]:
        """Hand what was queued to the engine, in order (between steps; the caller holds the
        engine). Returns the last deltas of requests the scheduler refused."""
        self._arrived.clear()
        refused = []
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return refused
            if isinstance(item, _Abort):
                if self.engine.scheduler.requests.get(item.seq.request_id) is item.seq:
                    self.engine.abort(item.seq.request_id)
                continue
            try:
                self.engine.add_sequence(item)
            except ValueError as exc:  # the scheduler refused it: this request alone fails
                with self._live_lock:
                    if self._live.get(item.request_id) is item:
                        del self._live[item.request_id]
                refused.append(RequestDelta.failure(item.request_id, str(exc), ErrorCode.INTERNAL))

    def fail_all(self, error: str) -> list[RequestDelta]:
        """Fail every request, queued or running (the node cannot serve them)."""
        refused = self.drain()
        return refused + self._ended(self.engine.fail_all(error))

    def _current(self, deltas: list[RequestDelta]) -> list[RequestDelta]:
        """Deltas of the requests the callers still hold: not of one aborted while the step ran
        (whose id a new request may already have taken)."""
        requests = self.engine.scheduler.requests
        with self._live_lock:
            return [d for d in deltas if (seq := self._live.get(d.request_id)) is not None
                    and (seq.is_finished or requests.get(d.request_id) is seq)]

    def _current_columns(self, columns: DeltaColumns) -> DeltaColumns:
        """`_current` of a step's columns: its plain deltas checked with one C-level lookup each
        (a plain delta's request runs on, so it is current where the engine holds the very
        sequence the callers hold), the others one by one."""
        ids = columns.request_ids
        held = list(map(self.engine.scheduler.requests.get, ids))
        with self._live_lock:
            live = list(map(self._live.get, ids))
        if not all(map(operator.is_, live, held)):
            columns = columns.without_places([p for p, (a, b) in enumerate(zip(live, held)) if a is not b])
        if columns.others:
            current = {id(d) for d in self._current([d for _, d in columns.others])}
            columns.others = [(before, d) for before, d in columns.others if id(d) in current]
        return columns

    def _ended(self, deltas: list[RequestDelta]) -> list[RequestDelta]:
        """Forget the ids of requests that ended (unless the id was since taken by a new request)."""
        finished = [d.request_id for d in deltas if d.finished]
        if finished:
            with self._live_lock:
                for request_id in finished:
                    seq = self._live.get(request_id)
                    if seq is not None and seq.is_finished:  # not a new request that took the id since
                        del self._live[request_id]
        return deltas
