"""The AttentionShard actor: a follower rank of a tensor-parallel attention node. It holds
its share of the heads and of the KV cache, runs every step its leader broadcasts, and
sends and receives its share of the routed tokens; it has no scheduler and samples nothing."""

from __future__ import annotations

from deploy.node_process import settle
from deploy.link import SwitchableLink
from deploy.node_actor import NodeActor
from deploy.node_loop import NodeLoop
from deploy.node_link import data_link
from deploy.node_names import node_names
from deploy.node_weights import weights_of
from deploy.tp_group import join_tp_group
from deploy.runtime_config import AttentionRuntime
from megainfer.disagg.pipelined_runner import PipelinedModelRunner
from megainfer.expert_replicas import ExpertReplicas
from megainfer.messages import NodeRole
from megainfer.plan import Plan


class AttentionShard(NodeActor):
    role = NodeRole.ATTENTION

    def __init__(self, plan: Plan, runtime: AttentionRuntime, rank: int, secret: bytes, host: str) -> None:
        self.plan, self.runtime = plan, runtime
        self.index, self.rank = runtime.index, rank
        self.name = runtime.ranks[rank]
        settle(runtime, rank, self.name)
        self._build_args = (secret, host)
        self.runner: PipelinedModelRunner | None = None
        self.link: SwitchableLink | None = None
        self.loop = NodeLoop(self.name, self)

    def _timeline(self):
        return self.runner.timeline if self.runner is not None else None

    def kernel_report(self):
        return self.runner.kernels if self.runner is not None else None

    def join_group(self, master: str) -> None:
        config = self.runtime.engine
        group = join_tp_group(master, self.rank, self.plan.attention.tp, config.device)
        secret, host = self._build_args
        model, weights = weights_of(self.plan)
        self.link = data_link(self.plan, self.runtime, self.name, self.index * self.plan.attention.tp + self.rank,
                              secret, host)
        self.runner = PipelinedModelRunner(
            model, config, weights, config.resolved_max_model_len(model), link=self.link,
            expert_nodes=node_names(self.plan)[1], replicas=self.plan.expert_replicas(model),
            movable_experts=self.plan.places_experts, micro_batches=self.plan.pipeline.micro_batches, staging_bytes=self.runtime.staging_bytes, tp_group=group,
            name=self.name)

    def step(self) -> None:
        self.link.count_usage()  # between steps, on the loop thread (deploy/link.py)
        self.runner.execute_follower()

    def switch_experts(self, step: int, replicas: ExpertReplicas) -> None:
        self.runner.slot_maps.switch_at(step, replicas)

    def cancel_experts(self, version: int) -> None:
        self.runner.slot_maps.cancel(version)

    def restore_experts(self, replicas: ExpertReplicas) -> None:
        self.runner.slot_maps.restore(replicas, self.runner.model.attention_layers)

    def open_endpoint(self) -> str:
        return self.link.open()

    def connect(self, peers: dict[str, str]) -> None:
        self.link.connect(peers)

    def serve(self) -> None:
        self.runner.reset()
        super().serve()
