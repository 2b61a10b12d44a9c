"""The ExpertNode actor: owns a set of experts and serves every (layer, micro-batch) of
every step, in the fixed order all nodes follow, from a loop thread of its own. With
`experts.tp > 1` it is rank 0 of the node's tensor-parallel group: the only rank attention
nodes talk to, sharing each micro-batch's tokens with its ExpertShard followers."""

from __future__ import annotations

from deploy.link import SwitchableLink
from deploy.node_config import (PEER_TIMEOUT_S, attention_rank_names, bind_host, join_tp_group, node_names,
                                slot_sizes, tp_master_address, weights_of)
from deploy.node_loop import LoopActor, NodeLoop
from megainfer.disagg.expert_worker import ExpertWorker
from megainfer.messages import NodeHealth, NodeRole
from megainfer.plan import Plan


def build_expert_worker(plan: Plan, index: int, link: SwitchableLink | None, rank: int = 0) -> ExpertWorker:
    model, weights = weights_of(plan)
    device = "cpu" if plan.experts.gpu == "cpu" else "cuda"
    return ExpertWorker(model, plan.expert_assignment(model)[index], plan.dtype, device, weights,
                        attention_nodes=attention_rank_names(plan), micro_batches=plan.pipeline.micro_batches,
                        link=link, tp_rank=rank, tp_size=plan.experts.tp)


class ExpertNode(LoopActor):
    role = NodeRole.EXPERT

    def __init__(self, plan: Plan, index: int, secret: bytes, host: str, num_threads: int | None = None) -> None:
        import torch

        if num_threads:
            torch.set_num_threads(num_threads)
        self.plan = plan
        self.index = index
        self.name = node_names(self.plan)[1][index]
        self._host = host
        model, _ = weights_of(self.plan)
        _, receive_slot = slot_sizes(self.plan, model)
        self.expert_ids = self.plan.expert_assignment(model)[index]
        self.link = SwitchableLink(self.name, 1000 + index, secret, bind_host(host), receive_slot,
                                   self.plan.pipeline.micro_batches, self.plan.transport.backend, PEER_TIMEOUT_S)
        self.worker: ExpertWorker | None = None
        if self.plan.experts.tp == 1:
            self.worker = build_expert_worker(self.plan, index, self.link)
        self.loop = NodeLoop(self.name, lambda: self.link, lambda: self.worker.run_step())

    def tp_master(self) -> str:
        return tp_master_address(bind_host(self._host))

    def join_group(self, master: str) -> None:
        """Form the node's tensor-parallel group with its followers, then load this rank's slices."""
        join_tp_group(master, 0, self.plan.experts.tp, on_gpu=self.plan.experts.gpu != "cpu")
        self.worker = build_expert_worker(self.plan, self.index, self.link)

    def open_endpoint(self) -> str:
        return self.link.open()

    def connect(self, peers: dict[str, str]) -> None:
        self.link.connect(peers)

    def health(self) -> NodeHealth:
        health = super().health()
        health.experts = list(self.expert_ids)
        if self.worker is not None:
            health.steps, health.tokens, health.timing = self.worker.steps, self.worker.tokens, dict(self.worker.timing)
        return health
