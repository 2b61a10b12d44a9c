"""RMSNorm with Hugging Face's numerics (normalise in float32, scale in the model dtype)."""

from __future__ import annotations

import torch
from torch import nn

from kernels.norm_rope_ref import rms_norm


class RMSNorm(nn.Module):
    def __init__(self, size: int | tuple[int, ...], eps: float, dtype: torch.dtype, device: torch.device | str) -> None:
        """`size`: the weight's shape (the normalised dimension last; a per-head norm may hold a row per head)."""
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype, device=device), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)
