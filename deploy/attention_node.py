"""The AttentionNode actor: its requests, its KV cache, its scheduler, and a step loop that
runs the attention halves and ping-pongs micro-batches with the expert nodes.

The step loop runs in a thread of its own; the driver's calls (add_request, abort, poll)
share the engine with it under one lock, so a bad request raises to its caller at once.
Token deltas wait in an outbox the driver polls: tokens ride Ray, activations never do.
"""

from __future__ import annotations

import dataclasses
import threading
import time

from deploy.link import SwitchableLink
from deploy.node_loop import NodeLoop
from deploy.node_config import (PEER_TIMEOUT_S, bind_host, engine_config, join_tp_group, node_names, slot_sizes,
                                tp_master_address, weights_of)
from megainfer.disagg.pipelined_runner import PipelinedModelRunner
from megainfer.engine import Engine
from megainfer.errors import DataPlaneError
from megainfer.plan import Plan
from megainfer.sampling_params import SamplingParams
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
        self.loop = NodeLoop(self.name, lambda: self.link, self._step, self._fail_queue)
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
        self.loop.serve()

    def interrupt(self) -> None:
        self.loop.interrupt()

    def health(self) -> dict:
        if self.engine is None:
            return {"name": self.name, "state": "wiring", "error": None}
        return {"name": self.name, "state": self.loop.state, "error": self.loop.error,
                "running": self.engine.scheduler.num_running, "waiting": self.engine.scheduler.num_waiting,
                "timing": {**self.engine.runner.timing, "step": self.step_seconds}}

    def state(self):
        """The scheduler's state for the router (a NodeState), with the steps measured and the
        requests finished since the last call; None while the node is still wiring."""
        with self.lock:
            return self.engine.node_state() if self.engine is not None else None

    # -- requests ------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt, params: dict) -> int:
        """Queue a request; raises RequestError for a bad one. Returns its prompt length."""
        with self.lock:
            if self.loop.state != "serving":
                raise DataPlaneError(f"{self.name} is {self.loop.state}: the deployment is re-wiring, retry shortly")
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
            stats = dataclasses.asdict(self.engine.stats())
            stats["m2n"] = {k: h.snapshot() for k, h in self.engine.runner.m2n.items()}
            return stats

    def stop(self) -> None:
        self.loop.stop()

    # -- the step loop -------------------------------------------------------------------------
    def _emit(self, deltas) -> None:
        if deltas:
            with self.outbox_ready:
                self.outbox.extend(dataclasses.asdict(d) for d in deltas)
                self.outbox_ready.notify_all()

    def _step(self) -> None:
        with self.lock:
            t0 = time.perf_counter()
            deltas = self.engine.step()
            if deltas:
                self.step_seconds += time.perf_counter() - t0
            idle = not self.engine.has_unfinished_requests()
        self._emit(deltas)
        failed = [d for d in deltas if d.error_code == "unavailable"]
        if failed:  # the data plane broke mid-step: nothing else can be served now
            raise DataPlaneError(failed[0].error)
        if idle and not self.engine.runner.deployment_busy:
            time.sleep(IDLE_S)

    def _fail_queue(self, exc: Exception) -> None:
        with self.lock:
            self._emit(self.engine.fail_all(f"{self.name}: {exc}"))
