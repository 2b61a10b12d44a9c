"""The AttentionNode actor: its requests, its KV cache, its scheduler, and a step loop that
runs the attention halves and ping-pongs micro-batches with the expert nodes.

The step loop runs in a thread of its own; the driver's calls (add_request, abort, poll)
share the engine with it under one lock, so a bad request raises to its caller at once.
Token deltas wait in an outbox the driver polls: tokens ride Ray, activations never do.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time

from deploy.link import SwitchableLink
from deploy.node_config import (PEER_TIMEOUT_S, bind_host, engine_config, join_tp_group, node_names, slot_sizes,
                                tp_master_address, weights_of)
from megainfer.disagg.pipelined_runner import PipelinedModelRunner
from megainfer.engine import Engine
from megainfer.plan import Plan
from megainfer.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
IDLE_S = 0.002  # pause between steps while the whole deployment is idle


class AttentionNode:
    """Rank 0 of an attention node (the only rank when attention.tp is 1): it schedules,
    samples and streams; with tp > 1 its followers (AttentionShard) hold the other heads."""

    def __init__(self, plan: dict, index: int, secret: bytes, host: str, num_threads: int | None = None) -> None:
        self.plan = Plan.from_dict(plan)
        self.index = index
        self.name = node_names(self.plan)[0][index]
        self._build_args = (secret, host, num_threads)
        self.engine: Engine | None = None
        if self.plan.attention.tp == 1:
            self._build()
        self.lock = threading.Lock()
        self.outbox_ready = threading.Condition()
        self.outbox: list[dict] = []
        self.wired = threading.Event()
        self.stopping = threading.Event()
        self.state = "wiring"
        self.error: str | None = None
        self.thread: threading.Thread | None = None
        self.step_seconds = 0.0  # wall time inside busy steps (schedule, run, sample, detokenize)

    def _build(self) -> None:
        secret, host, num_threads = self._build_args
        experts = node_names(self.plan)[1]
        model, _ = weights_of(self.plan)
        receive_slot, _ = slot_sizes(self.plan, model)
        self.link = SwitchableLink(self.name, self.index * self.plan.attention.tp, secret, bind_host(host),
                                   receive_slot, self.plan.pipeline.micro_batches, self.plan.transport.backend,
                                   PEER_TIMEOUT_S)
        assignment = self.plan.expert_assignment(model)

        def runner(mc, cfg, w, max_len):
            return PipelinedModelRunner(mc, cfg, w, max_len, link=self.link, expert_nodes=experts,
                                        expert_assignment=assignment, micro_batches=self.plan.pipeline.micro_batches,
                                        tp_size=self.plan.attention.tp)

        self.engine = Engine(self.plan.model, engine_config(self.plan, num_threads), runner_factory=runner)

    # -- wiring (called by the driver) -------------------------------------------------------
    def ready(self) -> str:
        return self.name

    def tp_master(self) -> str:
        return tp_master_address(bind_host(self._build_args[1]))

    def join_group(self, master: str) -> None:
        """Form the node's tensor-parallel group with its followers, then load this rank."""
        join_tp_group(master, 0, self.plan.attention.tp, on_gpu=self.plan.attention.gpu != "cpu")
        self._build()

    def open_endpoint(self) -> str:
        return self.link.open()

    def connect(self, peers: dict[str, str]) -> None:
        self.link.connect(peers)

    def serve(self) -> None:
        self.engine.runner.reset()
        self.state, self.error = "serving", None
        self.wired.set()
        if self.thread is None:
            self.thread = threading.Thread(target=self._loop, name=f"{self.name}-steps", daemon=True)
            self.thread.start()

    def interrupt(self) -> None:
        """Stop stepping: the driver is about to re-wire the data plane."""
        self.wired.clear()
        self.link.interrupt.set()

    def health(self) -> dict:
        if self.engine is None:
            return {"name": self.name, "state": "wiring", "error": None}
        return {"name": self.name, "state": self.state, "error": self.error,
                "running": self.engine.scheduler.num_running, "waiting": self.engine.scheduler.num_waiting,
                "timing": {**self.engine.runner.timing, "step": self.step_seconds}}

    # -- requests ------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt, params: dict) -> int:
        """Queue a request; raises RequestError for a bad one. Returns its prompt length."""
        with self.lock:
            if self.state != "serving":
                from megainfer.errors import DataPlaneError
                raise DataPlaneError(f"{self.name} is {self.state}: the deployment is re-wiring, retry shortly")
            return self.engine.add_request(request_id, prompt, SamplingParams(**params)).num_prompt_tokens

    def abort(self, request_id: str) -> bool:
        with self.lock:
            return self.engine.abort(request_id)

    def poll(self, timeout: float = 0.05) -> list[dict]:
        """Token deltas since the last poll (waits up to `timeout` for the first)."""
        with self.outbox_ready:
            if not self.outbox:
                self.outbox_ready.wait(timeout)
            out, self.outbox = self.outbox, []
        return out

    def stats(self) -> dict:
        with self.lock:
            return dataclasses.asdict(self.engine.stats())

    def stop(self) -> None:
        self.stopping.set()
        self.wired.set()
        if self.thread is not None:
            self.thread.join(5)
        self.link.close()

    # -- the step loop -------------------------------------------------------------------------
    def _emit(self, deltas) -> None:
        if deltas:
            with self.outbox_ready:
                self.outbox.extend(dataclasses.asdict(d) for d in deltas)
                self.outbox_ready.notify_all()

    def _loop(self) -> None:
        runner = self.engine.runner
        while not self.stopping.is_set():
            if not self.wired.wait(0.1):
                continue
            try:
                with self.lock:
                    t0 = time.perf_counter()
                    deltas = self.engine.step()
                    if deltas:
                        self.step_seconds += time.perf_counter() - t0
                    failed = [d for d in deltas if d.error_code == "unavailable"]
                    if failed:  # the data plane broke mid-step: nothing else can be served now
                        deltas += self.engine.fail_all(f"{self.name}: {failed[0].error}")
                        self._broken(failed[0].error)
                    idle = not self.engine.has_unfinished_requests()
                self._emit(deltas)
            except Exception as exc:  # an empty step's exchange failed
                with self.lock:
                    self._emit(self.engine.fail_all(f"{self.name}: {exc}"))
                    self._broken(str(exc))
                continue
            if idle and not runner.deployment_busy:
                time.sleep(IDLE_S)

    def _broken(self, error: str) -> None:
        if self.state == "serving":
            logger.warning("%s: data plane failed (%s); waiting to be re-wired", self.name, error)
        self.state, self.error = "broken", error
        self.wired.clear()
