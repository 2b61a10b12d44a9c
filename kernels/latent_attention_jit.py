"""The Triton programs of latent attention (DeepSeek's MLA, absorbed); `latent_attention_triton`
plans and launches them.

Layouts as in `latent_attention_ref`: query [T, H, RANK + ROPE] with strides (stride_qt,
stride_qh, 1); cache [num_blocks, PAGE, 1, RANK + ROPE] contiguous; out [T, H, RANK]
contiguous; block_tables [S, max_blocks], rows stride_bt apart; seq_lens [S];
query_start_loc [S+1]. Every head reads the same cached [c | k_r], so a program stacks
(token, head) pairs as the rows of one tile and reads each cache tile once for all of them,
as FlashMLA does with a token's heads. Where the generic kernels (attention_jit) hold one
head's whole width as the tile's inner dimension and its output, here the score is split in two
products, the latent's (RANK wide) and the rotary part's (ROPE wide), and the value tile is the
latent part of the same cache tile: nothing is loaded twice, and no [*, 1024] tile of a
power-of-two-padded 576-wide head is ever formed.

Softmax in base 2 and split-KV partials as in attention_jit (its `merge_kernel` reduces them:
part_out [S_decode, H, splits, RANK] float32, part_lse [S_decode, H, splits]).
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.attention_jit import _online_update, _qk


@triton.jit
def _latent_rows(q_ptr, cache_ptr, bt_ptr, s, tokens, heads, live, q_pos, start, end, scale, stride_bt, stride_qt,
                 stride_qh, RANK: tl.constexpr, ROPE: tl.constexpr, PAGE: tl.constexpr, BLOCK_R: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_P: tl.constexpr, CAUSAL: tl.constexpr,
                 IEEE: tl.constexpr):
    """Rows (query token `tokens[r]`, head `heads[r]`, where `live`) of sequence s over its cached
    positions [start, end), each row seeing keys up to its position q_pos[r] when CAUSAL: the
    online softmax's state (acc [BLOCK_R, BLOCK_C], m_i, l_i)."""
    c_idx = tl.arange(0, BLOCK_C)
    p_idx = tl.arange(0, BLOCK_P)
    q_rows = q_ptr + tokens[:, None] * stride_qt + heads[:, None] * stride_qh
    q_c = tl.load(q_rows + c_idx[None, :], mask=live[:, None] & (c_idx[None, :] < RANK), other=0.0)
    q_r = tl.load(q_rows + RANK + p_idx[None, :], mask=live[:, None] & (p_idx[None, :] < ROPE), other=0.0)
    acc = tl.zeros([BLOCK_R, BLOCK_C], tl.float32)
    m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_R], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        valid = pos < end
        block = tl.load(bt_ptr + s * stride_bt + pos // PAGE, mask=valid, other=0).to(tl.int64)
        entry = cache_ptr + (block * PAGE + pos % PAGE)[:, None] * (RANK + ROPE)
        c = tl.load(entry + c_idx[None, :], mask=valid[:, None] & (c_idx[None, :] < RANK), other=0.0)
        k_r = tl.load(entry + RANK + p_idx[None, :], mask=valid[:, None] & (p_idx[None, :] < ROPE), other=0.0)
        scores = _qk(q_c, c, scale, True, IEEE) + _qk(q_r, k_r, scale, True, IEEE)
        seen = valid[None, :]
        if CAUSAL:
            seen = seen & (pos[None, :] <= q_pos[:, None])
        scores = tl.where(seen, scores, float("-inf"))
        acc, m_i, l_i = _online_update(scores, c, acc, m_i, l_i, True, IEEE)
    return acc, m_i, l_i


@triton.jit(do_not_specialize=["stride_bt", "split_len", "num_splits"])
def latent_decode_kernel(q_ptr, cache_ptr, bt_ptr, lens_ptr, out_ptr, part_out_ptr, part_lse_ptr, scale, stride_bt,
                         stride_qt, stride_qh, split_len, num_splits, H: tl.constexpr, RANK: tl.constexpr,
                         ROPE: tl.constexpr, PAGE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_C: tl.constexpr, BLOCK_P: tl.constexpr, IEEE: tl.constexpr):
    """Grid (decode sequence, block of BLOCK_H heads, KV split): the sequence's one query token,
    BLOCK_H of its heads as the tile's rows, over one split of its cache."""
    s = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    live = heads < H
    seq_len = tl.load(lens_ptr + s)
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)
    tokens = tl.zeros([BLOCK_H], tl.int32) + s  # decodes lead the batch: sequence s's query is token s
    acc, m_i, l_i = _latent_rows(q_ptr, cache_ptr, bt_ptr, s, tokens, heads, live, tokens, start, end, scale,
                                 stride_bt, stride_qt, stride_qh, RANK, ROPE, PAGE, BLOCK_H, BLOCK_N, BLOCK_C,
                                 BLOCK_P, False, IEEE)
    c_idx = tl.arange(0, BLOCK_C)
    mask = live[:, None] & (c_idx[None, :] < RANK)
    nonempty = l_i > 0  # a split past the sequence's end holds nothing
    l_safe = tl.where(nonempty, l_i, 1.0)
    out = acc / l_safe[:, None]
    if num_splits == 1:
        tl.store(out_ptr + (s * H + heads)[:, None] * RANK + c_idx[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=mask)
    else:
        row = (s * H + heads) * num_splits + split
        tl.store(part_out_ptr + row[:, None] * RANK + c_idx[None, :], out, mask=mask)
        tl.store(part_lse_ptr + row, tl.where(nonempty, m_i + tl.log2(l_safe), float("-inf")), mask=live)


@triton.jit(do_not_specialize=["stride_bt"])
def latent_prefill_kernel(q_ptr, cache_ptr, bt_ptr, lens_ptr, qstart_ptr, tile_seq_ptr, tile_start_ptr, out_ptr, scale,
                          stride_bt, stride_qt, stride_qh, H: tl.constexpr, RANK: tl.constexpr, ROPE: tl.constexpr,
                          PAGE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_C: tl.constexpr, BLOCK_P: tl.constexpr, IEEE: tl.constexpr):
    """Grid (prefill tile, block of BLOCK_H heads): query tokens [tile_start, tile_start + BLOCK_T)
    of a sequence's chunk times BLOCK_H heads as the rows (row r: token r // BLOCK_H, head
    r % BLOCK_H), causal over the cached prefix and the chunk."""
    tile = tl.program_id(0)
    s = tl.load(tile_seq_ptr + tile)
    tile_start = tl.load(tile_start_ptr + tile)
    r = tl.arange(0, BLOCK_T * BLOCK_H)
    i = tile_start + r // BLOCK_H
    heads = tl.program_id(1) * BLOCK_H + r % BLOCK_H
    seq_len = tl.load(lens_ptr + s)
    q_begin = tl.load(qstart_ptr + s)
    n = tl.load(qstart_ptr + s + 1) - q_begin
    live = (i < n) & (heads < H)
    q_pos = seq_len - n + i
    kv_end = tl.minimum(seq_len, seq_len - n + tile_start + BLOCK_T)  # the tile's last query sees no further
    acc, m_i, l_i = _latent_rows(q_ptr, cache_ptr, bt_ptr, s, q_begin + i, heads, live, q_pos, 0, kv_end, scale,
                                 stride_bt, stride_qt, stride_qh, RANK, ROPE, PAGE, BLOCK_T * BLOCK_H, BLOCK_N,
                                 BLOCK_C, BLOCK_P, True, IEEE)
    c_idx = tl.arange(0, BLOCK_C)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + ((q_begin + i) * H + heads)[:, None] * RANK + c_idx[None, :], out.to(out_ptr.dtype.element_ty),
             mask=live[:, None] & (c_idx[None, :] < RANK))
