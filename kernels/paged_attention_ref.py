"""Torch reference of paged attention over a hybrid batch (decodes and prefill chunks).

Layout (shared with the Triton kernels of the kernels issue):
  query        [T, Hq, D]    the step's query tokens, sequence after sequence
  key_cache    [num_blocks, block_size, Hkv, D]   (value_cache the same)
  block_tables [S, max_blocks] int   block ids of each sequence, in order
  seq_lens     [S] int        tokens of each sequence in the cache, this step's included
  query_start_loc [S+1] int   offsets of each sequence's queries in `query`
The first `num_single` sequences have exactly one query token (decodes); the rest are
prefill chunks whose queries are the last tokens of their sequence, attending causally.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)


def store_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write each token's K and V ([T, Hkv, D]) into its cache slot."""
    num_kv_heads, head_dim = key_cache.shape[-2:]
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)


def _gather(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """[S, nb] block ids -> [S, nb * block_size, Hkv, D] contiguous keys or values."""
    s, nb = block_tables.shape
    return cache[block_tables].reshape(s, nb * cache.shape[1], cache.shape[2], cache.shape[3])


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """q [S, Q, Hkv, G, D], k/v [S, L, Hkv, D], mask [S, Q, L] (True = attend) -> [S, Q, Hkv, G, D]."""
    scores = torch.einsum("sqhgd,slhd->shgql", q, k) * scale
    scores = scores.masked_fill(~mask[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.einsum("shgql,slhd->sqhgd", probs, v)


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    batch: PagedAttentionBatch, scale: float) -> torch.Tensor:
    """Attention of every query token over its sequence's cached keys -> [T, Hq, D]."""
    num_tokens, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(query)
    lens = batch.seq_lens_host
    starts = batch.query_start_host
    d = batch.num_single
    if d:
        # All decodes at once: gather just the blocks the longest of them needs.
        nb = -(-max(lens[:d]) // block_size)
        k = _gather(key_cache, batch.block_tables[:d, :nb])
        v = _gather(value_cache, batch.block_tables[:d, :nb])
        positions = torch.arange(nb * block_size, device=query.device)
        mask = (positions[None, :] < batch.seq_lens[:d, None])[:, None, :]
        q = query[:d].view(d, 1, num_kv_heads, group, head_dim)
        out[:d] = _attend(q, k, v, mask, scale).reshape(d, num_heads, head_dim)
    for s in range(d, batch.num_seqs):
        q_start, q_end, seq_len = starts[s], starts[s + 1], lens[s]
        n = q_end - q_start
        nb = -(-seq_len // block_size)
        k = _gather(key_cache, batch.block_tables[s:s + 1, :nb])[:, :seq_len]
        v = _gather(value_cache, batch.block_tables[s:s + 1, :nb])[:, :seq_len]
        # Query i sits at position seq_len - n + i and sees keys up to there.
        q_pos = torch.arange(seq_len - n, seq_len, device=query.device)
        mask = (torch.arange(seq_len, device=query.device)[None, :] <= q_pos[:, None])[None]
        q = query[q_start:q_end].view(1, n, num_kv_heads, group, head_dim)
        out[q_start:q_end] = _attend(q, k, v, mask, scale).reshape(n, num_heads, head_dim)
    return out
