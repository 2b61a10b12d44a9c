"""DeepSeek-V2/V3's multi-head latent attention (MLA), in its absorbed form over a compressed cache.

A token's KV is one latent c (kv_lora_rank values, RMS-normed) and one rotary key k_r
(qk_rope_head_dim values) shared by every head: the cache holds [c | k_r] per token and layer
(576 values for V3) instead of heads. Head h's key would be [W_UK[h] c | k_r] and its value
W_UV[h] c; rather than expanding them for every cached token, the query absorbs W_UK
(q_h . k = (W_UK[h]^T q_nope) . c + q_rot . k_r) and the output W_UV, so attention is one
multi-query attention over the cache with keys [c | k_r] and values c, the same tensor
(`kernels.latent_attention`: on a GPU Triton kernels that read each cache tile once for a block of
heads and split the score into its latent and rotary products). Mathematically transformers'
expanded form; float32 rounding apart.

Rotary dims: DeepSeek rotates adjacent pairs (V2, and V3's `rope_interleave`); the rows that
produce them are permuted to halves as they load, so the rotate-half tables apply and every
q_rot . k_r dot product is unchanged. With tensor parallelism each rank holds its heads' W_UK,
W_UV and query rows, and the whole latent (every rank caches the same [c | k_r], as vLLM does).
"""

from __future__ import annotations

import math

import torch
from torch import nn

import kernels
from megainfer.config import ModelConfig
from megainfer.model.rms_norm import RMSNorm

LATENT_NORM_EPS = 1e-6  # DeepSeek's q_a_layernorm and kv_a_layernorm keep RMSNorm's default


def latent_scale(cfg: ModelConfig) -> float:
    """The softmax scale: 1 / sqrt(q/k head dim), times YaRN's mscale(factor, mscale_all_dim)^2."""
    scale = cfg.head_dim ** -0.5
    rope = cfg.rope_scaling
    if rope is not None and rope.mscale_all_dim and rope.factor > 1:
        m = 0.1 * rope.mscale_all_dim * math.log(rope.factor) + 1.0
        scale *= m * m
    return scale


def deinterleave(rows: torch.Tensor, rope: int) -> torch.Tensor:
    """[..., rope, in] rows of adjacent rotary pairs (x0, x1), (x2, x3), ... -> halves (x0, x2, ...,
    x1, x3, ...), the layout rotate-half rotates."""
    order = torch.cat([torch.arange(0, rope, 2), torch.arange(1, rope, 2)]).to(rows.device)
    return rows.index_select(-2, order)


class LatentAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, num_heads: int, dtype: torch.dtype, device: torch.device | str) -> None:
        """`num_heads`: this rank's query heads."""
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        h, self.rope, self.rank = cfg.hidden_size, cfg.qk_rope_head_dim, cfg.kv_lora_rank
        self.nope, self.v_dim, self.num_heads = cfg.head_dim - self.rope, cfg.v_head_dim, num_heads
        q_out = num_heads * cfg.head_dim
        if cfg.q_lora_rank:
            self.q_a = nn.Linear(h, cfg.q_lora_rank, bias=False, **kw)
            self.q_a_norm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS, **kw)
            self.q_b = nn.Linear(cfg.q_lora_rank, q_out, bias=False, **kw)
        else:
            self.q_a = self.q_a_norm = None
            self.q_b = nn.Linear(h, q_out, bias=False, **kw)
        self.kv_a = nn.Linear(h, self.rank + self.rope, bias=False, **kw)
        self.kv_a_norm = RMSNorm(self.rank, LATENT_NORM_EPS, **kw)
        # kv_b_proj's rows, per head: the key's non-rotary part (absorbed into the query), the value's.
        self.w_uk = nn.Parameter(torch.zeros(num_heads, self.nope, self.rank, **kw), requires_grad=False)
        self.w_uv = nn.Parameter(torch.zeros(num_heads, self.v_dim, self.rank, **kw), requires_grad=False)
        self.scale = latent_scale(cfg)
        self.interleaved = cfg.rope_interleave

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: torch.Tensor, batch: kernels.PagedAttentionBatch) -> torch.Tensor:
        """x [T, H] normed hidden states -> [T, heads * v_head_dim], the output projection's input;
        writes the tokens' [c | k_r] into `cache` ([blocks, page, 1, rank + rope])."""
        t = x.shape[0]
        q = self.q_b(x if self.q_a is None else self.q_a_norm(self.q_a(x))).view(t, self.num_heads, -1)
        q_nope, q_rot = q.split([self.nope, self.rope], dim=-1)
        latent = self.kv_a(x)
        c, k_rot = self.kv_a_norm(latent[:, :self.rank]), latent[:, self.rank:]
        cos, sin = cos[positions][:, None], sin[positions][:, None]
        q_rot, k_rot = _rotate(q_rot, cos, sin), _rotate(k_rot[:, None], cos, sin)
        entry = torch.cat([c[:, None], k_rot], dim=-1)  # [T, 1, rank + rope]
        cache.view(-1, 1, self.rank + self.rope).index_copy_(0, batch.slot_mapping, entry)
        query = torch.cat([torch.einsum("thn,hnc->thc", q_nope, self.w_uk), q_rot], dim=-1)
        out = kernels.latent_attention(query, cache, batch, self.scale, self.rank)
        return torch.einsum("thc,hvc->thv", out, self.w_uv).reshape(t, self.num_heads * self.v_dim)

    def load(self, t: dict[str, torch.Tensor], heads: slice) -> None:
        """Weights by role (checkpoint_names' MLA roles), this rank's `heads`."""
        head_dim = self.nope + self.rope
        q = t["q_b"].view(-1, head_dim, t["q_b"].shape[-1])[heads]
        if self.interleaved:
            q = torch.cat([q[:, :self.nope], deinterleave(q[:, self.nope:], self.rope)], dim=1)
        self.q_b.weight.copy_(q.reshape(-1, q.shape[-1]))
        if self.q_a is not None:
            self.q_a.weight.copy_(t["q_a"])
            self.q_a_norm.weight.copy_(t["q_a_norm"])
        kv_a = t["kv_a"]
        if self.interleaved:
            kv_a = torch.cat([kv_a[:self.rank], deinterleave(kv_a[self.rank:], self.rope)])
        self.kv_a.weight.copy_(kv_a)
        self.kv_a_norm.weight.copy_(t["kv_a_norm"])
        kv_b = t["kv_b"].view(-1, self.nope + self.v_dim, self.rank)[heads]
        self.w_uk.copy_(kv_b[:, :self.nope])
        self.w_uv.copy_(kv_b[:, self.nope:])


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of x [T, heads, rope] by cos, sin [T, 1, rope]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
