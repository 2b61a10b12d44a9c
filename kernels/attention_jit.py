"""The Triton programs of paged attention; `attention_triton` plans and launches them.

Layouts as in `paged_attention_ref`: query [T, Hq, D] with strides (stride_qt, stride_qh, 1);
output [T, Hq, D] contiguous; caches [num_blocks, PAGE, Hkv, D] contiguous; block_tables
[S, max_blocks], rows stride_bt apart; seq_lens [S]; query_start_loc [S+1]. Query head h
reads kv head h // GROUP.

Softmax runs in base 2: `scale` arrives multiplied by log2(e), and the log-sum-exps of
split-KV partials are in log2 units. Split-KV partials: part_out [S_decode, Hq, splits, D]
float32 (each split's normalised output), part_lse [S_decode, Hq, splits].

gpt-oss's two variants, constexpr flags so the plain kernels compile as before:
  SINKS     sinks_ptr [Hq] float32 (natural-log logits): each softmax starts from the state of
            having seen one key of logit sinks[h] and value 0, so the sink sits in the
            denominator once. Split-KV: only split 0 starts so (its log-sum-exp carries the sink
            into the merge); the others start empty.
  WINDOWED  `window` (a runtime int, so one build serves every W): the query at position i sees
            keys i - window < j <= i. Each program starts its K/V loop at its queries' window,
            so the blocks before (placeholders once the scheduler frees them) are never read.

Integer arguments that change from step to step (item counts, split lengths, work shares,
the block-table width, the window) are `do_not_specialize`: Triton would otherwise compile a
variant when one of them is 1 or a multiple of 16, which would stall serving mid-run.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import cuda as cuda_extra


@triton.jit
def _kv_tile(cache_ptr, bt_ptr, s, kv_head, start, seq_len, stride_bt, HKV: tl.constexpr, D: tl.constexpr,
             PAGE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """Keys (or values) of positions [start, start + BLOCK_N) of sequence s: [BLOCK_N, BLOCK_D],
    and which of those positions exist (< seq_len)."""
    pos = start + tl.arange(0, BLOCK_N)
    valid = pos < seq_len
    block = tl.load(bt_ptr + s * stride_bt + pos // PAGE, mask=valid, other=0).to(tl.int64)
    slot = block * PAGE + pos % PAGE
    d = tl.arange(0, BLOCK_D)
    ptrs = cache_ptr + (slot[:, None] * HKV + kv_head) * D + d[None, :]
    return tl.load(ptrs, mask=valid[:, None] & (d[None, :] < D), other=0.0), valid


@triton.jit
def _qk(q, k, scale, DOT: tl.constexpr, IEEE: tl.constexpr):
    """Scores of query rows q [R, BLOCK_D] against keys k [N, BLOCK_D]: [R, N] float32."""
    if DOT:
        if IEEE:  # float32 in, exact products; also the interpreter's way through half precision
            scores = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            scores = tl.dot(q, tl.trans(k))
    else:
        scores = tl.sum(q.to(tl.float32)[:, None, :] * k.to(tl.float32)[None, :, :], axis=2)
    return scores * scale


@triton.jit
def _pv(p, v, DOT: tl.constexpr, IEEE: tl.constexpr):
    """Probabilities p [R, N] float32 times values v [N, BLOCK_D]: [R, BLOCK_D] float32."""
    if DOT:
        if IEEE:
            out = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            out = tl.dot(p.to(v.dtype), v)
    else:
        out = tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
    return out


@triton.jit
def _online_update(scores, v, acc, m_i, l_i, DOT: tl.constexpr, IEEE: tl.constexpr):
    """Fold one K/V tile's scores (base 2, -inf where unseen) into the running maximum m_i,
    sum l_i and unnormalised output acc."""
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing stays empty
    p = tl.exp2(scores - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + _pv(p, v, DOT, IEEE)
    return acc, m_new, l_i


@triton.jit
def _initial_state(sinks_ptr, heads, with_sink, ROWS: tl.constexpr, BLOCK_D: tl.constexpr, SINKS: tl.constexpr):
    """The online softmax's state (acc, m_i, l_i) before any key: empty, or for rows `with_sink`
    as if one key of logit sinks[head] (scaled to base 2; `scale` does not apply to it) and
    value 0 had been seen: e^(sink - m) then stays in the denominator, however m grows."""
    acc = tl.zeros([ROWS, BLOCK_D], tl.float32)
    if SINKS:
        m_i = tl.load(sinks_ptr + heads, mask=with_sink, other=float("-inf")).to(tl.float32) * 1.4426950408889634
        l_i = tl.where(m_i > float("-inf"), 1.0, 0.0)
    else:
        m_i = tl.full([ROWS], float("-inf"), tl.float32)
        l_i = tl.zeros([ROWS], tl.float32)
    return acc, m_i, l_i


@triton.jit
def _split_range(split, split_len, seq_len, window, WINDOWED: tl.constexpr):
    """Cached positions [start, end) of a decode's KV split: splits cut the positions its query
    sees, all of them or its window's (then the first split starts at the window)."""
    if WINDOWED:
        first = tl.maximum(seq_len - window, 0)
    else:
        first = 0
    start = first + split * split_len
    return start, tl.minimum(start + split_len, seq_len)


