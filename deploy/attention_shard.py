"""The AttentionShard actor: a follower rank of a tensor-parallel attention node. It holds
its share of the heads and of the KV cache, runs every step its leader broadcasts, and
sends and receives its share of the routed tokens; it has no scheduler and samples nothing."""

from __future__ import annotations

from deploy.link import SwitchableLink
from deploy.node_loop import LoopActor, NodeLoop
from deploy.node_config import (PEER_TIMEOUT_S, attention_rank_name, bind_host, engine_config, join_tp_group,
                                node_names, slot_sizes, weights_of)
from megainfer.disagg.pipelined_runner import PipelinedModelRunner
from megainfer.messages import NodeRole
from megainfer.plan import Plan


class AttentionShard(LoopActor):
    role = NodeRole.ATTENTION

    def __init__(self, plan: Plan, index: int, rank: int, secret: bytes, host: str,
                 num_threads: int | None = None) -> None:
        self.plan = plan
        self.index, self.rank = index, rank
        self.name = attention_rank_name(index, rank)
        self._build_args = (secret, host, num_threads)
        self.runner: PipelinedModelRunner | None = None
        self.link: SwitchableLink | None = None
        self.loop = NodeLoop(self.name, lambda: self.link, lambda: self.runner.execute_follower())

    def join_group(self, master: str) -> None:
        join_tp_group(master, self.rank, self.plan.attention.tp, on_gpu=self.plan.attention.gpu != "cpu")
        secret, host, num_threads = self._build_args
        model, weights = weights_of(self.plan)
        receive_slot, _ = slot_sizes(self.plan, model)
        self.link = SwitchableLink(self.name, self.index * self.plan.attention.tp + self.rank, secret,
                                   bind_host(host), receive_slot, self.plan.pipeline.micro_batches, self.plan.transport.backend,
                                   PEER_TIMEOUT_S)
        config = engine_config(self.plan, num_threads)
        self.runner = PipelinedModelRunner(
            model, config, weights, config.resolved_max_model_len(model), link=self.link,
            expert_nodes=node_names(self.plan)[1], expert_assignment=self.plan.expert_assignment(model),
            micro_batches=self.plan.pipeline.micro_batches, tp_rank=self.rank, tp_size=self.plan.attention.tp)

    def open_endpoint(self) -> str:
        return self.link.open()

    def connect(self, peers: dict[str, str]) -> None:
        self.link.connect(peers)

    def serve(self) -> None:
        self.runner.reset()
        self.loop.serve()
