"""Torch references of the attention half's small fused kernels, with transformers' numerics:
RMSNorm (normalise in float32, scale in the model dtype), the residual add fused before it, and
rotary embedding (rotate-half form) fused with the KV-cache write of the rotated keys and the
values."""

from __future__ import annotations

import torch

from kernels.paged_attention_ref import store_kv


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D] normalised over D in float32, cast back, times `weight` (broadcast over x)."""
    dtype = x.dtype
    x = x.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + x), residual + x): a layer's residual add and the norm after it."""
    summed = residual + x
    return rms_norm(summed, weight, eps), summed


def layer_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """torch's LayerNorm without a bias (DBRX): x [..., D] centred and scaled over D, times `weight`."""
    return torch.nn.functional.layer_norm(x, (x.shape[-1],), weight, None, eps)


def add_layer_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                   eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(layer_norm(residual + x), residual + x)."""
    summed = residual + x
    return layer_norm(summed, weight, eps), summed


def rotate(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] rotated at `positions` [T] by the tables cos, sin [max_positions, D]."""
    c = cos[positions][:, None, :]
    s = sin[positions][:, None, :]
    half = x.shape[-1] // 2
    return x * c + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * s


def rotary_store_kv(qk: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    key_cache: torch.Tensor, value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                    num_q_heads: int) -> torch.Tensor:
    """q and k side by side (qk [T, Hq + Hkv, D]) rotated, the rotated keys and the values
    (v [T, Hkv, D]) written to their cache slots; returns the rotated qk [T, Hq + Hkv, D]."""
    rotated = rotate(qk, positions, cos, sin)
    store_kv(rotated[:, num_q_heads:], v, key_cache, value_cache, slot_mapping)
    return rotated
