"""Rotary position embedding (rotate-half form), cos/sin precomputed for every position."""

from __future__ import annotations

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, theta: float, max_positions: int, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        # Same float32 arithmetic as transformers, so positions rotate bit-for-bit alike.
        freqs = torch.arange(max_positions, dtype=torch.int64).float()[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos().to(dtype=dtype, device=device), persistent=False)
        self.register_buffer("sin", emb.sin().to(dtype=dtype, device=device), persistent=False)

    def rotate(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x [T, heads, D] (any heads: q and k side by side rotate in one pass), positions [T]."""
        cos = self.cos[positions][:, None, :]
        sin = self.sin[positions][:, None, :]
        return x * cos + _rotate_half(x) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
