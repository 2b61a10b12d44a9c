"""Rotary position embedding's tables, cos and sin for every position (the rotation itself, rotate-half
form, fused with the KV-cache write: `kernels.rotary_store_kv`), with YaRN's scaling where the
model stretches RoPE past its training length (gpt-oss, DeepSeek)."""

from __future__ import annotations

import math

import torch
from torch import nn

from megainfer.config import RopeScaling


def yarn_inv_freq(head_dim: int, theta: float, scaling: RopeScaling, max_positions: int) -> tuple[torch.Tensor, float]:
    """YaRN's inverse frequencies and attention factor, computed as transformers computes them
    (`_compute_yarn_parameters`), so tables match bit for bit: dimensions that turn fewer than
    beta_slow times over the original context are interpolated (divided by factor), those that
    turn more than beta_fast times kept, a linear ramp between; cos and sin are then scaled by
    the attention factor (0.1 ln(factor) + 1 unless the config names it)."""
    factor = scaling.factor

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = scaling.attention_factor
    if attention is None:
        attention = (mscale(factor, scaling.mscale) / mscale(factor, scaling.mscale_all_dim)
                     if scaling.mscale and scaling.mscale_all_dim else mscale(factor))

    def correction_dim(rotations: float) -> float:
        original = scaling.original_max_position_embeddings
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    pos_freqs = theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolated = 1 - ramp  # the share of each dimension's frequency kept as trained
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolated) + (1.0 / pos_freqs) * extrapolated
    return inv_freq, float(attention)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, theta: float, max_positions: int, dtype: torch.dtype,
                 device: torch.device | str, scaling: RopeScaling | None = None) -> None:
        super().__init__()
        if scaling is None:
            inv_freq, attention = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)), 1.0
        else:
            inv_freq, attention = yarn_inv_freq(head_dim, theta, scaling, max_positions)
        # Same float32 arithmetic as transformers, so positions rotate bit-for-bit alike.
        freqs = torch.arange(max_positions, dtype=torch.int64).float()[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if attention != 1.0:
            cos, sin = cos * attention, sin * attention
        self.register_buffer("cos", cos.to(dtype=dtype, device=device), persistent=False)
        self.register_buffer("sin", sin.to(dtype=dtype, device=device), persistent=False)
