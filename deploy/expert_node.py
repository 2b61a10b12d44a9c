"""The ExpertNode actor: owns a set of experts and serves every (layer, micro-batch) of
every step, in the fixed order all nodes follow, from a loop thread of its own."""

from __future__ import annotations

import logging
import threading

from deploy.link import SwitchableLink
from deploy.node_config import PEER_TIMEOUT_S, attention_rank_names, bind_host, node_names, slot_sizes, weights_of
from megainfer.disagg.expert_worker import ExpertWorker
from megainfer.plan import Plan

logger = logging.getLogger(__name__)


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
        self.wired = threading.Event()
        self.stopping = threading.Event()
        self.state = "wiring"
        self.error: str | None = None
        self.thread: threading.Thread | None = None

    def ready(self) -> str:
        return self.name

    def open_endpoint(self) -> str:
        return self.link.open()

    def connect(self, peers: dict[str, str]) -> None:
        self.link.connect(peers)

    def serve(self) -> None:
        self.state, self.error = "serving", None
        self.wired.set()
        if self.thread is None:
            self.thread = threading.Thread(target=self._loop, name=f"{self.name}-steps", daemon=True)
            self.thread.start()

    def interrupt(self) -> None:
        self.wired.clear()
        self.link.interrupt.set()

    def health(self) -> dict:
        return {"name": self.name, "state": self.state, "error": self.error, "experts": self.expert_ids,
                "steps": self.worker.steps, "tokens": self.worker.tokens, "timing": dict(self.worker.timing)}

    def stop(self) -> None:
        self.stopping.set()
        self.wired.set()
        if self.thread is not None:
            self.thread.join(5)
        self.link.close()

    def _loop(self) -> None:
        while not self.stopping.is_set():
            if not self.wired.wait(0.1):
                continue
            try:
                self.worker.run_step()
            except Exception as exc:  # a peer died, or the driver is re-wiring
                if self.state == "serving" and not self.link.interrupt.is_set():
                    logger.warning("%s: data plane failed (%s); waiting to be re-wired", self.name, exc)
                self.state, self.error = "broken", str(exc)
                self.wired.clear()
