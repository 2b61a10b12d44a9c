"""The attention half of one MoE decoder layer: what an attention node runs.

input RMSNorm -> QKV -> (Qwen3: per-head q/k RMSNorm) -> RoPE -> paged attention over the
KV cache (gpt-oss: with sinks, and on its windowed layers over the last `sliding_window`
positions through the batch's window tables) -> output projection -> residual add ->
post-attention RMSNorm -> router logits -> top-k expert ids and routing weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

import kernels
from megainfer.config import ModelConfig
from megainfer.model.checkpoint_names import attention_tensors, read
from megainfer.model.dense_mlp import DenseMLP
from megainfer.model.grouped_routing import grouped_choice, grouped_weights
from megainfer.model.latent_attention import LatentAttention
from megainfer.model.layer_norm import norm_of
from megainfer.model.rms_norm import RMSNorm
from megainfer.model.rotary import RotaryEmbedding
from megainfer.model.weights import WeightSource
from megainfer import tensor_parallel


@dataclass
class AttentionOutput:
    residual: torch.Tensor  # [T, H] residual stream after attention (the experts' output is added to it)
    expert_input: torch.Tensor  # [T, H] post-attention-normed hidden states, what experts consume
    # top-k ids and weights, counts, and the dispatch layout; None for a dense layer (DeepSeek's
    # first ones), whose whole FFN ran here: `residual` is then the layer's output.
    gating: kernels.Gating | None

    @property
    def topk_ids(self) -> torch.Tensor:  # [T, k] int64 global expert ids
        return self.gating.topk_ids

    @property
    def topk_slots(self) -> torch.Tensor:  # [T, k] int64 the replica slot each pair goes to (the ids without replicas)
        return self.gating.topk_slots

    @property
    def topk_weights(self) -> torch.Tensor:  # [T, k] float32 routing weights
        return self.gating.topk_weights


class AttentionLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, dtype: torch.dtype, device: torch.device | str,
                 tp_rank: int = 0, tp_size: int = 1) -> None:
        """With tp_size > 1 this rank holds heads [tp_rank/tp_size, (tp_rank+1)/tp_size) of the
        query and KV heads; the output projection's partial sums are all-reduced over the
        default process group (the node's TP group)."""
        super().__init__()
        self.expert_node: torch.Tensor | None = None  # set_expert_nodes
        self.expert_slots: torch.Tensor | None = None
        self.num_expert_nodes = 0
        if cfg.num_heads % tp_size or cfg.num_kv_heads % tp_size:
            raise ValueError(f"tensor parallelism {tp_size} must divide the {cfg.num_heads} query and "
                             f"{cfg.num_kv_heads} KV heads")
        self.cfg = cfg
        self.layer = layer
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.num_heads = cfg.num_heads // tp_size
        self.num_kv_heads = cfg.num_kv_heads // tp_size
        self.q_size = self.num_heads * cfg.head_dim
        self.kv_size = self.num_kv_heads * cfg.head_dim
        h = cfg.hidden_size
        kw = dict(dtype=dtype, device=device)
        self.input_norm = norm_of(cfg, h, **kw)
        # DeepSeek's latent attention (its own projections), or q, k and v from one projection.
        self.latent = LatentAttention(cfg, self.num_heads, **kw) if cfg.mla else None
        self.qkv_proj = None if cfg.mla else nn.Linear(h, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias, **kw)
        self.o_in = self.num_heads * (cfg.v_head_dim if cfg.mla else cfg.head_dim)
        # The output bias is added once: by rank 0, before the all-reduce.
        self.o_proj = nn.Linear(self.o_in, h, bias=cfg.attention_bias and tp_rank == 0, **kw)
        # Qwen3's per-head q and k norms as one: a row of weights per head, the query heads' then
        # the KV heads' (one pass over q and k together: the same arithmetic per head, half the launches).
        self.qk_norm = RMSNorm((self.num_heads + self.num_kv_heads, cfg.head_dim), cfg.rms_norm_eps, **kw) \
            if cfg.qk_norm else None
        # The FFN this side runs (DeepSeek): a dense layer's whole FFN, or an MoE layer's shared experts.
        width = cfg.shared_expert_intermediate_size if cfg.is_moe_layer(layer) else cfg.dense_intermediate_size
        self.ffn = DenseMLP(h, width, tp_rank=tp_rank, tp_size=tp_size, **kw) if width else None
        self.post_norm = norm_of(cfg, h, **kw)
        # The residual add and the norm after it, fused: RMSNorm's, or DBRX's LayerNorm's.
        self.add_norm = kernels.add_layer_norm if cfg.norm == "layer" else kernels.add_rms_norm
        self.router = nn.Linear(h, cfg.num_experts, bias=cfg.router_bias, **kw) if cfg.is_moe_layer(layer) else None
        # DeepSeek-V3's per-expert bias on the scores that choose experts (not on the weights).
        self.register_buffer("score_bias", torch.zeros(cfg.num_experts, dtype=torch.float32, device=device)
                             if cfg.score_correction_bias and self.router is not None else None, persistent=False)
        self.window = cfg.window_of(layer)
        # gpt-oss's sinks, this rank's query heads': float32, as the softmax they join.
        self.sinks = nn.Parameter(torch.zeros(self.num_heads, dtype=torch.float32, device=device)) \
            if cfg.attention_sinks else None
        self.router_logit_bias = torch.tensor(cfg.router_logit_bias, dtype=torch.float32, device=device) \
            if cfg.router_logit_bias else None
        self.scale = cfg.head_dim ** -0.5
        self.requires_grad_(False)

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding,
                kv_cache: tuple[torch.Tensor, torch.Tensor], batch: kernels.PagedAttentionBatch,
                valid: torch.Tensor | None = None) -> AttentionOutput:
        """`valid` ([1] int32 on the device): the live rows of a padded batch (a CUDA graph's
        size); the rows past it are routed to no expert (kernels.fused_gating)."""
        x = self.input_norm(hidden)
        if self.latent is not None:
            attn = self.latent(x, positions, rotary.cos, rotary.sin, kv_cache[0], batch)
        else:
            attn = self._attend(x, positions, rotary, kv_cache, batch)
        out = self.o_proj(attn)
        if self.tp_size > 1:
            tensor_parallel.current().all_reduce(out)
        # The residual add and the post-attention norm: one kernel on CUDA.
        expert_input, residual = self.add_norm(out, hidden, self.post_norm.weight, self.post_norm.eps)
        if self.ffn is not None:
            residual = residual + self.ffn(expert_input)
        gating = None if self.router is None else self.route(expert_input, valid)
        return AttentionOutput(residual, expert_input, gating)

    def _attend(self, x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding,
                kv_cache: tuple[torch.Tensor, torch.Tensor], batch: kernels.PagedAttentionBatch) -> torch.Tensor:
        """Heads' attention: QKV, (DBRX) clipped, (Qwen3) q/k normed, rotated into the cache -> [T, q_size]."""
        cfg = self.cfg
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        if cfg.clip_qkv is not None:  # DBRX
            qkv = qkv.clamp(-cfg.clip_qkv, cfg.clip_qkv)
        # q and k side by side ([T, Hq + Hkv, D]): normed (Qwen3) and rotated in one pass each.
        qk = qkv[:, :self.q_size + self.kv_size].view(t, self.num_heads + self.num_kv_heads, cfg.head_dim)
        v = qkv[:, self.q_size + self.kv_size:].view(t, self.num_kv_heads, cfg.head_dim)
        if self.qk_norm is not None:
            qk = self.qk_norm(qk)
        key_cache, value_cache = kv_cache
        if self.window and batch.window_batch is not None:
            # A windowed layer reads and writes through the sequences' window tables (their blocks
            # outside the window freed); it shares its cache tensor with a full-attention layer,
            # whose blocks are others (model_runner.allocate_kv_caches).
            batch = batch.window_batch
        # Rotated, and the rotated keys and the values written to the cache: one kernel on CUDA.
        qk = kernels.rotary_store_kv(qk, v, positions, rotary.cos, rotary.sin, key_cache, value_cache,
                                     batch.slot_mapping, self.num_heads)
        attn = kernels.paged_attention(qk[:, :self.num_heads], key_cache, value_cache, batch, self.scale,
                                       sinks=self.sinks, window=self.window)
        return attn.reshape(t, self.q_size)

    def route(self, x: torch.Tensor, valid: torch.Tensor | None = None) -> kernels.Gating:
        """Softmax in float32 over all experts, top-k, renormalised where the model does; with an
        expert-node map (an attention node of a deployment) also each node's tokens in send order."""
        nodes, cfg = self.expert_node, self.cfg
        logits = self.router(x)
        if self.router_logit_bias is not None:
            logits = logits.float() + self.router_logit_bias
        if not cfg.model_type.startswith("deepseek"):
            return kernels.fused_gating(logits, cfg.top_k, cfg.norm_topk_prob, nodes,
                                        0 if nodes is None else self.num_expert_nodes, valid, self.expert_slots)
        # DeepSeek: the gating kernel picks and lays out the top-k of the choice scores (groups
        # masked); the weights are then the chosen experts' own scores.
        choice, scores = grouped_choice(logits, cfg, self.score_bias)
        g = kernels.fused_gating(choice, cfg.top_k, False, nodes, 0 if nodes is None else self.num_expert_nodes,
                                 valid, self.expert_slots)
        g.topk_weights = grouped_weights(scores, g.topk_ids, cfg)
        return g

    def set_expert_nodes(self, expert_node: torch.Tensor, num_nodes: int, expert_slots: torch.Tensor | None = None) -> None:
        """Expert id -> expert node index, so routing lays tokens out per destination; with
        replicas (megainfer/expert_replicas.py) `expert_slots` [E, B] picks each pair's slot and
        `expert_node` maps slots to nodes. Where the tensors exist with these shapes they are
        overwritten in place: a captured graph reads them where they are."""
        def place(held: torch.Tensor | None, new: torch.Tensor | None) -> torch.Tensor | None:
            if held is not None and new is not None and held.shape == new.shape and held.dtype == new.dtype:
                return held.copy_(new)
            return new

        self.expert_node = place(self.expert_node, expert_node)
        self.expert_slots = place(self.expert_slots, expert_slots)
        self.num_expert_nodes = num_nodes

    def load_weights(self, source: WeightSource) -> None:
        t = {role: read(source, ref) for role, ref in attention_tensors(self.cfg, self.layer).items()}
        if "qkv" in t:  # DBRX's fused Wqkv: q's rows, then k's, then v's
            t["q"], t["k"], t["v"] = t.pop("qkv").split([self.cfg.q_size, self.cfg.kv_size, self.cfg.kv_size])
        r = self.tp_rank
        qs, ks = slice(r * self.q_size, (r + 1) * self.q_size), slice(r * self.kv_size, (r + 1) * self.kv_size)
        self.input_norm.weight.copy_(t["input_norm"])
        self.o_proj.weight.copy_(t["o"][:, r * self.o_in:(r + 1) * self.o_in])
        self.post_norm.weight.copy_(t["post_norm"])
        self._load_ffn_and_router(t)
        if self.latent is not None:
            self.latent.load(t, slice(r * self.num_heads, (r + 1) * self.num_heads))
            return
        self.qkv_proj.weight.copy_(torch.cat([t["q"][qs], t["k"][ks], t["v"][ks]]))
        if self.cfg.attention_bias:
            self.qkv_proj.bias.copy_(torch.cat([t["q_bias"][qs], t["k_bias"][ks], t["v_bias"][ks]]))
            if self.o_proj.bias is not None:
                self.o_proj.bias.copy_(t["o_bias"])
        if self.cfg.qk_norm:
            self.qk_norm.weight[:self.num_heads].copy_(t["q_norm"].expand(self.num_heads, -1))
            self.qk_norm.weight[self.num_heads:].copy_(t["k_norm"].expand(self.num_kv_heads, -1))
        if self.sinks is not None:
            self.sinks.copy_(t["sinks"][r * self.num_heads:(r + 1) * self.num_heads])

    def _load_ffn_and_router(self, t: dict[str, torch.Tensor]) -> None:
        if self.router is not None:
            self.router.weight.copy_(t["router"])
            if self.cfg.router_bias:
                self.router.bias.copy_(t["router_bias"])
        if self.score_bias is not None:
            self.score_bias.copy_(t["score_bias"])
        if self.ffn is not None:
            role = "shared" if self.router is not None else "dense"
            self.ffn.load(t[f"{role}_gate"], t[f"{role}_up"], t[f"{role}_down"])
