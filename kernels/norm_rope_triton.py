"""Triton versions of `norm_rope_ref` (same signatures): the residual add fused with the RMSNorm
(or, for DBRX, the bias-free LayerNorm) after it (one program per token: vLLM's fused_add_rms_norm), and rotary embedding fused with
the KV-cache write (one program per (token, head) of q and k side by side; a KV head's program
also writes its rotated key and its value to the token's cache slot: vLLM's rotary embedding
and reshape_and_cache in one launch).

Rounding follows the references step by step: each product and sum in the model dtype is
computed in float32 and rounded to it, as torch's element-wise ops on bf16/fp16 tensors do."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.tiles import pow2


@triton.jit
def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, stride_x, stride_res, eps,
                         H: tl.constexpr, BLOCK: tl.constexpr, CENTER: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    res = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
    summed = (res.to(tl.float32) + x.to(tl.float32)).to(x.dtype)
    tl.store(sum_ptr + row * H + cols, summed, mask=mask)
    s = summed.to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    if CENTER:  # LayerNorm, as torch computes it: centred, scaled and weighted in float32, cast once
        s = tl.where(mask, s - tl.sum(s, axis=0) / H, 0.0)
        rstd = tl.rsqrt(tl.sum(s * s, axis=0) / H + eps)
        tl.store(out_ptr + row * H + cols, (s * rstd * w.to(tl.float32)).to(x.dtype), mask=mask)
    else:  # RMSNorm, as transformers computes it: normalised in float32, cast, then weighted
        rstd = tl.rsqrt(tl.sum(s * s, axis=0) / H + eps)
        normed = (s * rstd).to(x.dtype)
        tl.store(out_ptr + row * H + cols, (w.to(tl.float32) * normed.to(tl.float32)).to(x.dtype), mask=mask)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return _add_norm(x, residual, weight, eps, center=False)


def add_layer_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                   eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return _add_norm(x, residual, weight, eps, center=True)


def _add_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
              center: bool) -> tuple[torch.Tensor, torch.Tensor]:
    tokens, hidden = x.shape
    if residual.shape != x.shape or x.stride(1) != 1 or residual.stride(1) != 1:
        raise ValueError(f"x and residual: want [tokens, hidden] with hidden contiguous, got {tuple(x.shape)} "
                         f"{x.stride()} and {tuple(residual.shape)} {residual.stride()}")
    out = torch.empty(tokens, hidden, dtype=x.dtype, device=x.device)
    summed = torch.empty_like(out)
    if tokens:
        _add_rms_norm_kernel[(tokens,)](x, residual, weight, out, summed, x.stride(0), residual.stride(0), eps,
                                        H=hidden, BLOCK=pow2(hidden), CENTER=center)
    return out, summed


@triton.jit
def _rotary_store_kv_kernel(qk_ptr, v_ptr, pos_ptr, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, out_ptr,
                            stride_qt, stride_qh, stride_vt, stride_vh, NUM_Q: tl.constexpr, HEADS: tl.constexpr,
                            D: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr, D_PAD: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    i = tl.arange(0, HALF_PAD)
    m = i < HALF
    row = qk_ptr + t * stride_qt + h * stride_qh
    x1 = tl.load(row + i, mask=m, other=0.0)
    x2 = tl.load(row + HALF + i, mask=m, other=0.0)
    pos = tl.load(pos_ptr + t)
    c1 = tl.load(cos_ptr + pos * D + i, mask=m, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + pos * D + HALF + i, mask=m, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + pos * D + i, mask=m, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + pos * D + HALF + i, mask=m, other=0.0).to(tl.float32)
    dtype = x1.dtype
    a1, a2 = x1.to(tl.float32), x2.to(tl.float32)
    # x * cos + rotate_half(x) * sin, rounded after each product and after the sum
    out1 = ((a1 * c1).to(dtype).to(tl.float32) + (-(a2 * s1)).to(dtype).to(tl.float32)).to(dtype)
    out2 = ((a2 * c2).to(dtype).to(tl.float32) + (a1 * s2).to(dtype).to(tl.float32)).to(dtype)
    dst = out_ptr + (t * HEADS + h) * D
    tl.store(dst + i, out1, mask=m)
    tl.store(dst + HALF + i, out2, mask=m)
    if h >= NUM_Q:  # a KV head: its rotated key and its value into the token's cache slot
        kv = h - NUM_Q
        slot = tl.load(slot_ptr + t)
        at = (slot * (HEADS - NUM_Q) + kv) * D
        tl.store(k_cache_ptr + at + i, out1, mask=m)
        tl.store(k_cache_ptr + at + HALF + i, out2, mask=m)
        j = tl.arange(0, D_PAD)
        value = tl.load(v_ptr + t * stride_vt + kv * stride_vh + j, mask=j < D, other=0.0)
        tl.store(v_cache_ptr + at + j, value, mask=j < D)


def rotary_store_kv(qk: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    key_cache: torch.Tensor, value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                    num_q_heads: int) -> torch.Tensor:
    tokens, heads, d = qk.shape
    kv_heads = heads - num_q_heads
    if qk.stride(2) != 1 or v.stride(2) != 1 or d % 2:
        raise ValueError(f"qk, v: want [tokens, heads, head_dim] with head_dim even and contiguous, got "
                         f"{tuple(qk.shape)} {qk.stride()} and {tuple(v.shape)} {v.stride()}")
    if tuple(key_cache.shape[2:]) != (kv_heads, d) or not key_cache.is_contiguous() or not value_cache.is_contiguous():
        raise ValueError(f"key_cache, value_cache: want contiguous [blocks, page, {kv_heads}, {d}], got "
                         f"{tuple(key_cache.shape)}")
    if not cos.is_contiguous() or not sin.is_contiguous():
        raise ValueError("cos, sin: want contiguous [max_positions, head_dim] tables")
    out = torch.empty(tokens, heads, d, dtype=qk.dtype, device=qk.device)
    if tokens:
        _rotary_store_kv_kernel[(tokens, heads)](
            qk, v, positions, cos, sin, key_cache, value_cache, slot_mapping, out, qk.stride(0), qk.stride(1),
            v.stride(0), v.stride(1), NUM_Q=num_q_heads, HEADS=heads, D=d, HALF=d // 2, HALF_PAD=pow2(d // 2),
            D_PAD=pow2(d), num_warps=1)
    return out
