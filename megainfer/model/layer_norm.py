"""LayerNorm without a bias (DBRX's norms), as torch's nn.LayerNorm(bias=False) computes it."""

from __future__ import annotations

import torch
from torch import nn

from kernels.norm_rope_ref import layer_norm


class LayerNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype, device=device), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, self.weight, self.eps)


def norm_of(cfg, size: int, dtype: torch.dtype, device: torch.device | str) -> nn.Module:
    """The model's norm: RMSNorm, or DBRX's LayerNorm (`ModelConfig.norm`)."""
    from megainfer.model.rms_norm import RMSNorm

    return LayerNorm(size, cfg.rms_norm_eps, dtype, device) if cfg.norm == "layer" else \
        RMSNorm(size, cfg.rms_norm_eps, dtype, device)
