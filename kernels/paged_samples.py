"""Ground truth for the attention kernels, for their tests and the GPU check
(`megainfer.gpucheck`): random keys and values in shuffled pages, each sequence's keys back as
dense tensors, and float32 attention computed directly from them (with gpt-oss's sinks and
sliding window where asked)."""

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
        self.pages = self.block_tables.clone()  # each sequence's pages, whatever the tables come to hold

    def dense(self, s):
        """Sequence s's keys and values as plain [len, Hkv, D] tensors."""
        pos = torch.arange(self.lens[s], device=self.device)
        blocks = self.pages[s, pos // self.page].long()
        return self.k[blocks, pos % self.page], self.v[blocks, pos % self.page]

    def free_before_window(self, chunks, window, placeholder=0):
        """As a scheduler with this sliding window does: the block-table entries of blocks wholly
        before the window of each sequence's first query (of its last `chunks[s]` tokens) now
        hold `placeholder`. Returns how many entries were replaced."""
        freed = 0
        for s, (n, c) in enumerate(zip(self.lens, chunks)):
            first_visible = max(0, n - c - window + 1)
            self.block_tables[s, :first_visible // self.page] = placeholder
            freed += first_visible // self.page
        return freed


def dense_attention(q, k, v, scale, rows=256, sinks=None, window=0):
    """q [n, Hq, D] are the last n positions of a sequence whose keys are k [L, Hkv, D]:
    float32 causal attention, `rows` queries at a time (scores for 32K keys stay small).
    sinks [Hq]: a logit per head joining each softmax (a column dropped after it); window W:
    the query at position i sees keys i - W < j <= i."""
    n, hq, _ = q.shape
    length, hkv, _ = k.shape
    k, v = k.float().repeat_interleave(hq // hkv, 1), v.float().repeat_interleave(hq // hkv, 1)
    out = []
    for a in range(0, n, rows):
        qa = q[a:a + rows].float()
        scores = torch.einsum("nhd,lhd->hnl", qa, k) * scale
        q_pos = torch.arange(length - n + a, length - n + a + qa.shape[0], device=q.device)[:, None]
        k_pos = torch.arange(length, device=q.device)[None, :]
        visible = (k_pos <= q_pos) & (k_pos > q_pos - window) if window else k_pos <= q_pos
        scores = scores.masked_fill(~visible, float("-inf"))
        if sinks is not None:
            scores = torch.cat([scores, sinks.float()[:, None, None].expand(hq, qa.shape[0], 1)], dim=-1)
        out.append(torch.einsum("hnl,lhd->nhd", scores.softmax(-1)[..., :length], v))
    return torch.cat(out)


def expected(cache, q, starts, scale, sinks=None, window=0):
    """float32 attention of every sequence's queries q[starts[s]:starts[s + 1]]."""
    return torch.cat([dense_attention(q[starts[s]:starts[s + 1]], *cache.dense(s), scale, sinks=sinks, window=window)
                      for s in range(len(cache.lens)) if starts[s + 1] > starts[s]])


def batch_of(cache, chunks):
    """(a PagedAttentionBatch for sequences computing `chunks[s]` new tokens (ones first), the
    query start offsets)."""
    batch = PagedAttentionBatch.of(cache.block_tables, cache.lens, chunks)
    return batch, batch.query_start_host
