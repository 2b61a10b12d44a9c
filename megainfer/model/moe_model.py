"""The colocated model: embedding, then per layer AttentionLayer + ExpertLayer, final norm, LM head.

The disaggregated runtime composes the same two halves across nodes; this module is the
single-process composition the engine and the tests use.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

import kernels
from megainfer.config import ModelConfig
from megainfer.model.attention_layer import AttentionLayer
from megainfer.model.checkpoint_names import attention_tensors, expert_tensors, head_tensors, read
from megainfer.model.layer_norm import norm_of
from megainfer.model.expert_layer import ExpertLayer
from megainfer.model.rotary import RotaryEmbedding
from megainfer.model.weights import WeightSource


@dataclass
class ForwardOutput:
    hidden: torch.Tensor  # [T, H] final-normed hidden states
    expert_counts: torch.Tensor  # [L, E] int64 tokens routed to each expert of each layer


class MoEModel(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str, max_positions: int,
                 with_experts: bool = True, tp_rank: int = 0, tp_size: int = 1) -> None:
        """`with_experts=False` builds what an attention node holds: no expert weights; tp_size
        > 1 shards the attention heads over the node's ranks."""
        super().__init__()
        self.cfg = cfg
        kw = dict(dtype=dtype, device=device)
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size, **kw)
        self.attention_layers = nn.ModuleList(AttentionLayer(cfg, i, tp_rank=tp_rank, tp_size=tp_size, **kw)
                                              for i in range(cfg.num_layers))
        # By layer index, as a string (ModuleDict's keys): DeepSeek's dense first layers have none.
        self.expert_layers = nn.ModuleDict({str(i): ExpertLayer(cfg, i, **kw) for i in range(cfg.num_layers)
                                            if cfg.is_moe_layer(i)}) if with_experts else None
        self.norm = norm_of(cfg, cfg.hidden_size, **kw)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, **kw)
        self.rotary = RotaryEmbedding(cfg.rotary_dim, cfg.rope_theta, max_positions, scaling=cfg.rope_scaling, **kw)
        self.requires_grad_(False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], batch: kernels.PagedAttentionBatch) -> ForwardOutput:
        hidden = self.embed(input_ids)
        counts = []
        for layer, kv_cache in enumerate(kv_caches):
            hidden, c = self.layer(layer, hidden, positions, kv_cache, batch)
            counts.append(c)
        return ForwardOutput(self.norm(hidden), torch.stack(counts))

    def layer(self, layer: int, hidden: torch.Tensor, positions: torch.Tensor,
              kv_cache: tuple[torch.Tensor, torch.Tensor], batch: kernels.PagedAttentionBatch
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """One decoder layer, both halves: (hidden out, tokens routed to each expert)."""
        a = self.attention_layers[layer](hidden, positions, self.rotary, kv_cache, batch)
        if a.gating is None:  # a dense layer: its FFN ran on the attention side
            return a.residual, torch.zeros(self.cfg.num_experts, dtype=torch.int64, device=hidden.device)
        out = a.residual + self.expert_layers[str(layer)](a.expert_input, a.topk_ids, a.topk_weights)
        return out, a.gating.expert_counts

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.embed.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight).float()

    def load_weights(self, source: WeightSource, show_progress: bool = False) -> None:
        cfg = self.cfg
        total = len(head_tensors(cfg)) + sum(len(attention_tensors(cfg, i)) for i in range(cfg.num_layers))  # fetches, not tensors:
        if self.expert_layers is not None:  # a fused tensor (DBRX's experts) is fetched once per part
            total += cfg.num_moe_layers * cfg.num_experts * len(expert_tensors(cfg, cfg.first_k_dense, 0))
        with tqdm(total=total, desc="loading weights", unit="tensor", disable=not show_progress) as bar:
            counting = _CountingSource(source, bar)
            t = {role: read(counting, ref) for role, ref in head_tensors(self.cfg).items()}
            self.embed.weight.copy_(t["embed"])
            self.norm.weight.copy_(t["norm"])
            if self.lm_head is not None:
                self.lm_head.weight.copy_(t["lm_head"])
            for i, attention in enumerate(self.attention_layers):
                attention.load_weights(counting)
                if self.expert_layers is not None and str(i) in self.expert_layers:
                    self.expert_layers[str(i)].load_weights(counting)


class _CountingSource:
    """Advances a progress bar by one per tensor fetched."""

    def __init__(self, source: WeightSource, bar: tqdm) -> None:
        self.source, self.bar = source, bar

    def get(self, name: str, shape: tuple[int, ...], rows: tuple[int, int] | None = None) -> torch.Tensor:
        tensor = self.source.get(name, shape, rows)
        self.bar.update(1)
        return tensor
