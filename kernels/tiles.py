"""Tile sizes of the Triton kernels, chosen per shape from a small table (no autotuning: the
choice is deterministic, costs nothing at serving time and compiles one variant per shape).

The GPU rows come from the usual FlashAttention-2 / grouped-GEMM settings for Hopper and
Ampere, checked with `kernels.compile_check` (registers, spills and shared memory of every
row, compiled for sm_80, sm_89 and sm_90 without a GPU). The attention rows differ by
architecture (`arch`); the GEMM rows need not: each fits every one of the three, sm_89's
99 KiB per program included (its largest there, the decode row, takes 72 KiB: Triton's
mma.sync pipelining keeps num_stages - 1 tiles in shared memory, Hopper's wgmma all
num_stages, so sm_90's prefill row takes 96 KiB of its 227). A GEMM row that must differ
takes the arch as `attention_tiles` does, and the launcher passes its device's. Under
Triton's interpreter the tiles are the smallest a `tl.dot` takes (16), which keeps the CPU
tests quick; the interpreter runs the same code paths with them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# `tl.dot` needs at least 16 rows, columns and reduction elements.
MIN_DOT = 16


def pow2(n: int) -> int:
    """The smallest power of two >= n (>= 1)."""
    return 1 << max(0, int(n) - 1).bit_length()


@dataclass(frozen=True)
class AttentionTiles:
    block_m: int  # prefill: query tokens per tile; a tile's rows are block_m * group_pad (all heads of a kv head)
    block_n: int  # prefill: cached positions per K/V tile
    decode_n: int  # decode: cached positions per K/V tile
    decode_dot: bool  # decode scores on tensor cores (query heads padded to 16 rows), else element-wise products
    num_warps: int
    num_stages: int

    def decode_rows(self, group: int) -> int:
        """Rows of a decode tile: the group's query heads, padded to a tl.dot tile on tensor cores."""
        return max(MIN_DOT, pow2(group)) if self.decode_dot else pow2(group)


def attention_tiles(head_dim: int, group: int, dtype: torch.dtype, interpreted: bool, fused: bool = False,
                    arch: int = 90) -> AttentionTiles:
    """Tiles for query heads grouped `group` to a kv head, of `head_dim`, in `dtype`, on compute
    capability `arch` (x10). fused: for the POD kernel, whose point is prefill and decode
    programs side by side on every SM: its prefill tiles are halved and its programs take 4
    warps, so two or more fit on an SM."""
    # A group of 4+ query heads fills a 16-row tensor-core tile at least a quarter; below
    # that, element-wise products waste less (decode is bound by reading K/V either way).
    dot = group >= 4
    if interpreted:
        return AttentionTiles(_tokens(MIN_DOT, group), MIN_DOT, MIN_DOT, dot, 4, 1)
    if dtype == torch.float32:  # exact fp32 products on CUDA cores: 16-wide tiles keep registers from spilling
        return AttentionTiles(_tokens(MIN_DOT, group), MIN_DOT, MIN_DOT, dot, 4, 1)
    if head_dim <= 64:
        rows, block_n, decode_n, warps, stages = 128, 64, 64, 4 if arch >= 90 else 8, 3
    elif head_dim <= 128:
        rows, block_n, decode_n, warps, stages = 128, 64, 64, 8, 2
    else:
        rows, block_n, decode_n, warps, stages = 64, 32, 32, 8, 1
    if fused:
        rows, warps = rows // 2, 4
        if head_dim > 128:  # 256-wide heads: 32-row tiles left 8 bytes of stack on sm_90 with Triton 3.6
            rows, block_n = MIN_DOT, MIN_DOT
        if arch < 90:  # mma.sync tiles hold more in registers than Hopper's wgmma: narrower K/V tiles
            block_n, decode_n = min(block_n, 32), min(decode_n, 32)
    return AttentionTiles(_tokens(rows, group), block_n, decode_n if dot else 16, dot, warps, stages)


def _tokens(rows: int, group: int) -> int:
    """Query tokens per prefill tile so that a tile holds about `rows` rows (never under 16)."""
    return max(1, max(rows, MIN_DOT) // pow2(group))


@dataclass(frozen=True)
class GemmTiles:
    block_m: int  # rows (token, expert) pairs of one expert per tile
    block_n: int  # output columns per tile (gate-up: this many gate and this many up columns)
    block_k: int  # reduction step
    num_warps: int
    num_stages: int


def gemm_tiles(rows_per_expert: float, dtype: torch.dtype, interpreted: bool) -> GemmTiles:
    """Tiles for the grouped expert GEMM, by the mean rows per expert (pairs / experts): decode
    steps give an expert a handful of rows, prefill steps hundreds."""
    if interpreted:
        return GemmTiles(MIN_DOT, 32, 32, 4, 1)
    if dtype == torch.float32:
        return GemmTiles(32, 32, 32, 4, 2)
    if rows_per_expert <= 16:  # streaming weights: few rows, a deep reduction step
        return GemmTiles(16, 64, 128, 4, 3)
    if rows_per_expert <= 64:
        return GemmTiles(64, 64, 64, 4, 3)
    return GemmTiles(128, 64, 64, 8, 3)
