"""What the Triton launchers share: whether Triton interprets, argument checks that name the
offending argument, and host-to-device copies of small index tables that do not synchronise
the stream."""

from __future__ import annotations

import os

import torch


def interpreted() -> bool:
    """Whether Triton runs its interpreter (read when a kernel module is imported: `@triton.jit`
    picks interpreted or compiled functions then)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def device_ints(values: list[int], device: torch.device) -> torch.Tensor:
    """int32 `values` on `device`. On CUDA the copy goes through pinned memory and does not
    block: a pageable copy would wait for the whole stream (a host synchronisation per layer).
    Torch's pinned-memory allocator keeps the staging buffer until the copy has run."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=torch.int32, device=device)
    return torch.tensor(values, dtype=torch.int32, pin_memory=True).to(device, non_blocking=True)


def check_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_tables: torch.Tensor) -> tuple[int, int, int, int, int]:
    """(query heads, kv heads, head dim, page size, group) of a paged-attention call, or a
    ValueError naming the argument the kernels cannot read."""
    if query.dim() != 3 or query.stride(2) != 1:
        raise ValueError(f"query: want [tokens, heads, head_dim] with head_dim contiguous, got shape "
                         f"{tuple(query.shape)}, strides {query.stride()}")
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        if cache.dim() != 4 or not cache.is_contiguous():
            raise ValueError(f"{name}: want a contiguous [blocks, page, kv_heads, head_dim] tensor, got shape "
                             f"{tuple(cache.shape)}, strides {cache.stride()}")
        if cache.dtype != query.dtype:
            raise ValueError(f"{name}: dtype {cache.dtype} differs from the query's {query.dtype}")
    if value_cache.shape != key_cache.shape:
        raise ValueError(f"value_cache: shape {tuple(value_cache.shape)} differs from key_cache's "
                         f"{tuple(key_cache.shape)}")
    _, hq, d = query.shape
    _, page, hkv, cache_d = key_cache.shape
    if cache_d != d:
        raise ValueError(f"key_cache: head_dim {cache_d} differs from the query's {d}")
    if hq % hkv:
        raise ValueError(f"query: {hq} heads do not group over key_cache's {hkv} kv heads")
    if block_tables.dim() != 2 or block_tables.stride(1) != 1 or block_tables.dtype.is_floating_point:
        raise ValueError(f"block_tables: want an integer [sequences, max_blocks] tensor with rows contiguous, got "
                         f"{block_tables.dtype} shape {tuple(block_tables.shape)}, strides {block_tables.stride()}")
    return hq, hkv, d, page, hq // hkv


def check_experts(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, row_weights: torch.Tensor) -> None:
    """A ValueError naming the argument of a grouped expert GEMM the kernels cannot read."""
    if x.dim() != 2:
        raise ValueError(f"x: want [pairs, hidden], got shape {tuple(x.shape)}")
    experts, two_i, h = w_gate_up.shape
    if not w_gate_up.is_contiguous() or h != x.shape[1] or two_i % 2:
        raise ValueError(f"w_gate_up: want a contiguous [experts, 2 * intermediate, {x.shape[1]}] tensor, got shape "
                         f"{tuple(w_gate_up.shape)}, strides {w_gate_up.stride()}")
    if not w_down.is_contiguous() or tuple(w_down.shape) != (experts, h, two_i // 2):
        raise ValueError(f"w_down: want a contiguous [{experts}, {h}, {two_i // 2}] tensor, got shape "
                         f"{tuple(w_down.shape)}, strides {w_down.stride()}")
    for name, w in (("w_gate_up", w_gate_up), ("w_down", w_down)):
        if w.dtype != x.dtype:
            raise ValueError(f"{name}: dtype {w.dtype} differs from x's {x.dtype}")
    if row_weights.shape != (x.shape[0],):
        raise ValueError(f"row_weights: want [{x.shape[0]}], got shape {tuple(row_weights.shape)}")


def check_expert_biases(dtype: torch.dtype, experts: int, two_i: int, h: int, gate_up_bias: torch.Tensor | None,
                        down_bias: torch.Tensor | None) -> None:
    """A ValueError naming the bias of a grouped expert GEMM the kernels cannot read: each is a
    contiguous [experts, width] tensor in the weights' dtype, or None."""
    for name, bias, width in (("gate_up_bias", gate_up_bias, two_i), ("down_bias", down_bias, h)):
        if bias is None:
            continue
        if tuple(bias.shape) != (experts, width) or not bias.is_contiguous():
            raise ValueError(f"{name}: want a contiguous [{experts}, {width}] tensor, got shape {tuple(bias.shape)}, "
                             f"strides {bias.stride()}")
        if bias.dtype != dtype:
            raise ValueError(f"{name}: dtype {bias.dtype} differs from x's {dtype}")
