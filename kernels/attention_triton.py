"""Triton paged attention: split-KV decode (flash-decoding) with a merge step, causal prefill
over a paged cache, and a POD-style fused kernel that computes a hybrid batch's prefill and
decode work in one launch (then the decodes' split merge). The programs live in
`attention_jit`; this module plans the work and launches them.

Layouts as in `paged_attention_ref`: query [T, Hq, D]; caches [num_blocks, page, Hkv, D];
block_tables [S, max_blocks]; seq_lens [S] (tokens cached, this step's included);
query_start_loc [S+1]. GQA: query head q reads kv head q // (Hq / Hkv).

Every program works on all the query heads of one kv head, so a K/V tile is read once per
group: prefill tiles stack BLOCK_M tokens x the group's heads as rows of one `tl.dot`;
decode tiles stack the group's heads (padded to 16 rows on tensor cores for groups of 4 and
more, element-wise products below that: POD's point that decode tiles are mostly padding).
The POD kernel gives every program one work item, prefill or decode: on NVIDIA each program
reads the SM it landed on and takes a role from that SM's counter in proportion to the two
kinds' work, so both kinds share every SM.

gpt-oss's variants (`sinks`, `window`: semantics in `paged_attention_ref`) are keyword
arguments of every launcher; each selects its own build of a program (`attention_jit`'s SINKS
and WINDOWED flags), the window's size staying a runtime argument. With a window, decode splits
cut only the window's positions, and no program reads a block before its queries' window.

Nothing here reads a device tensor back to the host: split sizes come from host-known
lengths (or the block tables' width), work tiles from the host's query offsets, copied
without a stream synchronisation. A plan (`plan_pod`, `plan_prefill`) depends only on the
batch's host metadata, so a caller builds it once per step and every layer reuses it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from kernels import attention_jit as jit
from kernels.launch import interpreted
from kernels.launch import check_attention, device_ints
from kernels.tiles import AttentionTiles, attention_tiles, pow2

INTERPRETED = interpreted()
LOG2E = 1.4426950408889634  # the kernels' softmax is base 2: scores are scaled by scale * log2(e)
MAX_SPLITS = 16  # KV splits per decode sequence (the merge kernel's tile)
# Cached tokens per KV split at least: shorter splits cost more in partial writes and the
# merge than the parallelism they add.
MIN_SPLIT_LEN = 256


@dataclass(frozen=True)
class PrefillTiles:
    """Prefill work tiles of a batch, built from its host-side query offsets."""
    seq: torch.Tensor  # [count] int32: the sequence of each tile
    start: torch.Tensor  # [count] int32: the tile's first query within its sequence's chunk
    count: int  # tiles
    block_m: int  # query tokens per tile


@dataclass(frozen=True)
class DecodeSplits:
    count: int  # KV splits per decode sequence
    length: int  # cached tokens per split, a multiple of the decode K/V tile


@dataclass(frozen=True)
class PodPlan:
    """A hybrid batch's launch: its prefill tiles, decode splits and the POD work shares."""
    tiles: AttentionTiles
    prefill: PrefillTiles
    splits: DecodeSplits
    prefill_items: int  # (prefill tile, kv head) items
    decode_items: int  # (decode sequence, kv head, split) items
    prefill_share: int  # of every prefill_share + decode_share arrivals on an SM, this many prefer prefill
    decode_share: int
    window: int = 0  # the sliding window its decode splits cover (0: whole contexts)


