"""The AttentionShard actor: a follower rank of a tensor-parallel attention node. It holds
its share of the heads and of the KV cache, runs every step its leader broadcasts, and
sends and receives its share of the routed tokens; it has no scheduler and samples nothing."""

from __future__ import annotations

import logging
import threading

from deploy.link import SwitchableLink
from deploy.node_config import (PEER_TIMEOUT_S, attention_rank_name, bind_host, engine_config, join_tp_group,
                                node_names, slot_sizes, weights_of)
from megainfer.disagg.pipelined_runner import PipelinedModelRunner
from megainfer.plan import Plan

logger = logging.getLogger(__name__)


class AttentionShard:
    def __init__(self, plan: dict, index: int, rank: int, secret: bytes, host: str,
                 num_threads: int | None = None) -> None:
        self.plan = Plan.from_dict(plan)
        self.index, self.rank = index, rank
        self.name = attention_rank_name(index, rank)
        self._build_args = (secret, host, num_threads)
        self.runner: PipelinedModelRunner | None = None
        self.wired = threading.Event()
        self.stopping = threading.Event()
        self.state = "wiring"
        self.error: str | None = None
        self.thread: threading.Thread | None = None

    def ready(self) -> str:
        return self.name

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
        self.state, self.error = "serving", None
        self.wired.set()
        if self.thread is None:
            self.thread = threading.Thread(target=self._loop, name=f"{self.name}-steps", daemon=True)
            self.thread.start()

    def interrupt(self) -> None:
        self.wired.clear()
        self.link.interrupt.set()

    def health(self) -> dict:
        return {"name": self.name, "state": self.state, "error": self.error}

    def stop(self) -> None:
        self.stopping.set()
        self.wired.set()
        self.link.close()

    def _loop(self) -> None:
        while not self.stopping.is_set():
            if not self.wired.wait(0.1):
                continue
            try:
                self.runner.execute_follower()
            except Exception as exc:
                if not self.stopping.is_set():
                    logger.warning("%s: step failed (%s)", self.name, exc)
                self.state, self.error = "broken", str(exc)
                self.wired.clear()