@triton.jit
def _decode_range(q_ptr, k_ptr, v_ptr, bt_ptr, sinks_ptr, s, kv_head, start, end, first_split, scale, stride_bt,
                  stride_qt, stride_qh, HKV: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, GROUP: tl.constexpr,
                  BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT: tl.constexpr,
                  IEEE: tl.constexpr, SINKS: tl.constexpr):
    """Decode sequence s (query row s), the GROUP query heads of kv_head together, over cached
    positions [start, end): each K/V tile is read once for the whole group. first_split: this
    range starts the sequence's (the one whose state holds the sink)."""
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    q_mask = (g[:, None] < GROUP) & (d[None, :] < D)
    q = tl.load(q_ptr + s * stride_qt + (kv_head * GROUP + g[:, None]) * stride_qh + d[None, :], mask=q_mask,
                other=0.0)
    # (a comparison, not `& first_split`: the interpreter makes a bool vector & bool scalar an int32)
    with_sink = g < tl.where(first_split, GROUP, 0)
    acc, m_i, l_i = _initial_state(sinks_ptr, kv_head * GROUP + g, with_sink, BLOCK_G, BLOCK_D, SINKS)
    for n0 in range(start, end, BLOCK_N):
        k, valid = _kv_tile(k_ptr, bt_ptr, s, kv_head, n0, end, stride_bt, HKV, D, PAGE, BLOCK_N, BLOCK_D)
        v, _ = _kv_tile(v_ptr, bt_ptr, s, kv_head, n0, end, stride_bt, HKV, D, PAGE, BLOCK_N, BLOCK_D)
        scores = tl.where(valid[None, :], _qk(q, k, scale, DOT, IEEE), float("-inf"))
        acc, m_i, l_i = _online_update(scores, v, acc, m_i, l_i, DOT, IEEE)
    return acc, m_i, l_i