def tiles_for(query: torch.Tensor, key_cache: torch.Tensor, fused: bool = False) -> AttentionTiles:
    hq, hkv, d = query.shape[1], key_cache.shape[2], query.shape[2]
    return attention_tiles(d, hq // hkv, query.dtype, INTERPRETED, fused, arch(query.device))


def plan_prefill(query_start_host: list[int], first_seq: int, block_m: int, device: torch.device) -> PrefillTiles:
    """Tiles of block_m queries over sequences first_seq.. ; a chunk's last tile comes first:
    later queries see more keys, so the longest items start earliest."""
    seqs, starts = [], []
    for s in range(first_seq, len(query_start_host) - 1):
        for start in reversed(range(0, query_start_host[s + 1] - query_start_host[s], block_m)):
            seqs.append(s)
            starts.append(start)
    return PrefillTiles(device_ints(seqs or [0], device), device_ints(starts or [0], device), len(seqs), block_m)


def plan_splits(items: int, max_len: int, block_n: int, num_sms: int, num_splits: int | None = None) -> DecodeSplits:
    """Enough KV splits that `items` (sequence, kv head) pairs fill every SM about twice, none
    shorter than MIN_SPLIT_LEN; `num_splits` forces a count."""
    if num_splits is None:
        wanted = -(-2 * num_sms // max(items, 1))
        num_splits = max(1, min(wanted, MAX_SPLITS, -(-max_len // MIN_SPLIT_LEN)))
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits: want 1..{MAX_SPLITS}, got {num_splits}")
    length = -(-max(max_len, 1) // num_splits)
    return DecodeSplits(num_splits, -(-length // block_n) * block_n)


def plan_pod(query: torch.Tensor, key_cache: torch.Tensor, block_tables: torch.Tensor, query_start_host: list[int],
             num_single: int, max_decode_len: int | None = None, num_splits: int | None = None,
             window: int = 0) -> PodPlan:
    """The launch of a hybrid batch whose first `num_single` sequences decode. max_decode_len:
    the longest decode's cached tokens, known on the host (default: the block tables' width).
    window: the attention's sliding window (0: none), whose positions alone the splits cut."""
    tiles = tiles_for(query, key_cache, fused=True)
    hkv = key_cache.shape[2]
    prefill = plan_prefill(query_start_host, num_single, tiles.block_m, query.device)
    max_len = max_decode_len if max_decode_len is not None else block_tables.shape[1] * key_cache.shape[1]
    splits = plan_splits(num_single * hkv, _seen_len(max_len, window), tiles.decode_n, num_sms(query.device),
                         num_splits)
    prefill_items, decode_items = prefill.count * hkv, num_single * hkv * splits.count
    return PodPlan(tiles, prefill, splits, prefill_items, decode_items, *shares(prefill_items, decode_items), window)


def _seen_len(max_len: int, window: int) -> int:
    """The most positions one decode's query sees: its context, or its window."""
    return min(max_len, window) if window else max_len


def _variant(query: torch.Tensor, seq_lens: torch.Tensor, sinks: torch.Tensor | None,
             window: int) -> tuple[torch.Tensor, dict]:
    """(the tensor for sinks_ptr, the SINKS and WINDOWED flags) of a launch, or a ValueError
    naming the argument. Without sinks the programs never read sinks_ptr: seq_lens stands in
    (nothing allocated per call)."""
    if not isinstance(window, int) or window < 0:
        raise ValueError(f"window: want an int >= 0 (0: no sliding window), got {window!r}")
    if sinks is None:
        return seq_lens, dict(SINKS=False, WINDOWED=window > 0)
    hq = query.shape[1]
    if sinks.shape != (hq,) or sinks.dtype != torch.float32 or sinks.device != query.device or sinks.stride(0) != 1:
        raise ValueError(f"sinks: want a contiguous float32 [{hq}] tensor (one logit per query head) on "
                         f"{query.device}, got {sinks.dtype} shape {tuple(sinks.shape)} on {sinks.device}")
    return sinks, dict(SINKS=True, WINDOWED=window > 0)


def shares(prefill_items: int, decode_items: int, cycle: int = 8) -> tuple[int, int]:
    """POD's proportional policy: of every `cycle` arrivals on an SM, this many prefer each kind."""
    if not decode_items:
        return 1, 0
    if not prefill_items:
        return 0, 1
    p = min(cycle - 1, max(1, round(cycle * prefill_items / (prefill_items + decode_items))))
    return p, cycle - p


@functools.lru_cache(maxsize=None)
def num_sms(device: torch.device) -> int:
    if device.type == "cuda" and not INTERPRETED:
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter: a virtual SM count, so the per-SM policy still runs


@functools.lru_cache(maxsize=None)
def arch(device: torch.device) -> int:
    """Compute capability x10 of a CUDA device (90: Hopper); elsewhere the table's default."""
    if device.type == "cuda" and not INTERPRETED:
        major, minor = torch.cuda.get_device_capability(device)
        return 10 * major + minor
    return 90


def _ieee(t: torch.Tensor) -> bool:
    """Exact float32 tile products: for float32 inputs, and for every input in the interpreter,
    whose dot has no half-precision path (GPUs take bf16/fp16 tiles on tensor cores)."""
    return t.dtype == torch.float32 or INTERPRETED


def _partials(num_decodes: int, hq: int, d: int, splits: DecodeSplits, device: torch.device):
    """Split-KV scratch: per-split outputs and log-sum-exps (unused with one split)."""
    if splits.count == 1:
        empty = torch.empty(1, dtype=torch.float32, device=device)
        return empty, empty
    return (torch.empty(num_decodes, hq, splits.count, d, dtype=torch.float32, device=device),
            torch.empty(num_decodes, hq, splits.count, dtype=torch.float32, device=device))


def _merge(part_out: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor, num_decodes: int,
           splits: DecodeSplits) -> None:
    if splits.count > 1 and num_decodes:
        hq, d = out.shape[1:]
        jit.merge_kernel[(num_decodes, hq)](part_out, part_lse, out, splits.count, HQ=hq, D=d, MAX_SPLITS=MAX_SPLITS,
                                            BLOCK_D=pow2(d))


def decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, num_splits: int | None = None,
                     max_seq_len: int | None = None, sinks: torch.Tensor | None = None,
                     window: int = 0) -> torch.Tensor:
    """One query token per sequence ([S, Hq, D]) over its cached keys: split-KV, then a merge.
    max_seq_len: the longest sequence, known on the host (default: the block tables' width)."""
    hq, hkv, d, page, group = check_attention(query, key_cache, value_cache, block_tables)
    sinks_arg, flags = _variant(query, seq_lens, sinks, window)
    s_count = query.shape[0]
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if s_count == 0:
        return out
    tiles = tiles_for(query, key_cache)
    max_len = max_seq_len if max_seq_len is not None else block_tables.shape[1] * page
    splits = plan_splits(s_count * hkv, _seen_len(max_len, window), tiles.decode_n, num_sms(query.device),
                         num_splits)
    part_out, part_lse = _partials(s_count, hq, d, splits, query.device)
    jit.decode_kernel[(s_count, hkv, splits.count)](
        query, key_cache, value_cache, block_tables, seq_lens, sinks_arg, out, part_out, part_lse, scale * LOG2E,
        block_tables.stride(0), query.stride(0), query.stride(1), splits.length, splits.count, window, HQ=hq, HKV=hkv,
        D=d, PAGE=page, GROUP=group, BLOCK_G=tiles.decode_rows(group), BLOCK_N=tiles.decode_n,
        BLOCK_D=pow2(max(d, 16)), DOT=tiles.decode_dot, IEEE=_ieee(query), **flags, num_warps=4,
        num_stages=tiles.num_stages)
    _merge(part_out, part_lse, out, s_count, splits)
    return out


def prefill_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                      query_start_host: list[int], scale: float, plan: PrefillTiles | None = None,
                      sinks: torch.Tensor | None = None, window: int = 0) -> torch.Tensor:
    """Each sequence's chunk of new queries (its last tokens) attending causally to its cache.
    plan: this batch's tiles from `plan_prefill` (built here when not given)."""
    hq, hkv, d, page, group = check_attention(query, key_cache, value_cache, block_tables)
    sinks_arg, flags = _variant(query, seq_lens, sinks, window)
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    tiles = tiles_for(query, key_cache)
    plan = plan or plan_prefill(query_start_host, 0, tiles.block_m, query.device)
    if plan.block_m != tiles.block_m:
        raise ValueError(f"plan: tiles of {plan.block_m} queries, these shapes take {tiles.block_m}")
    if not plan.count:
        return out
    jit.prefill_kernel[(plan.count, hkv)](
        query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, plan.seq, plan.start, sinks_arg, out,
        scale * LOG2E, window, block_tables.stride(0), query.stride(0), query.stride(1), HQ=hq, HKV=hkv, D=d,
        PAGE=page, GROUP=group, GROUP_PAD=pow2(group), BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
        BLOCK_D=pow2(max(d, 16)), IEEE=_ieee(query), **flags, num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    return out


def pod_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, block_tables: torch.Tensor,
                  seq_lens: torch.Tensor, query_start_loc: torch.Tensor, query_start_host: list[int],
                  num_single: int, scale: float, max_decode_len: int | None = None, num_splits: int | None = None,
                  plan: PodPlan | None = None, sinks: torch.Tensor | None = None, window: int = 0) -> torch.Tensor:
    """A hybrid batch (the first `num_single` sequences decode, the rest prefill) in one launch,
    then the merge of the decodes' KV splits. plan: from `plan_pod` (built here when not given),
    for the same window."""
    hq, hkv, d, page, group = check_attention(query, key_cache, value_cache, block_tables)
    sinks_arg, flags = _variant(query, seq_lens, sinks, window)
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    plan = plan or plan_pod(query, key_cache, block_tables, query_start_host, num_single, max_decode_len, num_splits,
                            window)
    if plan.window != window:  # its splits would cut another range than this call's queries see
        raise ValueError(f"plan: built for window {plan.window}, this call's is {window}")
    if plan.prefill_items + plan.decode_items == 0:
        return out
    dev = query.device
    sms = num_sms(dev)
    counters = torch.zeros(sms + 2, dtype=torch.int32, device=dev)  # per-SM arrivals, then the two tickets
    part_out, part_lse = _partials(num_single, hq, d, plan.splits, dev)
    t = plan.tiles
    jit.pod_kernel[(plan.prefill_items + plan.decode_items,)](
        query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, plan.prefill.seq, plan.prefill.start,
        sinks_arg, out, part_out, part_lse, counters, plan.prefill_items, plan.decode_items, plan.splits.count,
        plan.splits.length, plan.prefill_share, plan.decode_share, scale * LOG2E, window, block_tables.stride(0),
        query.stride(0), query.stride(1), HQ=hq, HKV=hkv, D=d, PAGE=page, GROUP=group, GROUP_PAD=pow2(group),
        NUM_SMS=sms, USE_SMID=dev.type == "cuda" and not INTERPRETED, BLOCK_M=t.block_m, BLOCK_N=t.block_n,
        DECODE_G=t.decode_rows(group), DECODE_N=t.decode_n, DECODE_DOT=t.decode_dot, BLOCK_D=pow2(max(d, 16)),
        IEEE=_ieee(query), **flags, num_warps=t.num_warps, num_stages=t.num_stages)
    _merge(part_out, part_lse, out, num_single, plan.splits)
    return out
