"""An engine served to other threads, one step at a time: the step every server of an engine
runs in its `StepLoop` — the colocated engine (`server/engine_backend.py`) and an attention
node (`deploy/attention_node.py`).

Requests and aborts enter through the engine's input queue (`QueuedEngine`, any thread), drained
between steps.
Each step runs under `lock`; whoever reads the engine between steps (metrics, the router's
snapshots, resources) takes it through `between_steps`. The step's deltas go to `deliver`
(a server's stream registry, a node's outbox) once the lock is released; a step scheduled
ahead and settled inside the next hands its deltas over at once."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from megainfer.engine.engine import Engine
from megainfer.engine.queued_engine import QueuedEngine
from megainfer.errors import DataPlaneError
from megainfer.messages import DeltaColumns, ErrorCode


class EngineSteps:
    def __init__(self, engine: Engine, deliver: Callable[[DeltaColumns], None], idle_wait_s: float) -> None:
        """idle_wait_s: how long an idle engine waits for a request before it steps again (a
        request ends the wait at once); a disaggregated node, which takes part in every step of
        its deployment, waits only while the whole deployment is idle."""
        self.engine = engine
        self.queued = QueuedEngine(engine)
        self.deliver = deliver
        self.idle_wait_s = idle_wait_s
        self.lock = threading.Lock()  # held by each step: readers of the engine wait for its end
        self.busy_seconds = 0.0  # wall time inside steps that had work (schedule, run, sample, detokenize)

    def step(self) -> float | None:
        """Wait while idle, then one step if there is one to take; its deltas delivered. Returns
        when the step began (time.perf_counter()), None if it did not step. Raises DataPlaneError
        when the data plane broke mid-step (nothing more can be served now)."""
        queued, runner = self.queued, self.engine.runner
        if not queued.has_work() and not runner.deployment_busy:
            queued.wait_for_work(self.idle_wait_s)
            if not queued.has_work() and not runner.steps_when_idle:
                return None
        with self.lock:
            started = time.perf_counter()
            busy = queued.has_work()
            deltas = queued.step_columns(emit=self.deliver)
            if busy:
                self.busy_seconds += time.perf_counter() - started
        self.deliver(deltas)
        failed = [d for _, d in deltas.others if d.error_code is ErrorCode.UNAVAILABLE]
        if failed:
            raise DataPlaneError(failed[0].error)
        return started

    @contextmanager
    def between_steps(self) -> Iterator[Engine]:
        """The engine between two steps, with the requests queued since the last one joined (they
        count as waiting, and a router told they reached this engine must see them)."""
        with self.lock:
            self.deliver(DeltaColumns.of(self.queued.drain()))
            yield self.engine

    def fail_all(self, error: str) -> None:
        """End every request, queued or running, with `error` (nothing will serve them)."""
        with self.lock:
            self.deliver(DeltaColumns.of(self.queued.fail_all(error)))
