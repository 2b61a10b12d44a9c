"""Torch reference of paged attention over a hybrid batch (decodes and prefill chunks).

Layout (shared with the Triton kernels of the kernels issue):
  query        [T, Hq, D]    the step's query tokens, sequence after sequence
  key_cache    [num_blocks, block_size, Hkv, D]   (value_cache the same)
  block_tables [S, max_blocks] int   block ids of each sequence, in order
  seq_lens     [S] int        tokens of each sequence in the cache, this step's included
  query_start_loc [S+1] int   offsets of each sequence's queries in `query`
The first `num_single` sequences have exactly one query token (decodes); the rest are
prefill chunks whose queries are the last tokens of their sequence, attending causally.

Two variants (gpt-oss), for every entry point:
  sinks   None, or float32 [Hq]: one logit per query head that joins each softmax's
          denominator and contributes no value: out = sum_j e^(s_j - m) v_j /
          (sum_j e^(s_j - m) + e^(sink - m)), s_j = scale * q.k_j, m = max(s_j..., sink)
          (the scale is not applied to the sink).
  window  0, or W > 0: the query at position i sees keys j with i - W < j <= i (W keys, itself
          included: transformers' sliding-window causal mask). Block-table entries of blocks
          wholly before the window of a sequence's first query this step may hold a placeholder
          (the scheduler frees them): nothing here gathers them.
The plain case (no sinks, no window) keeps torch's SDPA paths; SDPA has no sink term, so with
sinks the softmax is written out (as transformers' eager gpt-oss attention is).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F


@dataclass
class PagedAttentionBatch:
    block_tables: torch.Tensor  # [S, max_blocks] int32
    seq_lens: torch.Tensor  # [S] int32: cached tokens per sequence after this step's write
    query_start_loc: torch.Tensor  # [S+1] int32
    slot_mapping: torch.Tensor  # [T] int64: flat cache slot (block * block_size + offset) of each query token
    num_single: int  # leading sequences with one query token
    # The same lengths on the host, so the reference needs no device-to-host syncs.
    seq_lens_host: list[int]
    query_start_host: list[int]
    # What kernels derive from the host lists above (launch plans, shape buckets), kept so every
    # layer of the step reuses it; not part of the batch's value.
    derived: dict[Hashable, Any] = field(default_factory=dict, repr=False, compare=False)
    # The same step through the sequences' window tables, for a model's sliding-window layers
    # (gpt-oss): its own block tables and slot mapping, the lengths shared; None without them.
    window_batch: "PagedAttentionBatch | None" = None

    @classmethod
    def of(cls, block_tables: torch.Tensor, lens: list[int], chunks: list[int]) -> "PagedAttentionBatch":
        """Sequences of `lens` cached tokens (after the write) computing their last `chunks[s]`
        tokens, one-token chunks first, on `block_tables`' device (slot mapping left at zero:
        for calls that write nothing to the cache)."""
        starts = [0]
        for n in chunks:
            starts.append(starts[-1] + n)
        device = block_tables.device
        return cls(block_tables, torch.tensor(lens, dtype=torch.int32, device=device),
                   torch.tensor(starts, dtype=torch.int32, device=device),
                   torch.zeros(starts[-1], dtype=torch.int64, device=device), sum(1 for n in chunks if n == 1),
                   list(lens), starts)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)

    def memo(self, key: Hashable, build: Callable[[], Any]) -> Any:
        """build() on the first call with `key`, its result afterwards."""
        if key not in self.derived:
            self.derived[key] = build()
        return self.derived[key]


def store_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write each token's K and V ([T, Hkv, D]) into its cache slot."""
    num_kv_heads, head_dim = key_cache.shape[-2:]
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)


# Gathered keys/values land in reused scratch buffers (one per thread, device, dtype and
# K/V): fresh multi-megabyte allocations each call cost more in page faults than the copy.
_scratch = threading.local()


