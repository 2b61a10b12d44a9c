"""The ExpertShard actor: a follower rank of a tensor-parallel expert node. It holds a slice
of every one of the node's experts, takes each micro-batch's tokens from its leader over the
node's torch.distributed group and adds its partial outputs to the leader's; it has no
endpoint of its own (attention nodes talk to the leader only)."""

from __future__ import annotations

from deploy.node_process import settle
from deploy.expert_node import ExpertRank, build_expert_worker
from deploy.tp_group import join_tp_group
from deploy.runtime_config import ExpertRuntime
from deploy.node_loop import NodeLoop
from megainfer.disagg.expert_worker import ExpertWorker
from megainfer.plan import Plan


class ExpertShard(ExpertRank):
    def __init__(self, plan: Plan, runtime: ExpertRuntime, rank: int, secret: bytes, host: str) -> None:
        import torch

        if runtime.num_threads:
            torch.set_num_threads(runtime.num_threads)
        self.plan, self.runtime = plan, runtime
        self.index, self.rank = runtime.index, rank
        self.name = runtime.ranks[rank]
        settle(runtime, rank, self.name)
        self.worker: ExpertWorker | None = None
        self.loop = NodeLoop(self.name, self)  # no link: it talks only to its leader

    def step(self) -> None:
        self.worker.run_follower_step()

    def join_group(self, master: str) -> None:
        group = join_tp_group(master, self.rank, self.plan.experts.tp, self.runtime.device)
        self.worker = build_expert_worker(self.plan, self.runtime, None, group)
