"""Triton paged attention: split-KV decode (flash-decoding) with a merge step, causal
prefill over a paged cache, and a POD-style fused kernel that computes a hybrid batch's
prefill and decode work in one launch.

Layouts as in `paged_attention_ref`: query [T, Hq, D]; caches [num_blocks, page, Hkv, D];
block_tables [S, max_blocks] int32; seq_lens [S] (tokens cached, this step's included);
query_start_loc [S+1]. GQA: query head q reads kv head q // (Hq / Hkv).

Decode work is small tiles of element-wise products and row sums (one query token per
head: a tensor-core tile would be mostly padding, POD's point about decode tiles); prefill
work is `tl.dot` tiles. The POD kernel gives every program one work item, prefill or
decode: on NVIDIA each program reads the SM it landed on and takes a role from that SM's
counter in proportion to the two kinds' work, so both kinds share every SM; where the SM
id cannot be read (Triton's interpreter) the program id stands in for it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.dispatch import interpreted


@triton.jit
def _kv_tile(cache_ptr, bt_ptr, s, kv_head, start, seq_len, stride_bt, HKV: tl.constexpr, D: tl.constexpr,
             PAGE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """Keys (or values) of positions [start, start + BLOCK_N) of sequence s: [BLOCK_N, BLOCK_D]."""
    pos = start + tl.arange(0, BLOCK_N)
    valid = pos < seq_len
    block = tl.load(bt_ptr + s * stride_bt + pos // PAGE, mask=valid, other=0).to(tl.int64)
    slot = block * PAGE + pos % PAGE
    d = tl.arange(0, BLOCK_D)
    ptrs = cache_ptr + (slot[:, None] * HKV + kv_head) * D + d[None, :]
    return tl.load(ptrs, mask=valid[:, None] & (d[None, :] < D), other=0.0), valid


@triton.jit
def _decode_range(q_ptr, k_ptr, v_ptr, bt_ptr, q_row, s, kv_head, start, end, scale, stride_bt,
                  HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, GROUP: tl.constexpr,
                  BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """One decode query (row q_row of `query`), the GROUP query heads of kv_head, over cached
    positions [start, end): the unnormalised accumulator, running max and sum (online softmax)."""
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + g
    q_mask = (g[:, None] < GROUP) & (d[None, :] < D)
    q = tl.load(q_ptr + (q_row * HQ + heads[:, None]) * D + d[None, :], mask=q_mask, other=0.0).to(tl.float32)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        k, valid = _kv_tile(k_ptr, bt_ptr, s, kv_head, n0, end, stride_bt, HKV, D, PAGE, BLOCK_N, BLOCK_D)
        v, _ = _kv_tile(v_ptr, bt_ptr, s, kv_head, n0, end, stride_bt, HKV, D, PAGE, BLOCK_N, BLOCK_D)
        scores = tl.sum(q[:, None, :] * k.to(tl.float32)[None, :, :], axis=2) * scale
        scores = tl.where(valid[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _decode_split_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, lens_ptr, part_out_ptr, part_lse_ptr, scale, stride_bt,
                         split_len, HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
                         GROUP: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_G: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    s = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(lens_ptr + s)
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)
    acc, m_i, l_i = _decode_range(q_ptr, k_ptr, v_ptr, bt_ptr, s, s, kv_head, start, end, scale, stride_bt, HQ, HKV, D, PAGE, GROUP, BLOCK_G, BLOCK_N, BLOCK_D)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + g
    nonempty = l_i > 0
    out = tl.where(nonempty[:, None], acc / tl.where(nonempty, l_i, 1.0)[:, None], 0.0)
    lse = tl.where(nonempty, m_i + tl.log(tl.where(nonempty, l_i, 1.0)), float("-inf"))
    row = (s * HQ + heads) * NUM_SPLITS + split
    tl.store(part_out_ptr + row[:, None] * D + d[None, :], out, mask=(g[:, None] < GROUP) & (d[None, :] < D))
    tl.store(part_lse_ptr + row, lse, mask=g < GROUP)


@triton.jit
def _decode_merge_kernel(part_out_ptr, part_lse_ptr, out_ptr, HQ: tl.constexpr, D: tl.constexpr,
                         NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """Combine a head's per-split results with their log-sum-exps (flash-decoding's reduce)."""
    s = tl.program_id(0)
    head = tl.program_id(1)
    sp = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    base = (s * HQ + head) * NUM_SPLITS
    lse = tl.load(part_lse_ptr + base + sp, mask=sp < NUM_SPLITS, other=float("-inf"))
    part = tl.load(part_out_ptr + (base + sp[:, None]) * D + d[None, :],
                   mask=(sp[:, None] < NUM_SPLITS) & (d[None, :] < D), other=0.0)
    m = tl.max(lse, axis=0)
    w = tl.exp(lse - m)
    out = tl.sum(w[:, None] * part, axis=0) / tl.sum(w, axis=0)
    tl.store(out_ptr + (s * HQ + head) * D + d, out.to(out_ptr.dtype.element_ty), mask=d < D)


@triton.jit
def _prefill_tile(q_ptr, k_ptr, v_ptr, bt_ptr, lens_ptr, qstart_ptr, out_ptr, s, q_head, tile_start, scale,
                  stride_bt, HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
                  GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                  IEEE: tl.constexpr):
    """Queries [tile_start, tile_start + BLOCK_M) of sequence s's chunk, one query head, attending
    causally to the sequence's cached prefix and to the chunk itself."""
    seq_len = tl.load(lens_ptr + s)
    q_begin = tl.load(qstart_ptr + s)
    n = tl.load(qstart_ptr + s + 1) - q_begin
    kv_head = q_head // GROUP
    i = tile_start + tl.arange(0, BLOCK_M)
    rows = i < n
    q_pos = seq_len - n + i
    d = tl.arange(0, BLOCK_D)
    q_ptrs = q_ptr + ((q_begin + i[:, None]) * HQ + q_head) * D + d[None, :]
    q = tl.load(q_ptrs, mask=rows[:, None] & (d[None, :] < D), other=0.0)
    if IEEE:  # float32 in, exact float32 products; also the interpreter's way through half precision
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    kv_end = tl.minimum(seq_len, seq_len - n + tile_start + BLOCK_M)  # the tile's last query sees no further
    for n0 in range(0, kv_end, BLOCK_N):
        k, valid = _kv_tile(k_ptr, bt_ptr, s, kv_head, n0, seq_len, stride_bt, HKV, D, PAGE, BLOCK_N, BLOCK_D)
        v, _ = _kv_tile(v_ptr, bt_ptr, s, kv_head, n0, seq_len, stride_bt, HKV, D, PAGE, BLOCK_N, BLOCK_D)
        if IEEE:
            k, v = k.to(tl.float32), v.to(tl.float32)
            scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        else:
            scores = tl.dot(q, tl.trans(k)) * scale
        k_pos = n0 + tl.arange(0, BLOCK_N)
        seen = valid[None, :] & (k_pos[None, :] <= q_pos[:, None]) & rows[:, None]
        scores = tl.where(seen, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows past the chunk see nothing
        p = tl.exp(scores - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_ptrs = out_ptr + ((q_begin + i[:, None]) * HQ + q_head) * D + d[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=rows[:, None] & (d[None, :] < D))


@triton.jit
def _prefill_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, lens_ptr, qstart_ptr, tile_seq_ptr, tile_start_ptr, out_ptr, scale,
                    stride_bt, HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
                    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                    IEEE: tl.constexpr):
    tile = tl.program_id(0)
    q_head = tl.program_id(1)
    s = tl.load(tile_seq_ptr + tile)
    start = tl.load(tile_start_ptr + tile)
    _prefill_tile(q_ptr, k_ptr, v_ptr, bt_ptr, lens_ptr, qstart_ptr, out_ptr, s, q_head, start, scale, stride_bt,
                  HQ, HKV, D, PAGE, GROUP, BLOCK_M, BLOCK_N, BLOCK_D, IEEE)


@triton.jit
def _sm_id(pid, NUM_SMS: tl.constexpr, USE_SMID: tl.constexpr):
    if USE_SMID:
        return tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
    else:
        return pid % NUM_SMS


@triton.jit
def _pod_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, lens_ptr, qstart_ptr, tile_seq_ptr, tile_start_ptr, out_ptr,
                sm_count_ptr, tickets_ptr, num_prefill_items, num_decode_items, scale, stride_bt,
                HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, GROUP: tl.constexpr,
                PREFILL_SHARE: tl.constexpr, DECODE_SHARE: tl.constexpr, NUM_SMS: tl.constexpr,
                USE_SMID: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_D: tl.constexpr, IEEE: tl.constexpr):
    """One program, one work item. Prefill items are (query tile, query head); decode items are
    (decode sequence, kv head), the decodes being the batch's first sequences. A program's k-th
    arrival on its SM prefers prefill when k falls in the prefill share of the cycle
    PREFILL_SHARE + DECODE_SHARE; it takes a ticket of its preferred kind, or of the other kind
    once that is exhausted. There are exactly as many programs as items, so every item is done once."""
    pid = tl.program_id(0)
    sm = _sm_id(pid, NUM_SMS, USE_SMID)
    arrival = tl.atomic_add(sm_count_ptr + sm, 1)
    prefer_prefill = (arrival % (PREFILL_SHARE + DECODE_SHARE)) < PREFILL_SHARE
    kind = tl.where(prefer_prefill, 0, 1)  # 0: prefill, 1: decode
    ticket = tl.atomic_add(tickets_ptr + kind, 1)
    limit = tl.where(prefer_prefill, num_prefill_items, num_decode_items)
    if ticket >= limit:  # this kind is used up: the other kind has an item left for this program
        kind = 1 - kind
        ticket = tl.atomic_add(tickets_ptr + kind, 1)
    if kind == 0:
        tile = ticket // HQ
        q_head = ticket % HQ
        s = tl.load(tile_seq_ptr + tile)
        start = tl.load(tile_start_ptr + tile)
        _prefill_tile(q_ptr, k_ptr, v_ptr, bt_ptr, lens_ptr, qstart_ptr, out_ptr, s, q_head, start, scale,
                      stride_bt, HQ, HKV, D, PAGE, GROUP, BLOCK_M, BLOCK_N, BLOCK_D, IEEE)
    else:
        s = ticket // HKV
        kv_head = ticket % HKV
        seq_len = tl.load(lens_ptr + s)
        acc, m_i, l_i = _decode_range(q_ptr, k_ptr, v_ptr, bt_ptr, s, s, kv_head, 0, seq_len, scale, stride_bt, HQ, HKV, D, PAGE, GROUP, BLOCK_G, BLOCK_N, BLOCK_D)
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, BLOCK_D)
        heads = kv_head * GROUP + g
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + (s * HQ + heads[:, None]) * D + d[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=(g[:, None] < GROUP) & (d[None, :] < D))


