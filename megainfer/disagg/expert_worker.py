"""An expert node's work: for each (layer, micro-batch), in the fixed order every node
follows, take the tokens of every attention node, run this node's experts on their union,
and answer each attention node with its slice."""

from __future__ import annotations

import time

import torch
from tqdm.auto import tqdm

from megainfer.config import ModelConfig
from megainfer.disagg.expert_link import BUSY, ExpertLink, unpack_dispatch
from megainfer.model.expert_layer import ExpertLayer
from megainfer.model.weights import WeightSource
from megainfer.tensor_parallel import TensorParallelGroup


class ExpertWorker:
    def __init__(self, model_config: ModelConfig, expert_ids: list[int], dtype: str, device: str,
                 weights: WeightSource, *, attention_nodes: list[str], micro_batches: int, link: ExpertLink | None,
                 show_progress: bool = False, tp_group: TensorParallelGroup | None = None) -> None:
        """With a `tp_group` this is one rank of a tensor-parallel expert node: rank 0 exchanges
        every message with the attention nodes and broadcasts each (layer, micro-batch)'s tokens
        to the others (a header over the control group, the tensors over the activations'
        group); every rank runs its slice of each expert and the partial outputs are summed on
        rank 0."""
        self.cfg = model_config
        self.tp_group = tp_group
        tp_rank, tp_size = (0, 1) if tp_group is None else (tp_group.rank, tp_group.size)
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.expert_ids = list(expert_ids)
        self.dtype = getattr(torch, dtype)
        self.device = torch.device(device)
        self.attention_nodes = list(attention_nodes)
        self.m = micro_batches
        self.link = link
        self.layers = [ExpertLayer(model_config, layer, self.dtype, self.device, expert_ids, tp_rank, tp_size)
                       for layer in range(model_config.num_layers)]
        with torch.inference_mode():
            for layer in tqdm(self.layers, desc=f"loading experts {expert_ids[0]}..{expert_ids[-1]}", unit="layer",
                              disable=not show_progress):
                layer.load_weights(weights)
        self.steps = 0
        self.tokens = 0  # tokens processed (per layer, summed), for stats
        self.timing = {"experts": 0.0, "wait_attention": 0.0}  # seconds, summed over steps

    @torch.inference_mode()
    def run_step(self) -> int:
        """One engine step of every attention node: all layers, all micro-batches. Returns the
        tokens this node processed in it."""
        cfg = self.cfg
        step_tokens = 0
        for layer in range(cfg.num_layers):
            for j in range(self.m):
                t0 = time.perf_counter()
                msgs = [self.link.recv(a, micro_batch=j) for a in self.attention_nodes]
                t1 = time.perf_counter()
                self.timing["wait_attention"] += t1 - t0
                step = msgs[0].header.step
                for a, msg in zip(self.attention_nodes, msgs):
                    if msg.header.layer != layer or msg.header.step != step:
                        raise RuntimeError(f"attention node {a} sent (step {msg.header.step}, layer "
                                           f"{msg.header.layer}) where (step {step}, layer {layer}) was due")
                counts = [msg.header.token_count for msg in msgs]
                total = sum(counts)
                x = ids = weights = None
                if total:
                    parts = [unpack_dispatch(msg.tensor(torch.uint8), n, cfg.hidden_size, cfg.top_k, self.dtype)
                             for msg, n in zip(msgs, counts) if n]
                    x = torch.cat([p[0] for p in parts]).to(self.device)
                    ids = torch.cat([p[1] for p in parts]).to(self.device, torch.int64)
                    weights = torch.cat([p[2] for p in parts]).to(self.device)
                if self.tp_size > 1:
                    self._share(layer, j, total, x, ids, weights)
                for msg in msgs:  # everything needed is copied out: the senders may reuse their slots
                    msg.release()
                y = self._experts(layer, x, ids, weights) if total else None
                self.timing["experts"] += time.perf_counter() - t1
                flags = BUSY if total else 0
                offset = 0
                for a, n in zip(self.attention_nodes, counts):
                    payload = y[offset:offset + n] if n else torch.empty(0, dtype=torch.uint8)
                    self.link.send(a, payload, step=step, layer=layer, micro_batch=j, token_count=n, flags=flags)
                    offset += n
                step_tokens += total
        self.steps += 1
        self.tokens += step_tokens
        return step_tokens

    def _experts(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        y = self.layers[layer](x, ids, weights)
        if self.tp_size > 1:  # each rank holds a slice of every expert: their outputs add up
            self.tp_group.reduce(y, dst=0)
        return y.cpu()

    def _share(self, layer: int, j: int, total: int, x, ids, weights) -> None:
        """Leader: this (layer, micro-batch)'s tokens to the other ranks (a header, then the tensors)."""
        self.tp_group.broadcast_control(torch.tensor([layer, j, total], dtype=torch.int64))
        if total:
            for t in (x, ids, weights):
                self.tp_group.broadcast(t.to(self.device))

    @torch.inference_mode()
    def run_follower_step(self) -> None:
        """A follower rank's unit of work: one (layer, micro-batch) the leader shares. The header
        names the layer, so a leader that restarts its step after a re-wire needs no resync."""
        cfg = self.cfg
        header = torch.zeros(3, dtype=torch.int64)
        self.tp_group.broadcast_control(header)
        layer, _, total = header.tolist()
        if not 0 <= layer < cfg.num_layers:
            raise RuntimeError(f"expert rank {self.tp_rank}: the leader shared layer {layer}")
        if total:
            x = torch.empty(total, cfg.hidden_size, dtype=self.dtype, device=self.device)
            ids = torch.empty(total, cfg.top_k, dtype=torch.int64, device=self.device)
            weights = torch.empty(total, cfg.top_k, dtype=torch.float32, device=self.device)
            for t in (x, ids, weights):
                self.tp_group.broadcast(t)
            self._experts(layer, x, ids, weights)
            self.tokens += total
