"""gpt-oss's experts as transformers holds and computes them (`GptOssExperts`, transformers 5),
for the grouped expert GEMM's tests (tests/kernels/test_kernels.py, test_moe_packed.py): the
parameters in transformers' layout (gate and up interleaved), an explicit per-expert float32
loop over them, and the de-interleave into megainfer's layout that the loader does. Written from
transformers' code, independent of kernels/: the kernels are checked against this, never against
each other only."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

ALPHA, LIMIT = 1.702, 7.0  # gpt-oss's swiglu_alpha and swiglu_limit


@dataclass
class HFExperts:
    gate_up_proj: torch.Tensor  # [E, H, 2I]: x @ gate_up_proj[e]; gate = [..., ::2], up = [..., 1::2]
    gate_up_proj_bias: torch.Tensor  # [E, 2I], interleaved alike
    down_proj: torch.Tensor  # [E, I, H]
    down_proj_bias: torch.Tensor  # [E, H]

    @classmethod
    def random(cls, experts: int, hidden: int, inter: int, seed: int,
               dtype: torch.dtype = torch.float32) -> "HFExperts":
        """Gate and up pre-activations of std about 5 over unit-normal rows: past LIMIT often
        enough that the clamp binds on both sides (`pre_activations` lets a test assert it)."""
        g = torch.Generator().manual_seed(seed)
        return cls((torch.randn(experts, hidden, 2 * inter, generator=g) * 5 * hidden ** -0.5).to(dtype),
                   torch.randn(experts, 2 * inter, generator=g).to(dtype),
                   (torch.randn(experts, inter, hidden, generator=g) * 0.3 * inter ** -0.5).to(dtype),
                   torch.randn(experts, hidden, generator=g).to(dtype))

    def megainfer(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(w_gate_up [E, 2I, H] gate rows first, w_down [E, H, I], gate_up_bias [E, 2I] gate's
        first, down_bias [E, H]): the loader's de-interleave, contiguous."""
        gate_up = self.gate_up_proj.transpose(1, 2)  # [E, 2I, H], rows interleaved gate, up, gate, ...
        w_gate_up = torch.cat([gate_up[:, 0::2], gate_up[:, 1::2]], dim=1).contiguous()
        bias = torch.cat([self.gate_up_proj_bias[:, 0::2], self.gate_up_proj_bias[:, 1::2]], dim=1).contiguous()
        return w_gate_up, self.down_proj.transpose(1, 2).contiguous(), bias, self.down_proj_bias.contiguous()

    def pre_activations(self, x: torch.Tensor, offsets: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate, up) of every computed row, biases added, float32."""
        gates, ups = [], []
        for e in range(len(offsets) - 1):
            gate_up = x[offsets[e]:offsets[e + 1]].float() @ self.gate_up_proj[e].float()
            gate_up = gate_up + self.gate_up_proj_bias[e].float()
            gates.append(gate_up[:, ::2])
            ups.append(gate_up[:, 1::2])
        return torch.cat(gates), torch.cat(ups)

    def forward(self, x: torch.Tensor, offsets: list[int], row_weights: torch.Tensor, clamped: bool = True,
                biases: bool = True) -> torch.Tensor:
        """Rows [offsets[e], offsets[e + 1]) of x through expert e, as GptOssExperts.forward
        computes a token's pair with expert e (clamped=False: silu(gate) * up instead, biases=False:
        none), in float32; rows past offsets[-1] stay zero."""
        out = torch.zeros(x.shape, dtype=torch.float32)
        for e in range(len(offsets) - 1):
            rows = slice(offsets[e], offsets[e + 1])
            gate_up = x[rows].float() @ self.gate_up_proj[e].float()
            if biases:
                gate_up = gate_up + self.gate_up_proj_bias[e].float()
            gate, up = gate_up[..., ::2], gate_up[..., 1::2]
            if clamped:
                gate = gate.clamp(min=None, max=LIMIT)
                up = up.clamp(min=-LIMIT, max=LIMIT)
                h = (up + 1) * (gate * torch.sigmoid(gate * ALPHA))
            else:
                h = F.silu(gate) * up
            down = h @ self.down_proj[e].float()
            if biases:
                down = down + self.down_proj_bias[e].float()
            out[rows] = down * row_weights[rows, None].float()
        return out


def assert_clamp_binds(experts: HFExperts, x: torch.Tensor, offsets: list[int]) -> None:
    """The test data reach past the limit: gate above it, up beyond it on both sides."""
    gate, up = experts.pre_activations(x, offsets)
    assert (gate > LIMIT).any() and (gate < LIMIT).any(), "no gate value exceeds the limit: the clamp is untested"
    assert (up > LIMIT).any() and (up < -LIMIT).any(), "no up value is beyond ±limit: the clamp is untested"
