"""MXFP4, the format gpt-oss's published checkpoints store their experts in (OCP Microscaling):
every 32 consecutive weights of a row share one power-of-two scale (an E8M0 byte, exponent +
127) and are each a 4-bit E2M1 float, two to a byte, low nibble first. A tensor `name` is
stored as `name_blocks` [..., rows, groups, 16] uint8 and `name_scales` [..., rows, groups]
uint8, rows being the output features and groups x 32 the input features, the transpose of
the layout transformers serves (`gate_up_proj` [E, H, 2I], `down_proj` [E, I, H]).

megainfer dequantizes them to the serving dtype as they load (`dequantize`): exact, since every
MXFP4 value is a bfloat16 too, and at 16 / 4.25 = 3.8x the experts' memory of the packed form
(docs/models.md). There is no MXFP4 GEMM here.
"""

from __future__ import annotations

import torch

# E2M1's sixteen values by code: sign bit 3, then 0, 0.5, 1, 1.5, 2, 3, 4, 6.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
SCALE_BIAS = 127
GROUP = 32  # weights per scale


def dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """blocks [..., R, G, 16] uint8 and scales [..., R, G] uint8 -> float32 [..., G * 32, R] (the
    stored rows become columns: the layout transformers serves)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape \
            or blocks.shape[-1] != GROUP // 2:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} {blocks.dtype} and scales {tuple(scales.shape)} "
                         f"{scales.dtype}: want uint8 [..., rows, groups, {GROUP // 2}] and uint8 [..., rows, groups]")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).to(torch.int64)  # low nibble first
    values = lut[codes].flatten(-2)  # [..., R, G, 32]
    values = torch.ldexp(values, (scales.to(torch.int32) - SCALE_BIAS)[..., None].to(torch.float32))
    return values.flatten(-2).transpose(-1, -2)