def _gather(cache: torch.Tensor, block_tables: torch.Tensor, slot: int) -> torch.Tensor:
    """[S, nb] block ids -> [S, Hkv, nb * block_size, D] keys or values (a strided view)."""
    s, nb = block_tables.shape
    block_size, num_kv_heads, head_dim = cache.shape[1:]
    numel = s * nb * block_size * num_kv_heads * head_dim
    buffers = _scratch.__dict__.setdefault("buffers", {})
    # Inference-mode tensors cannot be written outside inference mode (nor the reverse), so
    # each mode keeps its own buffers.
    key = (cache.device, cache.dtype, slot, torch.is_inference_mode_enabled())
    buf = buffers.get(key)
    if buf is None or buf.numel() < numel:
        buf = buffers[key] = torch.empty(numel, dtype=cache.dtype, device=cache.device)
    out = buf[:numel].view(s * nb, block_size, num_kv_heads, head_dim)
    torch.index_select(cache, 0, block_tables.reshape(-1), out=out)
    return out.view(s, nb * block_size, num_kv_heads, head_dim).transpose(1, 2)


def release_scratch() -> None:
    """Frees this thread's gather buffers (after a node's warm-up timed the references at large
    shapes: what serving needs is regrown on use)."""
    _scratch.__dict__.pop("buffers", None)


def first_block(seq_len: int, queries: int, window: int, page: int) -> int:
    """The first block a sequence of `seq_len` tokens reads for its last `queries` tokens: 0, or
    with a window the block of its first query's first visible key (the blocks before hold
    nothing any of its queries sees, and may be placeholders)."""
    return max(0, seq_len - queries - window + 1) // page if window else 0


def gather_bytes(key_cache: torch.Tensor, batch: PagedAttentionBatch, window: int = 0) -> int:
    """What the reference's gather of `batch`'s pages takes (keys and values), in bytes."""
    page, kv_heads, head_dim = key_cache.shape[1:]
    starts = batch.query_start_host
    pages = max((-(-n // page) - first_block(n, b - a, window, page)
                 for n, a, b in zip(batch.seq_lens_host, starts, starts[1:])), default=0)
    return 2 * batch.num_seqs * pages * page * kv_heads * head_dim * key_cache.element_size()


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    batch: PagedAttentionBatch, scale: float, sinks: torch.Tensor | None = None,
                    window: int = 0) -> torch.Tensor:
    """Attention of every query token over its sequence's cached keys -> [T, Hq, D]."""
    out = torch.empty_like(query)
    d = batch.num_single
    if d:
        out[:d] = _decode(query[:d], key_cache, value_cache, batch.block_tables[:d], batch.seq_lens[:d],
                          batch.seq_lens_host[:d], scale, sinks, window)
    if d < batch.num_seqs:
        starts = batch.query_start_host
        out[starts[d]:] = _prefill(query[starts[d]:], key_cache, value_cache, batch.block_tables[d:],
                                   batch.seq_lens_host[d:], [q - starts[d] for q in starts[d:]], scale, sinks, window)
    return out


def decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                     sinks: torch.Tensor | None = None, window: int = 0) -> torch.Tensor:
    """One query token per sequence ([S, Hq, D]) over its cached keys."""
    if not query.shape[0]:
        return torch.empty_like(query)
    return _decode(query, key_cache, value_cache, block_tables, seq_lens, seq_lens.tolist(), scale, sinks, window)


def prefill_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_host: list[int],
                      scale: float, sinks: torch.Tensor | None = None, window: int = 0) -> torch.Tensor:
    """Each sequence's chunk of new queries (its last tokens) attending causally to its cache."""
    if len(query_start_host) < 2:
        return torch.empty_like(query)
    return _prefill(query, key_cache, value_cache, block_tables, seq_lens.tolist(), query_start_host, scale, sinks,
                    window)


