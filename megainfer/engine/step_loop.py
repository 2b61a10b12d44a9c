"""The one step loop: a thread that runs a node's steps one after another while it serves, stops
stepping when a step fails (saying why, in `state` and `error`), waits to be told to serve again,
and stops for good on request.

It runs the colocated engine behind `megainfer serve` (`server/engine_backend.py`) and every
node actor of a deployment (`deploy/node_loop.py` adds what the data-plane link needs). What a
step is belongs to the node (`SteppedNode`): an engine's step is `EngineSteps.step`, an expert
node's the worker's."""

from __future__ import annotations

import gc
import logging
import threading
from typing import Protocol

from megainfer.messages import NodeStatus

logger = logging.getLogger(__name__)


class SteppedNode(Protocol):
    def step(self) -> None:
        """One step; raises when the node cannot go on serving (its data plane broke)."""

    def step_failed(self, exc: Exception) -> None:
        """After a step raised: end what the node holds that no step will now serve."""


class StepLoop:
    def __init__(self, name: str, node: SteppedNode) -> None:
        self.name = name
        self.node = node
        self.wired = threading.Event()  # set while it should step
        self.stopping = threading.Event()
        self.state = NodeStatus.WIRING
        self.error: str | None = None
        self.thread: threading.Thread | None = None

    def serve(self) -> None:
        self.state, self.error = NodeStatus.SERVING, None
        self.wired.set()
        if self.thread is None:
            # Everything built so far (weights, caches, the engine) lives as long as the node:
            # moved out of the collector's view, so a full collection mid-step (measured: a
            # 150 ms stall of one layer) walks only what steps create (as vLLM and SGLang do).
            gc.collect()
            gc.freeze()
            self.thread = threading.Thread(target=self._run, name=f"{self.name}-steps", daemon=True)
            self.thread.start()

    @property
    def serving(self) -> bool:
        return self.state is NodeStatus.SERVING

    def interrupt(self) -> None:
        """Stop stepping until `serve` (a deployment re-wires its data plane). New requests are
        refused from now on, not accepted into a step that is about to be abandoned."""
        self.wired.clear()
        if self.state is NodeStatus.SERVING:
            self.state = NodeStatus.WIRING

    def broken(self, error: str, exc: BaseException | None = None) -> None:
        if self.state is NodeStatus.SERVING and not self._quiet_failure():
            # The traceback goes to the log: a peer's death reads the same as a bug here.
            logger.warning("%s: stepping stopped (%s); waiting to serve again", self.name, error, exc_info=exc)
        self.state, self.error = NodeStatus.BROKEN, error
        self.wired.clear()

    def _quiet_failure(self) -> bool:
        """A failure that needs no warning (one the loop was told to expect)."""
        return False

    def stop(self) -> None:
        self.stopping.set()
        self.wired.set()
        if self.thread is not None:
            self.thread.join(5)

    def _run(self) -> None:
        while not self.stopping.is_set():
            if not self.wired.wait(0.1):
                continue
            try:
                self.node.step()
            except Exception as exc:
                if self.stopping.is_set():
                    return
                self.node.step_failed(exc)
                self.broken(str(exc), exc)
