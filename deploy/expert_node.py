"""The ExpertNode actor: owns a set of experts and serves every (layer, micro-batch) of
every step, in the fixed order all nodes follow, from a loop thread of its own."""

from __future__ import annotations

from deploy.link import SwitchableLink
from deploy.node_loop import NodeLoop
from deploy.node_config import PEER_TIMEOUT_S, attention_rank_names, bind_host, node_names, slot_sizes, weights_of
from megainfer.disagg.expert_worker import ExpertWorker
from megainfer.plan import Plan


class ExpertNode:
    def __init__(self, plan: dict, index: int, secret: bytes, host: str, num_threads: int | None = None) -> None:
        import torch

        if num_threads:
            torch.set_num_threads(num_threads)
        self.plan = Plan.from_dict(plan)
        _, experts = node_names(self.plan)
        attention = attention_rank_names(self.plan)
        self.name = experts[index]
        model, weights = weights_of(self.plan)
        _, receive_slot = slot_sizes(self.plan, model)
        self.expert_ids = self.plan.expert_assignment(model)[index]
        self.link = SwitchableLink(self.name, 1000 + index, secret, bind_host(host), receive_slot,
                                   self.plan.pipeline.micro_batches, self.plan.transport.backend, PEER_TIMEOUT_S)
        device = "cpu" if self.plan.experts.gpu == "cpu" else "cuda"
        self.worker = ExpertWorker(model, self.expert_ids, self.plan.dtype, device, weights,
                                   attention_nodes=attention, micro_batches=self.plan.pipeline.micro_batches,
                                   link=self.link)
        self.loop = NodeLoop(self.name, lambda: self.link, self.worker.run_step)

    def ready(self) -> str:
        return self.name

    def open_endpoint(self) -> str:
        return self.link.open()

    def connect(self, peers: dict[str, str]) -> None:
        self.link.connect(peers)

    def serve(self) -> None:
        self.loop.serve()

    def interrupt(self) -> None:
        self.loop.interrupt()

    def health(self) -> dict:
        return {"name": self.name, "state": self.loop.state, "error": self.loop.error, "experts": self.expert_ids,
                "steps": self.worker.steps, "tokens": self.worker.tokens, "timing": dict(self.worker.timing)}

    def stop(self) -> None:
        self.loop.stop()