@triton.jit
def _store_decode(out_ptr, part_out_ptr, part_lse_ptr, s, kv_head, split, num_splits, acc, m_i, l_i,
                  HQ: tl.constexpr, D: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
                  BLOCK_D: tl.constexpr):
    """A decode item's result: the output itself when its sequence is one split, else this
    split's normalised output and log-sum-exp for `_merge_kernel`."""
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + g
    mask = (g[:, None] < GROUP) & (d[None, :] < D)
    nonempty = l_i > 0  # a split past the sequence's end holds nothing (nor a sink: only split 0 does)
    l_safe = tl.where(nonempty, l_i, 1.0)
    out = acc / l_safe[:, None]
    if num_splits == 1:
        tl.store(out_ptr + (s * HQ + heads[:, None]) * D + d[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        row = (s * HQ + heads) * num_splits + split
        tl.store(part_out_ptr + row[:, None] * D + d[None, :], out, mask=mask)
        tl.store(part_lse_ptr + row, tl.where(nonempty, m_i + tl.log2(l_safe), float("-inf")), mask=g < GROUP)


@triton.jit(do_not_specialize=["stride_bt", "split_len", "num_splits", "window"])
def decode_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, lens_ptr, sinks_ptr, out_ptr, part_out_ptr, part_lse_ptr, scale,
                  stride_bt, stride_qt, stride_qh, split_len, num_splits, window, HQ: tl.constexpr,
                  HKV: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT: tl.constexpr, IEEE: tl.constexpr,
                  SINKS: tl.constexpr, WINDOWED: tl.constexpr):
    """Grid (sequence, kv head, split): split-KV decoding (flash-decoding's first step)."""
    s = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    start, end = _split_range(split, split_len, tl.load(lens_ptr + s), window, WINDOWED)
    acc, m_i, l_i = _decode_range(q_ptr, k_ptr, v_ptr, bt_ptr, sinks_ptr, s, kv_head, start, end, split == 0, scale,
                                  stride_bt, stride_qt, stride_qh, HKV, D, PAGE, GROUP, BLOCK_G, BLOCK_N, BLOCK_D,
                                  DOT, IEEE, SINKS)
    _store_decode(out_ptr, part_out_ptr, part_lse_ptr, s, kv_head, split, num_splits, acc, m_i, l_i, HQ, D, GROUP,
                  BLOCK_G, BLOCK_D)


@triton.jit(do_not_specialize=["num_splits"])
def merge_kernel(part_out_ptr, part_lse_ptr, out_ptr, num_splits, HQ: tl.constexpr, D: tl.constexpr,
                 MAX_SPLITS: tl.constexpr, BLOCK_D: tl.constexpr):
    """Grid (decode sequence, query head): the splits' outputs weighted by their log-sum-exps
    (flash-decoding's reduce)."""
    s = tl.program_id(0)
    head = tl.program_id(1)
    sp = tl.arange(0, MAX_SPLITS)
    d = tl.arange(0, BLOCK_D)
    base = (s * HQ + head) * num_splits
    lse = tl.load(part_lse_ptr + base + sp, mask=sp < num_splits, other=float("-inf"))
    part = tl.load(part_out_ptr + (base + sp[:, None]) * D + d[None, :],
                   mask=(sp[:, None] < num_splits) & (d[None, :] < D), other=0.0)
    w = tl.exp2(lse - tl.max(lse, axis=0))  # split 0 always holds the first tokens its query sees
    out = tl.sum(w[:, None] * part, axis=0) / tl.sum(w, axis=0)
    tl.store(out_ptr + (s * HQ + head) * D + d, out.to(out_ptr.dtype.element_ty), mask=d < D)


@triton.jit
def _prefill_tile(q_ptr, k_ptr, v_ptr, bt_ptr, lens_ptr, qstart_ptr, sinks_ptr, out_ptr, s, kv_head, tile_start,
                  scale, window, stride_bt, stride_qt, stride_qh, HQ: tl.constexpr, HKV: tl.constexpr,
                  D: tl.constexpr, PAGE: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr,
                  SINKS: tl.constexpr, WINDOWED: tl.constexpr):
    """Query tokens [tile_start, tile_start + BLOCK_M) of sequence s's chunk with all GROUP query
    heads of kv_head as one tile of BLOCK_M * GROUP_PAD rows (row r: token r // GROUP_PAD, head
    r % GROUP_PAD), so each K/V tile is read once for the group; causal over the cached prefix
    and the chunk (and within each query's window)."""
    seq_len = tl.load(lens_ptr + s)
    q_begin = tl.load(qstart_ptr + s)
    n = tl.load(qstart_ptr + s + 1) - q_begin
    r = tl.arange(0, BLOCK_M * GROUP_PAD)
    i = tile_start + r // GROUP_PAD
    g = r % GROUP_PAD
    live = (i < n) & (g < GROUP)
    q_pos = seq_len - n + i
    d = tl.arange(0, BLOCK_D)
    mask = live[:, None] & (d[None, :] < D)
    heads = kv_head * GROUP + g
    q = tl.load(q_ptr + (q_begin + i)[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=mask,
                other=0.0)
    acc, m_i, l_i = _initial_state(sinks_ptr, heads, g < GROUP, BLOCK_M * GROUP_PAD, BLOCK_D, SINKS)
    first = seq_len - n + tile_start  # position of the tile's first query
    kv_end = tl.minimum(seq_len, first + BLOCK_M)  # the tile's last query sees no further
    if WINDOWED:
        # From the first query's first visible key (never a block before it: those may be freed),
        # every tile masked: with gpt-oss's 128-token window every tile is at one edge or the other.
        for n0 in range(tl.maximum(first - window + 1, 0), kv_end, BLOCK_N):
            k, valid = _kv_tile(k_ptr, bt_ptr, s, kv_head, n0, seq_len, stride_bt, HKV, D, PAGE, BLOCK_N, BLOCK_D)
            v, _ = _kv_tile(v_ptr, bt_ptr, s, kv_head, n0, seq_len, stride_bt, HKV, D, PAGE, BLOCK_N, BLOCK_D)
            k_pos = n0 + tl.arange(0, BLOCK_N)
            seen = valid[None, :] & (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] > q_pos[:, None] - window)
            scores = tl.where(seen, _qk(q, k, scale, True, IEEE), float("-inf"))
            acc, m_i, l_i = _online_update(scores, v, acc, m_i, l_i, True, IEEE)
    else:
        full_end = (first + 1) // BLOCK_N * BLOCK_N  # K/V tiles every query of the tile sees whole
        for n0 in range(0, full_end, BLOCK_N):
            k, _ = _kv_tile(k_ptr, bt_ptr, s, kv_head, n0, seq_len, stride_bt, HKV, D, PAGE, BLOCK_N, BLOCK_D)
            v, _ = _kv_tile(v_ptr, bt_ptr, s, kv_head, n0, seq_len, stride_bt, HKV, D, PAGE, BLOCK_N, BLOCK_D)
            acc, m_i, l_i = _online_update(_qk(q, k, scale, True, IEEE), v, acc, m_i, l_i, True, IEEE)
        for n0 in range(full_end, kv_end, BLOCK_N):  # the diagonal: masked causally
            k, valid = _kv_tile(k_ptr, bt_ptr, s, kv_head, n0, seq_len, stride_bt, HKV, D, PAGE, BLOCK_N, BLOCK_D)
            v, _ = _kv_tile(v_ptr, bt_ptr, s, kv_head, n0, seq_len, stride_bt, HKV, D, PAGE, BLOCK_N, BLOCK_D)
            k_pos = n0 + tl.arange(0, BLOCK_N)
            seen = valid[None, :] & (k_pos[None, :] <= q_pos[:, None])
            scores = tl.where(seen, _qk(q, k, scale, True, IEEE), float("-inf"))
            acc, m_i, l_i = _online_update(scores, v, acc, m_i, l_i, True, IEEE)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + ((q_begin + i) * HQ + heads)[:, None] * D + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=mask)


