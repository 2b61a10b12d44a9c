"""A dense SwiGLU FFN on the attention side: DeepSeek's shared experts (every token's, beside the
routed ones) and its first dense layers. With tensor parallelism each rank holds a slice of the
intermediate dimension and the partial outputs are all-reduced over the node's ranks."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megainfer import tensor_parallel


class DenseMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, dtype: torch.dtype, device: torch.device | str,
                 tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        if intermediate % tp_size:
            raise ValueError(f"FFN intermediate size {intermediate} does not split over {tp_size} tensor-parallel ranks")
        self.part = slice(tp_rank * intermediate // tp_size, (tp_rank + 1) * intermediate // tp_size)
        self.tp_size = tp_size
        width = intermediate // tp_size
        self.gate_up = nn.Linear(hidden, 2 * width, bias=False, dtype=dtype, device=device)
        self.down = nn.Linear(width, hidden, bias=False, dtype=dtype, device=device)
        self.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        out = self.down(F.silu(gate) * up)
        if self.tp_size > 1:
            tensor_parallel.current().all_reduce(out)
        return out

    def load(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> None:
        """gate, up [I, H]; down [H, I]: the whole FFN's, this rank's slice taken here."""
        self.gate_up.weight.copy_(torch.cat([gate[self.part], up[self.part]]))
        self.down.weight.copy_(down[:, self.part])