def _decode(query, key_cache, value_cache, block_tables, seq_lens, lens: list[int], scale: float, sinks,
            window: int) -> torch.Tensor:
    """All decodes at once: gather just the blocks the longest of them needs (with a window, the
    longest window's worth, from each sequence's own first block)."""
    d, num_heads, head_dim = query.shape
    page = key_cache.shape[1]
    if window:
        first = (seq_lens.long() - window).clamp_(min=0) // page  # each one's first block: as first_block's
        nb = max(-(-n // page) - first_block(n, 1, window, page) for n in lens)
        # Entries past a table's width are past its sequence's end too: clamped, then masked.
        blocks = (first[:, None] + torch.arange(nb, device=query.device)).clamp_(max=block_tables.shape[1] - 1)
        tables = block_tables.gather(1, blocks)
        pos = first[:, None] * page + torch.arange(nb * page, device=query.device)
        mask = (pos < seq_lens[:, None]) & (pos >= seq_lens[:, None] - window)
    else:
        nb = -(-max(lens) // page)
        tables = block_tables[:, :nb]
        mask = torch.arange(nb * page, device=query.device)[None, :] < seq_lens[:, None]
    k = _gather(key_cache, tables, 0)
    v = _gather(value_cache, tables, 1)
    q = query.view(d, num_heads, 1, head_dim)
    return _attend(q, k, v, mask[:, None, None, :], scale, sinks).view(d, num_heads, head_dim)


def _prefill(query, key_cache, value_cache, block_tables, lens: list[int], starts: list[int], scale: float,
             sinks, window: int) -> torch.Tensor:
    """Sequence by sequence: queries [starts[s], starts[s+1]) are the last tokens of sequence s."""
    out = torch.empty_like(query)
    page = key_cache.shape[1]
    for s in range(len(lens)):
        q_start, q_end, seq_len = starts[s], starts[s + 1], lens[s]
        n = q_end - q_start
        if n == 0:
            continue
        first = first_block(seq_len, n, window, page)
        skipped = first * page  # positions before the gathered blocks
        nb = -(-seq_len // page)
        k = _gather(key_cache, block_tables[s:s + 1, first:nb], 0)[:, :, :seq_len - skipped]
        v = _gather(value_cache, block_tables[s:s + 1, first:nb], 1)[:, :, :seq_len - skipped]
        q = query[q_start:q_end].transpose(0, 1)[None]
        if sinks is None and not window and n == seq_len:
            # A whole prompt: plain causal attention, which lets SDPA take its flash path and
            # skip the masked half (2x faster than an explicit mask at 1-2K tokens on the CPU).
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        else:
            # Query i sits at position seq_len - n + i and sees keys up to there (and, with a
            # window, after its window's start).
            q_pos = torch.arange(seq_len - n, seq_len, device=query.device)[:, None]
            k_pos = torch.arange(skipped, seq_len, device=query.device)[None, :]
            mask = k_pos <= q_pos
            if window:
                mask &= k_pos > q_pos - window
            o = _attend(q, k, v, mask, scale, sinks)
        out[q_start:q_end] = o[0].transpose(0, 1)
    return out


# With sinks the softmax is written out; its float32 scores are computed for as many query rows
# at a time as fit this many bytes (a whole 8K prompt's, at 64 heads, would take 16 GiB).
SCORE_BYTES = 256 << 20


def _attend(q, k, v, mask, scale: float, sinks) -> torch.Tensor:
    """q [B, Hq, n, D] over k, v [B, Hkv, L, D] where `mask` ([B or 1, 1, n, L] or [n, L]) holds:
    SDPA without sinks; with them, as transformers' eager gpt-oss attention computes it."""
    if sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    b, hq, n, d = q.shape
    hkv, length = k.shape[1], k.shape[2]
    group = hq // hkv
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    rows = max(1, SCORE_BYTES // (4 * b * hq * max(length, 1)))
    sink = sinks.to(device=q.device, dtype=torch.float32).view(1, hq, 1, 1)
    for a in range(0, n, rows):
        r = min(rows, n - a)
        # A group's query heads as rows of its kv head's matmul: query head h reads kv head
        # h // group, and the keys are not repeated per head.
        qa = q[:, :, a:a + r].reshape(b, hkv, group * r, d)
        scores = (torch.matmul(qa, k.transpose(2, 3)).float() * scale).view(b, hq, r, length)
        scores = scores.masked_fill(~mask[..., a:a + r, :], float("-inf"))
        # The sink joins the softmax as one more column, dropped after: it weighs in the
        # denominator only and adds no value.
        probs = torch.cat([scores, sink.expand(b, hq, r, 1)], dim=-1).softmax(-1)[..., :-1]
        out[:, :, a:a + r] = torch.matmul(probs.to(v.dtype).reshape(b, hkv, group * r, length), v).view(b, hq, r, d)
    return out