@triton.jit(do_not_specialize=["stride_bt", "window"])
def prefill_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, lens_ptr, qstart_ptr, tile_seq_ptr, tile_start_ptr, sinks_ptr,
                   out_ptr, scale, window, stride_bt, stride_qt, stride_qh, HQ: tl.constexpr, HKV: tl.constexpr,
                   D: tl.constexpr, PAGE: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr,
                   SINKS: tl.constexpr, WINDOWED: tl.constexpr):
    """Grid (tile, kv head): one prefill tile of one group of query heads each."""
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    s = tl.load(tile_seq_ptr + tile)
    start = tl.load(tile_start_ptr + tile)
    _prefill_tile(q_ptr, k_ptr, v_ptr, bt_ptr, lens_ptr, qstart_ptr, sinks_ptr, out_ptr, s, kv_head, start, scale,
                  window, stride_bt, stride_qt, stride_qh, HQ, HKV, D, PAGE, GROUP, GROUP_PAD, BLOCK_M, BLOCK_N,
                  BLOCK_D, IEEE, SINKS, WINDOWED)


@triton.jit
def _sm_id(pid, NUM_SMS: tl.constexpr, USE_SMID: tl.constexpr):
    """The SM this program runs on, folded into [0, NUM_SMS): it indexes NUM_SMS counters, and
    %smid is not guaranteed below the SM count (SM ids need not be contiguous). Where %smid
    cannot be read (the interpreter) the program id stands in for it."""
    if USE_SMID:
        sm = cuda_extra.smid().to(tl.uint32, bitcast=True)
    else:
        sm = pid.to(tl.uint32)
    return (sm % NUM_SMS).to(tl.int32)


