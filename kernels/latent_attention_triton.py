"""Triton latent attention (DeepSeek's MLA, absorbed) over a paged [c | k_r] cache: split-KV
decode with the generic kernels' merge, then causal prefill tiles; the programs live in
`latent_attention_jit`, the reference in `latent_attention_ref` (which takes the batch whole).

A decode program takes 16 or 32 heads of one sequence's token (FlashMLA's rows: every head reads
the same cache tile); a prefill program BLOCK_T tokens x BLOCK_H heads. Tiles (`LatentTiles`)
are sized so the accumulator [rows, rank] stays in registers at DeepSeek's rank of 512:
`python -m kernels.compile_check` compiles them at V2's and V3's shapes. Nothing here reads a
device tensor back: split sizes come from host-known lengths, prefill tiles from the host's
query offsets (`plan_latent`, built once per step and reused by every layer).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import attention_jit
from kernels import latent_attention_jit as jit
from kernels.attention_triton import (INTERPRETED, LOG2E, MAX_SPLITS, DecodeSplits, PrefillTiles, _ieee, num_sms,
                                      plan_prefill, plan_splits)
from kernels.tiles import pow2


@dataclass(frozen=True)
class LatentTiles:
    """Tile sizes of one (heads, rank, rope, dtype) shape."""

    decode_h: int  # heads per decode program: its tile's rows (masked rows pad fewer heads to 16)
    block_h: int  # heads per prefill program
    block_t: int  # query tokens per prefill tile (its rows: block_t x block_h)
    block_n: int  # cached positions per K/V tile
    decode_warps: int
    prefill_warps: int
    num_stages: int


def latent_tiles(heads: int, rank: int, dtype: torch.dtype, interpreted: bool = INTERPRETED) -> LatentTiles:
    """Decode tiles of 16 heads (tensor cores' smallest M), 32 from 32 heads up (DeepSeek-V3 at TP 1,
    2 and 4) with 8 warps: each program reads the whole cache of its sequence, so fewer, taller
    head blocks read it fewer times (FlashMLA's 64 need a warpgroup's split of the value width
    that Triton does not express; 64 rows spill on sm_90). Prefill tiles of 32 rows, as many of
    them heads as there are, up to 16. float32 tiles are twice the bytes: half the cached
    positions per tile, 16 rows (32 spill on sm_89/90). `python -m kernels.compile_check` compiles
    each. The interpreter runs the same tiles (it has no shared memory to fit)."""
    wide = dtype == torch.float32 or rank > 512
    block_h = 16 if heads >= 16 else max(1, pow2(heads))
    decode_h = 32 if heads >= 32 and not wide else 16
    return LatentTiles(decode_h=decode_h, block_h=block_h, block_t=max(1, (16 if wide else 32) // block_h),
                       block_n=16 if wide else 32, decode_warps=8 if decode_h > 16 else 4, prefill_warps=8,
                       num_stages=1 if interpreted else 2)


@dataclass(frozen=True)
class LatentPlan:
    """A batch's launches: its decode splits and its prefill tiles."""

    tiles: LatentTiles
    splits: DecodeSplits
    prefill: PrefillTiles


def check_latent(query: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor, rank: int) -> tuple[int, int]:
    """(heads, rope width) of a latent-attention call, or a ValueError naming the argument."""
    if query.dim() != 3 or query.stride(2) != 1:
        raise ValueError(f"query: want [tokens, heads, rank + rope] with the last dim contiguous, got shape "
                         f"{tuple(query.shape)}, strides {query.stride()}")
    width = query.shape[2]
    if not 0 < rank < width:
        raise ValueError(f"rank: want 0 < rank < the query's width {width} (the latent, then the rotary part), "
                         f"got {rank}")
    if cache.dim() != 4 or not cache.is_contiguous() or cache.shape[2] != 1 or cache.shape[3] != width:
        raise ValueError(f"cache: want a contiguous [blocks, page, 1, {width}] tensor, got shape "
                         f"{tuple(cache.shape)}, strides {cache.stride()}")
    if cache.dtype != query.dtype:
        raise ValueError(f"cache: dtype {cache.dtype} differs from the query's {query.dtype}")
    if block_tables.dim() != 2 or block_tables.stride(1) != 1 or block_tables.dtype.is_floating_point:
        raise ValueError(f"block_tables: want an integer [sequences, max_blocks] tensor with rows contiguous, got "
                         f"{block_tables.dtype} shape {tuple(block_tables.shape)}, strides {block_tables.stride()}")
    return query.shape[1], width - rank