# -- host side -------------------------------------------------------------------------------------
BLOCK_N = 16  # cached positions per tile
BLOCK_M = 16  # prefill queries per tile
MAX_SPLITS = 16
INTERPRETED = interpreted()


def _pow2(n: int, floor: int = 1) -> int:
    return max(floor, triton.next_power_of_2(int(n)))


def _shape(query: torch.Tensor, key_cache: torch.Tensor) -> tuple[int, int, int, int, int]:
    _, hq, d = query.shape
    _, page, hkv, _ = key_cache.shape
    if hq % hkv:
        raise ValueError(f"{hq} query heads do not group over {hkv} kv heads")
    return hq, hkv, d, page, hq // hkv


def decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                     num_splits: int | None = None) -> torch.Tensor:
    """One query token per sequence ([S, Hq, D]) over its cached keys: split-KV, then a merge."""
    s_count = query.shape[0]
    hq, hkv, d, page, group = _shape(query, key_cache)
    out = torch.empty_like(query)
    if s_count == 0:
        return out
    max_len = int(seq_lens.max())
    splits = num_splits or min(MAX_SPLITS, max(1, -(-max_len // 256)))
    split_len = -(-max(max_len, 1) // splits)
    split_len = -(-split_len // BLOCK_N) * BLOCK_N
    part_out = torch.empty(s_count, hq, splits, d, dtype=torch.float32, device=query.device)
    part_lse = torch.empty(s_count, hq, splits, dtype=torch.float32, device=query.device)
    _decode_split_kernel[(s_count, hkv, splits)](
        query, key_cache, value_cache, block_tables, seq_lens, part_out, part_lse, scale, block_tables.stride(0),
        split_len, HQ=hq, HKV=hkv, D=d, PAGE=page, GROUP=group, NUM_SPLITS=splits, BLOCK_G=_pow2(group),
        BLOCK_N=BLOCK_N, BLOCK_D=_pow2(d))
    _decode_merge_kernel[(s_count, hq)](part_out, part_lse, out, HQ=hq, D=d, NUM_SPLITS=splits,
                                        BLOCK_S=_pow2(splits), BLOCK_D=_pow2(d))
    return out


def _tiles(query_start_host: list[int], first_seq: int) -> tuple[list[int], list[int]]:
    seqs, starts = [], []
    for s in range(first_seq, len(query_start_host) - 1):
        for start in range(0, query_start_host[s + 1] - query_start_host[s], BLOCK_M):
            seqs.append(s)
            starts.append(start)
    return seqs, starts


def prefill_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                      query_start_host: list[int], scale: float) -> torch.Tensor:
    """Each sequence's chunk of new queries (its last tokens) attending causally to its cache."""
    hq, hkv, d, page, group = _shape(query, key_cache)
    out = torch.empty_like(query)
    seqs, starts = _tiles(query_start_host, 0)
    if not seqs:
        return out
    dev = query.device
    tile_seq = torch.tensor(seqs, dtype=torch.int32, device=dev)
    tile_start = torch.tensor(starts, dtype=torch.int32, device=dev)
    _prefill_kernel[(len(seqs), hq)](
        query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, tile_seq, tile_start, out, scale,
        block_tables.stride(0), HQ=hq, HKV=hkv, D=d, PAGE=page, GROUP=group, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
        BLOCK_D=_pow2(d, 16), IEEE=_ieee(query))
    return out


def _ieee(t: torch.Tensor) -> bool:
    """Exact float32 tile products: for float32 inputs, and for every input in the interpreter,
    whose dot has no half-precision path (GPUs take bf16/fp16 tiles on tensor cores)."""
    return t.dtype == torch.float32 or INTERPRETED


def _shares(prefill_items: int, decode_items: int, cycle: int = 8) -> tuple[int, int]:
    """POD's proportional policy: of every `cycle` arrivals on an SM, this many prefer each kind."""
    if not decode_items:
        return 1, 0
    if not prefill_items:
        return 0, 1
    p = min(cycle - 1, max(1, round(cycle * prefill_items / (prefill_items + decode_items))))
    return p, cycle - p


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter: a virtual SM count, so the per-SM policy still runs


def pod_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, block_tables: torch.Tensor,
                  seq_lens: torch.Tensor, query_start_loc: torch.Tensor, query_start_host: list[int],
                  num_single: int, scale: float) -> torch.Tensor:
    """A hybrid batch (the first `num_single` sequences decode, the rest prefill) in one launch."""
    hq, hkv, d, page, group = _shape(query, key_cache)
    out = torch.empty_like(query)
    seqs, starts = _tiles(query_start_host, num_single)
    n_prefill, n_decode = len(seqs) * hq, num_single * hkv
    if n_prefill + n_decode == 0:
        return out
    dev = query.device
    tile_seq = torch.tensor(seqs or [0], dtype=torch.int32, device=dev)
    tile_start = torch.tensor(starts or [0], dtype=torch.int32, device=dev)
    num_sms = _num_sms(dev)
    sm_count = torch.zeros(num_sms, dtype=torch.int32, device=dev)
    tickets = torch.zeros(2, dtype=torch.int32, device=dev)
    p_share, d_share = _shares(n_prefill, n_decode)
    _pod_kernel[(n_prefill + n_decode,)](
        query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, tile_seq, tile_start, out,
        sm_count, tickets, n_prefill, n_decode, scale, block_tables.stride(0), HQ=hq, HKV=hkv, D=d, PAGE=page,
        GROUP=group, PREFILL_SHARE=p_share, DECODE_SHARE=d_share, NUM_SMS=num_sms,
        USE_SMID=dev.type == "cuda" and not INTERPRETED, BLOCK_G=_pow2(group), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
        BLOCK_D=_pow2(d, 16), IEEE=_ieee(query))
    return out
