"""The AttentionNode actor: its requests, its KV cache, its scheduler, and a step loop that
runs the attention halves and ping-pongs micro-batches with the expert nodes.

The step loop runs in a thread of its own. Requests and aborts enter through the engine
core's input queue, drained between steps: a bad request raises to its caller at once, a good
one is queued without waiting for the running step. The router's snapshots and the stats read
the engine between steps (under the step's lock). Token deltas wait in an outbox the driver
polls: tokens ride Ray, activations never do.
"""

from __future__ import annotations

from deploy.delta_outbox import DeltaOutbox
from deploy.node_actor import NodeActor, rank_resources
from deploy.node_loop import NodeLoop
from deploy.node_process import settle
from deploy.node_link import bind_host, data_link
from deploy.node_names import node_names
from deploy.node_weights import weights_of
from deploy.tp_group import join_tp_group, tp_master_address
from deploy.runtime_config import AttentionRuntime
from megainfer.disagg.pipelined_runner import PipelinedModelRunner
from megainfer.engine.engine import Engine
from megainfer.engine.engine_steps import EngineSteps
from megainfer.engine.queued_engine import QueuedEngine
from megainfer.errors import DataPlaneError
from megainfer.expert_replicas import ExpertReplicas
from megainfer.messages import DeltaBatch, ExpertLoadReport, NodeHealth, NodeResources, NodeRole, NodeState, NodeStats, NodeStatus
from megainfer.plan import Plan
from megainfer.sampling_params import SamplingParams
from megainfer.tensor_parallel import TensorParallelGroup

IDLE_S = 0.002  # pause between steps while the whole deployment is idle