def plan_latent(query: torch.Tensor, rank: int, block_tables: torch.Tensor, page: int, query_start_host: list[int],
                num_single: int, max_decode_len: int | None = None, num_splits: int | None = None) -> LatentPlan:
    """The launches of a batch whose first `num_single` sequences decode. max_decode_len: the
    longest decode's cached tokens, known on the host (default: the block tables' width)."""
    heads = query.shape[1]
    tiles = latent_tiles(heads, rank, query.dtype)
    max_len = max_decode_len if max_decode_len is not None else block_tables.shape[1] * page
    splits = plan_splits(num_single * -(-heads // tiles.decode_h), max_len, tiles.block_n, num_sms(query.device),
                         num_splits)
    return LatentPlan(tiles, splits, plan_prefill(query_start_host, num_single, tiles.block_t, query.device))


def latent_attention(query: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                     query_start_loc: torch.Tensor, query_start_host: list[int], num_single: int, scale: float,
                     rank: int, max_decode_len: int | None = None, num_splits: int | None = None,
                     plan: LatentPlan | None = None) -> torch.Tensor:
    """A hybrid batch (the first `num_single` sequences decode, the rest prefill) -> [T, H, rank]:
    the decodes' split-KV launch and merge, then the prefill tiles' launch."""
    heads, rope = check_latent(query, cache, block_tables, rank)
    page = cache.shape[1]
    out = torch.empty(query.shape[0], heads, rank, dtype=query.dtype, device=query.device)
    plan = plan or plan_latent(query, rank, block_tables, page, query_start_host, num_single, max_decode_len,
                               num_splits)
    t = plan.tiles
    blocks = dict(RANK=rank, ROPE=rope, PAGE=page, BLOCK_N=t.block_n, BLOCK_C=pow2(rank), BLOCK_P=max(16, pow2(rope)),
                  IEEE=_ieee(query), num_stages=t.num_stages)
    strides = (block_tables.stride(0), query.stride(0), query.stride(1))
    if num_single:
        splits = plan.splits
        if splits.count > 1:
            part_out = torch.empty(num_single, heads, splits.count, rank, dtype=torch.float32, device=query.device)
            part_lse = torch.empty(num_single, heads, splits.count, dtype=torch.float32, device=query.device)
        else:  # unused with one split
            part_out = part_lse = torch.empty(1, dtype=torch.float32, device=query.device)
        jit.latent_decode_kernel[(num_single, -(-heads // t.decode_h), splits.count)](
            query, cache, block_tables, seq_lens, out, part_out, part_lse, scale * LOG2E, *strides, splits.length,
            splits.count, H=heads, BLOCK_H=t.decode_h, num_warps=t.decode_warps, **blocks)
        if splits.count > 1:
            attention_jit.merge_kernel[(num_single, heads)](part_out, part_lse, out, splits.count, HQ=heads, D=rank,
                                                           MAX_SPLITS=MAX_SPLITS, BLOCK_D=pow2(rank))
    if plan.prefill.count:
        jit.latent_prefill_kernel[(plan.prefill.count, -(-heads // t.block_h))](
            query, cache, block_tables, seq_lens, query_start_loc, plan.prefill.seq, plan.prefill.start, out,
            scale * LOG2E, *strides, H=heads, BLOCK_T=t.block_t, BLOCK_H=t.block_h, num_warps=t.prefill_warps,
            **blocks)
    return out
