"""Torch reference of multi-head latent attention (DeepSeek's MLA) in its absorbed form over a
paged latent cache: one multi-query attention whose keys are each cached token's [c | k_r] and
whose values are its latent c, the keys' first `rank` columns.

Layout (`latent_attention_triton` takes the same):
  query  [T, H, rank + rope]   each head's absorbed query, [W_UK^T q_nope | q_rot]
  cache  [num_blocks, page, 1, rank + rope]   [c | k_r] per token (`paged_attention_ref`'s
         layout with one kv head)
  batch  a `PagedAttentionBatch`: decodes first, then prefill chunks attending causally
-> [T, H, rank], the attention-weighted latents (the output projection W_UV applies after).
"""

from __future__ import annotations

import torch

from kernels.paged_attention_ref import PagedAttentionBatch, paged_attention


def latent_attention(query: torch.Tensor, cache: torch.Tensor, batch: PagedAttentionBatch, scale: float,
                     rank: int) -> torch.Tensor:
    """Paged attention with the cache as both keys and values, its output cut to the latent."""
    return paged_attention(query, cache, cache, batch, scale)[..., :rank]