class AttentionNode(NodeActor):
    """Rank 0 of an attention node (the only rank when attention.tp is 1): it schedules,
    samples and streams; with tp > 1 its followers (AttentionShard) hold the other heads. Its
    step is the engine's (`EngineSteps`, as the colocated engine's)."""

    role = NodeRole.ATTENTION

    def __init__(self, plan: Plan, runtime: AttentionRuntime, secret: bytes, host: str) -> None:
        self.plan, self.runtime = plan, runtime
        self.index, self.name = runtime.index, runtime.name
        settle(runtime, 0, self.name)
        self._build_args = (secret, host)
        self.engine: Engine | None = None
        self.queued: QueuedEngine | None = None
        self.steps: EngineSteps | None = None
        self.outbox = DeltaOutbox()
        if self.plan.attention.tp == 1:
            self._build(None)
        self.loop = NodeLoop(self.name, self)

    def _timeline(self):
        return self.engine.runner.timeline if self.engine is not None else None

    def _build(self, tp_group: TensorParallelGroup | None) -> None:
        secret, host = self._build_args
        experts = node_names(self.plan)[1]
        model, _ = weights_of(self.plan)
        runtime = self.runtime
        self.link = data_link(self.plan, runtime, self.name, self.index * self.plan.attention.tp, secret, host)
        replicas = self.plan.expert_replicas(model)

        def runner(mc, cfg, w, max_len):
            return PipelinedModelRunner(mc, cfg, w, max_len, link=self.link, expert_nodes=experts, replicas=replicas,
                                        movable_experts=self.plan.places_experts,
                                        micro_batches=self.plan.pipeline.micro_batches,
                                        staging_bytes=runtime.staging_bytes,
                                        tp_group=tp_group, name=self.name,
                                        device_slot_bytes=(runtime.receive_slot_bytes
                                                           if self.plan.pipeline.device_slots else 0))

        self.engine = Engine(self.plan.model, runtime.engine, runner_factory=runner)
        self.steps = EngineSteps(self.engine, self.outbox.put, IDLE_S)
        self.queued = self.steps.queued

    def kernel_report(self):
        return self.engine.runner.kernels if self.engine is not None else None  # built once it joined its group

    # -- wiring (called by the driver) -------------------------------------------------------

    def tp_master(self) -> str:
        return tp_master_address(bind_host(self._build_args[1]))

    def join_group(self, master: str) -> None:
        """Form the node's tensor-parallel group with its followers, then load this rank."""
        self._build(join_tp_group(master, 0, self.plan.attention.tp, self.runtime.engine.device))

    def open_endpoint(self) -> str:
        return self.link.open()

    def connect(self, peers: dict[str, str]) -> None:
        self.link.connect(peers)

    def serve(self) -> None:
        self.engine.runner.reset()
        super().serve()

    def health(self) -> NodeHealth:
        if self.engine is None:
            return NodeHealth(self.name, NodeRole.ATTENTION, NodeStatus.WIRING)
        scheduler, slots = self.engine.scheduler, self.engine.runner.slots
        return NodeHealth(self.name, NodeRole.ATTENTION, self.loop.state, error=self.loop.error,
                          running=scheduler.num_running, waiting=scheduler.num_waiting + self.queued.num_queued,
                          timing={**self.engine.runner.timing, "step": self.steps.busy_seconds},
                          device_slot_peers=slots.direct_peers() if slots is not None else [])

    def state(self) -> NodeState | None:
        """The scheduler's state for the router (a NodeState), with the steps measured and the
        requests finished since the last call; None while the node is still wiring. Requests
        queued since the last step join the scheduler first: the frontend has told the router
        they reached this node, so a snapshot from now on must hold them."""
        if self.engine is None:
            return None
        with self.steps.between_steps() as engine:
            return engine.node_state()

    def reset_prefix_cache(self) -> bool:
        with self.steps.between_steps() as engine:
            return engine.reset_prefix_cache()

    # -- expert placement (deploy/expert_rebalance.py) ----------------------------------------
    def expert_load(self) -> ExpertLoadReport:
        """Tokens routed to each (layer, expert) over the engine's last window of steps."""
        with self.steps.between_steps() as engine:
            return engine.step_records.expert_window.report()

    def step_id(self) -> int:
        return self.engine.runner.step_id

    def switch_experts(self, step: int, replicas: ExpertReplicas) -> None:
        self.engine.runner.slot_maps.switch_at(step, replicas)

    def cancel_experts(self, version: int) -> None:
        self.engine.runner.slot_maps.cancel(version)

    def restore_experts(self, replicas: ExpertReplicas) -> None:
        runner = self.engine.runner
        runner.slot_maps.restore(replicas, runner.model.attention_layers)

    # -- requests ------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt, params: SamplingParams) -> int:
        """Queue a request for the next step; raises RequestError for a bad one. Returns its
        prompt length."""
        if not self.loop.serving:
            raise DataPlaneError(f"{self.name} is {self.loop.state}: the deployment is re-wiring, retry shortly")
        return self.queued.add_request(request_id, prompt, params).num_prompt_tokens

    def abort(self, request_id: str) -> bool:
        return self.queued.abort(request_id)

    def poll(self, incarnation: str | None = None, after: int = 0, timeout: float = 0.05) -> DeltaBatch:
        """Token deltas after the poller's cursor `after` (acknowledging those up to it; see
        delta_outbox.py); waits up to `timeout` for the first."""
        return self.outbox.poll(incarnation, after, timeout)

    def resources(self) -> NodeResources:
        """Memory, KV blocks, M2N slots and requests held (between steps: a step holds the lock;
        the slots as the loop thread counted them at a step's start, see deploy/link.py)."""
        if self.engine is None:
            return super().resources()
        with self.steps.lock:
            blocks = self.engine.scheduler.block_manager
            return rank_resources(self.name, NodeRole.ATTENTION, 0, self.link, kv_blocks_total=blocks.num_blocks,
                                  kv_blocks_free=blocks.num_free_blocks, requests=self.queued.num_requests)

    def stats(self) -> NodeStats:
        with self.steps.between_steps() as engine:  # queued requests count as waiting
            m2n = engine.runner.m2n
            return NodeStats(engine.stats(), m2n["send"].snapshot(), m2n["receive_wait"].snapshot())

    # -- its NodeLoop -------------------------------------------------------------------------
    def step(self) -> None:
        self.link.count_usage()  # between steps, on the loop thread (deploy/link.py)
        runner = self.engine.runner
        step = runner.step_id
        started = self.steps.step()
        if started is not None:
            runner.record_step(step, started)  # the whole step: scheduling and detokenizing too

    def step_failed(self, exc: Exception) -> None:
        self.steps.fail_all(f"{self.name}: {exc}")
