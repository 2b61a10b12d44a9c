"""Ground truth for the attention kernels, for their tests and the GPU check
(`megainfer.gpucheck`): random keys and values in shuffled pages, each sequence's keys back as
dense tensors, and float32 attention computed directly from them."""

from __future__ import annotations

import torch

from kernels.paged_attention_ref import PagedAttentionBatch


class PagedCache:
    """Random keys and values for sequences of given lengths, in shuffled pages."""

    def __init__(self, lens, page, hkv, d, dtype=torch.float32, seed=0, device="cpu"):
        g = torch.Generator(device=device).manual_seed(seed)
        self.lens, self.page, self.device = list(lens), page, torch.device(device)
        pages = [-(-n // page) for n in lens]
        num_blocks = sum(pages) + 3
        self.k = torch.randn(num_blocks, page, hkv, d, generator=g, device=device).to(dtype)
        self.v = torch.randn(num_blocks, page, hkv, d, generator=g, device=device).to(dtype)
        order = torch.randperm(num_blocks, generator=g, device=device)
        self.block_tables = torch.zeros(len(lens), max(pages + [1]), dtype=torch.int32, device=device)
        used = 0
        for s, n in enumerate(pages):
            self.block_tables[s, :n] = order[used:used + n]
            used += n
        self.seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)

    def dense(self, s):
        """Sequence s's keys and values as plain [len, Hkv, D] tensors."""
        pos = torch.arange(self.lens[s], device=self.device)
        blocks = self.block_tables[s, pos // self.page].long()
        return self.k[blocks, pos % self.page], self.v[blocks, pos % self.page]


def dense_attention(q, k, v, scale, rows=256):
    """q [n, Hq, D] are the last n positions of a sequence whose keys are k [L, Hkv, D]:
    float32 causal attention, `rows` queries at a time (scores for 32K keys stay small)."""
    n, hq, _ = q.shape
    length, hkv, _ = k.shape
    k, v = k.float().repeat_interleave(hq // hkv, 1), v.float().repeat_interleave(hq // hkv, 1)
    out = []
    for a in range(0, n, rows):
        qa = q[a:a + rows].float()
        scores = torch.einsum("nhd,lhd->hnl", qa, k) * scale
        q_pos = torch.arange(length - n + a, length - n + a + qa.shape[0], device=q.device)
        visible = torch.arange(length, device=q.device)[None, :] <= q_pos[:, None]
        out.append(torch.einsum("hnl,lhd->nhd", scores.masked_fill(~visible, float("-inf")).softmax(-1), v))
    return torch.cat(out)


def expected(cache, q, starts, scale):
    """float32 attention of every sequence's queries q[starts[s]:starts[s + 1]]."""
    return torch.cat([dense_attention(q[starts[s]:starts[s + 1]], *cache.dense(s), scale)
                      for s in range(len(cache.lens)) if starts[s + 1] > starts[s]])


def batch_of(cache, chunks):
    """(a PagedAttentionBatch for sequences computing `chunks[s]` new tokens (ones first), the
    query start offsets)."""
    batch = PagedAttentionBatch.of(cache.block_tables, cache.lens, chunks)
    return batch, batch.query_start_host