@triton.jit(do_not_specialize=["num_prefill_items", "num_decode_items", "num_splits", "split_len", "prefill_share",
                               "decode_share", "stride_bt", "window"])
def pod_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, lens_ptr, qstart_ptr, tile_seq_ptr, tile_start_ptr, sinks_ptr, out_ptr,
               part_out_ptr, part_lse_ptr, counters_ptr, num_prefill_items, num_decode_items, num_splits, split_len,
               prefill_share, decode_share, scale, window, stride_bt, stride_qt, stride_qh, HQ: tl.constexpr,
               HKV: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
               NUM_SMS: tl.constexpr, USE_SMID: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               DECODE_G: tl.constexpr, DECODE_N: tl.constexpr, DECODE_DOT: tl.constexpr, BLOCK_D: tl.constexpr,
               IEEE: tl.constexpr, SINKS: tl.constexpr, WINDOWED: tl.constexpr):
    """One program, one work item. Prefill items are (prefill tile, kv head); decode items are
    (decode sequence, kv head, KV split), the decodes being the batch's first sequences.
    counters_ptr holds NUM_SMS arrival counters, then the prefill and the decode ticket.

    A program's k-th arrival on its SM prefers prefill when k falls in the prefill share of the
    cycle prefill_share + decode_share; it takes a ticket of its preferred kind, or of the other
    kind once that is exhausted. There are exactly as many programs as items, so every item is
    done once. The shares are runtime arguments: a new ratio does not recompile."""
    pid = tl.program_id(0)
    sm = _sm_id(pid, NUM_SMS, USE_SMID)
    arrival = tl.atomic_add(counters_ptr + sm, 1)
    prefer_prefill = (arrival % (prefill_share + decode_share)) < prefill_share
    kind = tl.where(prefer_prefill, 0, 1)  # 0: prefill, 1: decode
    ticket = tl.atomic_add(counters_ptr + NUM_SMS + kind, 1)
    limit = tl.where(prefer_prefill, num_prefill_items, num_decode_items)
    if ticket >= limit:  # this kind is used up: the other kind has an item left for this program
        kind = 1 - kind
        ticket = tl.atomic_add(counters_ptr + NUM_SMS + kind, 1)
    if kind == 0:
        tile = ticket // HKV
        s = tl.load(tile_seq_ptr + tile)
        start = tl.load(tile_start_ptr + tile)
        _prefill_tile(q_ptr, k_ptr, v_ptr, bt_ptr, lens_ptr, qstart_ptr, sinks_ptr, out_ptr, s, ticket % HKV, start,
                      scale, window, stride_bt, stride_qt, stride_qh, HQ, HKV, D, PAGE, GROUP, GROUP_PAD, BLOCK_M,
                      BLOCK_N, BLOCK_D, IEEE, SINKS, WINDOWED)
    else:
        s = ticket // (HKV * num_splits)
        kv_head = ticket // num_splits % HKV
        split = ticket % num_splits
        start, end = _split_range(split, split_len, tl.load(lens_ptr + s), window, WINDOWED)
        acc, m_i, l_i = _decode_range(q_ptr, k_ptr, v_ptr, bt_ptr, sinks_ptr, s, kv_head, start, end, split == 0,
                                      scale, stride_bt, stride_qt, stride_qh, HKV, D, PAGE, GROUP, DECODE_G, DECODE_N,
                                      BLOCK_D, DECODE_DOT, IEEE, SINKS)
        _store_decode(out_ptr, part_out_ptr, part_lse_ptr, s, kv_head, split, num_splits, acc, m_i, l_i, HQ, D,
                      GROUP, DECODE_G, BLOCK_D)
