"""One colocated engine behind the servers (`megainfer serve`): the engine's steps
(`EngineSteps`) in a step loop thread (`StepLoop`), fed through its input queue (`QueuedEngine`)."""

from __future__ import annotations

import logging
import os

from megainfer.engine.engine import Engine
from megainfer.engine.engine_steps import EngineSteps
from megainfer.engine.step_loop import StepLoop
from megainfer.errors import ConfigError, DataPlaneError
from megainfer.expert_replicas import placed_load
from megainfer.messages import NodeResources, NodeRole, NodeStatus
from megainfer.sampling_params import SamplingParams
from megainfer.server.backend import BackendInfo, NodeInfo, RequestStream, StreamRegistry
from megainfer.server.metrics import MetricsSnapshot

logger = logging.getLogger(__name__)
IDLE_WAIT_S = 0.5  # an idle loop re-checks for a stop this often


class EngineBackend:
    """A `GenerationBackend` of one engine whose steps run in a `StepLoop` thread (the loop
    every node of a deployment runs too); a step that raises (a bug: the engine fails a broken
    step's requests itself and serves on) fails every open request and leaves the loop broken,
    which `info` reports."""

    def __init__(self, engine: Engine, max_open: int | None = None) -> None:
        self.engine = engine
        self.registry = StreamRegistry(max_open or 2 * engine.config.max_num_seqs)
        self.steps = EngineSteps(engine, self.registry.deliver_batch, IDLE_WAIT_S)
        self.queued = self.steps.queued
        self.loop = StepLoop("engine", self)
        self.loop.serve()

    def submit(self, request_id: str, prompt, params: SamplingParams) -> RequestStream:
        if not self.loop.serving:
            raise DataPlaneError("the engine's step loop stopped (see the server's log); restart the server")
        stream = self.registry.open(request_id)
        try:
            stream.prompt_tokens = self.queued.add_request(request_id, prompt, params).num_prompt_tokens
        except BaseException:
            self.registry.close(request_id)
            raise
        return stream

    def abort(self, request_id: str) -> bool:
        aborted = self.queued.abort(request_id)
        self.registry.close(request_id)
        return aborted

    def info(self) -> BackendInfo:
        s = self.engine.stats()  # counters read without the step's lock: ServerInfo never waits for a step
        if not self.loop.serving:  # the step loop failed (a bug): nothing will be served, say so to probes
            return BackendInfo(self.engine.model_config.name, "", [NodeInfo(
                "engine", NodeRole.ENGINE, NodeStatus.BROKEN, "the engine's step loop stopped; see the log")])
        return BackendInfo(self.engine.model_config.name, "", [NodeInfo(
            "engine", NodeRole.ENGINE, NodeStatus.SERVING,
            f"running {s.num_running}, waiting {s.num_waiting}, KV {s.kv_cache_usage:.0%}")])

    def metrics_snapshot(self) -> MetricsSnapshot:
        with self.steps.between_steps() as engine:  # queued requests count as waiting
            s = engine.stats()
        return MetricsSnapshot(running=s.num_running, waiting=s.num_waiting, kv_cache_usage=s.kv_cache_usage,
                               expert_bytes_read=s.expert_bytes_read, kv_blocks=s.num_kv_blocks,
                               num_preemptions=s.num_preemptions, kernels=[s.kernels] if s.kernels else [],
                               kernel_builds_while_serving=s.kernel_builds_while_serving,
                               prefix_cache_queries=s.prefix_cache_queries, prefix_cache_hits=s.prefix_cache_hits,
                               expert_layer_imbalance=placed_load(None, s.expert_window.of("all"))[1]
                               if s.expert_window is not None else [])

    def reset_prefix_cache(self) -> bool:
        with self.steps.between_steps() as engine:
            return engine.reset_prefix_cache()

    def expert_load(self):
        with self.steps.between_steps() as engine:
            return engine.stats().expert_window

    def rebalance_experts(self):
        raise ConfigError("a colocated engine holds every expert itself: there is nothing to re-place "
                          "(expert re-placement is for deployments with experts.redundant_per_node or rebalance)")

    def resources(self) -> list[NodeResources]:
        """The engine's KV blocks and requests held (read between steps); no M2N slots here."""
        with self.steps.lock:
            blocks = self.engine.scheduler.block_manager
            return [NodeResources("engine", NodeRole.ENGINE, 0, os.getpid(), kv_blocks_total=blocks.num_blocks,
                                  kv_blocks_free=blocks.num_free_blocks, requests=self.queued.num_requests)]

    def close(self) -> None:
        self.loop.stopping.set()
        self.queued.wake()
        self.loop.stop()

    # -- its StepLoop -------------------------------------------------------------------------
    def step(self) -> None:
        self.steps.step()

    def step_failed(self, exc: Exception) -> None:
        logger.error("the engine's step loop failed; the server reports the engine broken", exc_info=exc)
        self.registry.fail_all(f"the engine's step loop failed: {exc!r}")
