"""The ExpertNode actor: owns a set of experts and serves every (layer, micro-batch) of
every step, in the fixed order all nodes follow, from a loop thread of its own. With
`experts.tp > 1` it is rank 0 of the node's tensor-parallel group: the only rank attention
nodes talk to, sharing each micro-batch's tokens with its ExpertShard followers."""

from __future__ import annotations

from deploy.node_process import settle
from deploy.link import SwitchableLink
from deploy.node_link import bind_host, data_link
from deploy.node_names import attention_rank_names
from deploy.node_weights import weights_of
from deploy.tp_group import join_tp_group, tp_master_address
from deploy.runtime_config import ExpertRuntime
from deploy.node_actor import NodeActor
from deploy.node_loop import NodeLoop
from megainfer.disagg.expert_worker import ExpertWorker
from megainfer.expert_replicas import ExpertReplicas
from megainfer.messages import NodeHealth, NodeRole, StagedPlacement
from megainfer.plan import Plan
from megainfer.tensor_parallel import TensorParallelGroup


def build_expert_worker(plan: Plan, runtime: ExpertRuntime, link: SwitchableLink | None,
                        tp_group: TensorParallelGroup | None = None) -> ExpertWorker:
    model, weights = weights_of(plan)
    return ExpertWorker(model, list(runtime.expert_ids), plan.dtype, runtime.device, weights,
                        replicas=plan.expert_replicas(model), node=runtime.index,
                        attention_nodes=attention_rank_names(plan), micro_batches=plan.pipeline.micro_batches,
                        link=link, tp_group=tp_group,
                        staging_bytes=runtime.staging_bytes if link is not None else 0,  # followers stage nothing
                        name=runtime.ranks[tp_group.rank if tp_group is not None else 0],
                        profile_tokens=runtime.profile_tokens, gpu_memory_utilization=runtime.gpu_memory_utilization,
                        device_slot_bytes=runtime.receive_slot_bytes if plan.pipeline.device_slots else 0,
                        decode_graph_tokens=runtime.decode_graph_tokens)


class ExpertRank(NodeActor):
    """What every rank of an expert node answers (ExpertNode, the leader; ExpertShard, a
    follower): its worker's kernels and timeline, and a re-placement's calls
    (deploy/expert_rebalance.py)."""

    role = NodeRole.EXPERT
    worker: ExpertWorker | None = None

    def _timeline(self):
        return self.worker.timeline if self.worker is not None else None

    def kernel_report(self):
        return self.worker.kernels if self.worker is not None else None

    def stage_experts(self, replicas: ExpertReplicas) -> StagedPlacement:
        """Load this rank's experts of `replicas` beside the serving ones (on an actor thread:
        the step loop keeps serving)."""
        w = self.worker
        return w.switch.stage(w.layers, replicas, w.node, w.weights)

    def switch_experts(self, step: int, version: int) -> None:
        self.worker.switch.switch_at(step, version)

    def cancel_experts(self, version: int) -> None:
        self.worker.switch.cancel(version)

    def restore_experts(self, replicas: ExpertReplicas) -> None:
        w = self.worker
        w.switch.restore(w.layers, replicas, w.node, w.weights)


class ExpertNode(ExpertRank):
    def __init__(self, plan: Plan, runtime: ExpertRuntime, secret: bytes, host: str) -> None:
        import torch

        if runtime.num_threads:
            torch.set_num_threads(runtime.num_threads)
        self.plan, self.runtime = plan, runtime
        self.index, self.name = runtime.index, runtime.name
        settle(runtime, 0, self.name)
        self._host = host
        self.expert_ids = list(runtime.expert_ids)
        # Its steps follow one another at once: it counts its slots in a quiet wait (deploy/link.py).
        self.link = data_link(self.plan, runtime, self.name, 1000 + self.index, secret, host, count_when_quiet=True)
        self.worker: ExpertWorker | None = None
        if self.plan.experts.tp == 1:
            self.worker = build_expert_worker(self.plan, runtime, self.link)
        self.loop = NodeLoop(self.name, self)

    def step(self) -> None:
        self.worker.run_step()

    def tp_master(self) -> str:
        return tp_master_address(bind_host(self._host))

    def join_group(self, master: str) -> None:
        """Form the node's tensor-parallel group with its followers, then load this rank's slices."""
        group = join_tp_group(master, 0, self.plan.experts.tp, self.runtime.device)
        self.worker = build_expert_worker(self.plan, self.runtime, self.link, group)

    def open_endpoint(self) -> str:
        return self.link.open()

    def connect(self, peers: dict[str, str]) -> None:
        self.link.connect(peers)
        if self.worker is not None:
            self.worker.rewired()  # device-slot offers are traded again with the new peers

    def health(self) -> NodeHealth:
        health = super().health()
        health.experts = list(self.worker.layers[0].expert_ids) if self.worker is not None else list(self.expert_ids)
        if self.worker is not None:
            health.steps, health.tokens, health.timing = self.worker.steps, self.worker.tokens, dict(self.worker.timing)
            health.pairs = self.worker.served.per_layer()
            health.placement_version = self.worker.switch.version
            health.device_slot_peers = self.worker.slots.direct_peers() if self.worker.slots is not None else []
        return health
