"""Kernels: the Triton kernels against their torch references under Triton's interpreter
(small shapes: the interpreter is slow), the references against plain dense attention and
a per-expert loop, the tile table and launch plans, the dispatch point and its per-shape
choice, the kernels compiled for a GPU without one (ptxas), the benchmark's smoke run, and
the engine unchanged with the Triton kernels in. tests/kernels/conftest.py turns the
interpreter on for this session before anything imports a kernel."""

from __future__ import annotations

import inspect
import json
import logging
import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from kernels import attention_jit, attention_triton, dispatch, latent_attention_triton, moe_ref, moe_triton, tiles  # noqa: E402
from kernels import latent_attention_ref  # noqa: E402
from kernels import paged_attention_ref as attention_ref  # noqa: E402
from kernels.choice import REFERENCE, TRITON, KernelFailed, ShapeChoice, ShapeKey, bucket  # noqa: E402
from kernels.paged_samples import PagedCache, batch_of, expected  # noqa: E402
from tests.kernels.gpt_oss_experts import ALPHA, LIMIT, HFExperts, assert_clamp_binds  # noqa: E402

if not attention_triton.INTERPRETED:
    pytest.skip("this session compiles the Triton kernels for the GPU (-m gpu on a CUDA machine, or "
                "TRITON_INTERPRET set otherwise); the interpreter tests run in a session without -m gpu",
                allow_module_level=True)

TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
       torch.float16: dict(atol=2e-3, rtol=2e-3)}


# -- attention ----------------------------------------------------------------------------------
# GQA ratios 1, 4, 8, 4, 3 (padded to 4 rows), 16 (Qwen3's 64 query heads over 4 kv heads)
@pytest.mark.parametrize("hq, hkv", [(4, 4), (4, 1), (8, 1), (8, 2), (6, 2), (16, 1)])
@pytest.mark.parametrize("page", [1, 16])
def test_decode_kernel_matches_reference_and_dense(hq, hkv, page):
    lens = [1, 16, 37, 5]  # a single token, a sequence ending exactly on a 16-token block boundary
    cache = PagedCache(lens, page, hkv, 32)
    q = torch.randn(len(lens), hq, 32)
    want = expected(cache, q, list(range(len(lens) + 1)), 0.2)
    ref = attention_ref.decode_attention(q, cache.k, cache.v, cache.block_tables, cache.seq_lens, 0.2)
    torch.testing.assert_close(ref, want, **TOL[torch.float32])
    for splits in (None, 3):  # split-KV with a merge, including splits that hold nothing for short sequences
        out = attention_triton.decode_attention(q, cache.k, cache.v, cache.block_tables, cache.seq_lens, 0.2,
                                                num_splits=splits)
        torch.testing.assert_close(out, ref, **TOL[torch.float32])


@pytest.mark.parametrize("hq, hkv, page", [(4, 4, 16), (8, 2, 1), (8, 1, 16), (6, 2, 16), (16, 1, 16)])
def test_prefill_kernel_matches_reference_and_dense(hq, hkv, page):
    lens = [20, 16, 7, 33]
    chunks = [20, 5, 1, 17]  # a whole prompt, chunks after a cached prefix, a one-token chunk
    cache = PagedCache(lens, page, hkv, 16, seed=1)
    starts = [0]
    for n in chunks:
        starts.append(starts[-1] + n)
    q = torch.randn(starts[-1], hq, 16)
    want = expected(cache, q, starts, 0.3)
    ref = attention_ref.prefill_attention(q, cache.k, cache.v, cache.block_tables, cache.seq_lens, starts, 0.3)
    torch.testing.assert_close(ref, want, **TOL[torch.float32])
    out = attention_triton.prefill_attention(q, cache.k, cache.v, cache.block_tables, cache.seq_lens,
                                             torch.tensor(starts, dtype=torch.int32), starts, 0.3)
    torch.testing.assert_close(out, ref, **TOL[torch.float32])


# -- latent attention (DeepSeek's MLA, absorbed) -------------------------------------------------
def _latent_case(heads, rank, rope, page, lens, chunks, dtype=torch.float32, seed=1):
    """A [c | k_r] cache (the values are the keys' latent columns), its batch, random queries and
    the dense float32 answer cut to the latent."""
    cache = PagedCache(lens, page, 1, rank + rope, dtype=dtype, seed=seed)
    cache.v = cache.k
    batch, starts = batch_of(cache, chunks)
    q = torch.randn(starts[-1], heads, rank + rope, generator=torch.Generator().manual_seed(seed)).to(dtype)
    return cache, batch, q, expected(cache, q.float(), starts, 0.1)[..., :rank]


# Heads: fewer than a tile (padded rows), V2-Lite's 8 at TP 2, 16 (V3 at TP 8: one head block), 24 (a
# partial second block); latent widths 32, 48 (not a power of two) and 64; rope 8 and 16.
@pytest.mark.parametrize("heads, rank, rope, page", [(4, 32, 16, 16), (8, 48, 8, 1), (16, 64, 16, 4),
                                                     (24, 32, 8, 16)])
@pytest.mark.parametrize("chunks", [[1, 1, 1, 12, 30], [1, 1, 1], [9, 30]],
                         ids=["hybrid", "decode-only", "prefill-only"])
@pytest.mark.parametrize("splits", [None, 3], ids=["one-split", "3-splits"])
def test_latent_attention_kernel_matches_reference_and_dense(heads, rank, rope, page, chunks, splits):
    lens = [max(n, c) for n, c in zip([3, 16, 40, 12, 30], chunks)]  # a sequence ending on a 16-token page
    cache, batch, q, want = _latent_case(heads, rank, rope, page, lens, chunks)
    ref = latent_attention_ref.latent_attention(q, cache.k, batch, 0.1, rank)
    torch.testing.assert_close(ref, want, **TOL[torch.float32])
    out = latent_attention_triton.latent_attention(q, cache.k, batch.block_tables, batch.seq_lens,
                                                   batch.query_start_loc, batch.query_start_host, batch.num_single,
                                                   0.1, rank, num_splits=splits)
    assert out.shape == (q.shape[0], heads, rank)
    torch.testing.assert_close(out, ref, **TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads", [16, 40])
def test_latent_attention_kernel_in_half_precision_at_deepseeks_widths(dtype, heads):
    """V3's own widths (a 512-wide latent, 64 rotary dims); 16 heads as at TP 8 (decode tiles of 16),
    40 (decode tiles of 32, the second one partial)."""
    assert latent_attention_triton.latent_tiles(heads, 512, dtype).decode_h == (16 if heads < 32 else 32)
    cache, batch, q, want = _latent_case(heads, 512, 64, 16, [40, 7, 33], [1, 7, 12], dtype=dtype)
    out = latent_attention_triton.latent_attention(q, cache.k, batch.block_tables, batch.seq_lens,
                                                   batch.query_start_loc, batch.query_start_host, batch.num_single,
                                                   0.1, 512)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), want, **TOL[dtype])


def test_latent_attention_names_the_argument_it_cannot_read():
    cache, batch, q, _ = _latent_case(4, 32, 16, 16, [5], [1])
    args = (batch.block_tables, batch.seq_lens, batch.query_start_loc, batch.query_start_host, 1, 0.1)
    with pytest.raises(ValueError, match="rank: want 0 < rank < the query's width 48"):
        latent_attention_triton.latent_attention(q, cache.k, *args, 48)
    with pytest.raises(ValueError, match=r"cache: want a contiguous \[blocks, page, 1, 48\]"):
        latent_attention_triton.latent_attention(q, cache.k.expand(-1, -1, 2, -1).contiguous(), *args, 32)
    with pytest.raises(ValueError, match="cache: dtype torch.bfloat16 differs"):
        latent_attention_triton.latent_attention(q, cache.k.bfloat16(), *args, 32)


def test_dispatch_times_latent_attention_per_bucket_and_plans_it_once(monkeypatch):
    """On CUDA (FASTEST) the latent kernels are timed against the reference per bucket like every
    attention call; under MEGAINFER_KERNELS=triton a batch's plan is built once for all layers."""
    cache, batch, q, want = _latent_case(8, 32, 16, 16, [12, 30], [1, 30])
    monkeypatch.delenv(dispatch.ENV, raising=False)
    monkeypatch.setattr(dispatch, "backend", lambda device: dispatch.FASTEST)
    monkeypatch.setattr(dispatch, "_choice", ShapeChoice(timer=lambda fn, reps, warmup: (1.0, fn())))
    torch.testing.assert_close(dispatch.latent_attention(q, cache.k, batch, 0.1, 32), want, **TOL[torch.float32])
    (decision,) = dispatch.decisions()
    assert decision.op == "latent_attention" and decision.triton_ms is not None and decision.reference_ms is not None
    monkeypatch.undo()
    monkeypatch.setenv(dispatch.ENV, "triton")
    built = []
    plan_latent = latent_attention_triton.plan_latent
    monkeypatch.setattr(latent_attention_triton, "plan_latent", lambda *a, **k: built.append(1) or plan_latent(*a, **k))
    cache, batch, q, want = _latent_case(8, 32, 16, 16, [12, 30], [1, 30])
    for _ in range(3):  # three layers of one step
        torch.testing.assert_close(dispatch.latent_attention(q, cache.k, batch, 0.1, 32), want, **TOL[torch.float32])
    assert built == [1]


@pytest.mark.parametrize("chunks", [[1, 1, 1, 12, 30], [1, 1, 1], [9, 30], [1]],
                         ids=["hybrid", "decode-only", "prefill-only", "one-decode"])
@pytest.mark.parametrize("hq, hkv, page", [(4, 2, 16), (8, 1, 1), (6, 2, 16)])
@pytest.mark.parametrize("splits", [None, 3], ids=["one-split", "3-splits"])  # split-KV on the decode side
def test_pod_fused_kernel_matches_the_hybrid_reference(chunks, hq, hkv, page, splits):
    lens = [3, 16, 40, 12, 30][:len(chunks)]
    lens = [max(n, c) for n, c in zip(lens, chunks)]
    cache = PagedCache(lens, page, hkv, 16, seed=2)
    batch, starts = batch_of(cache, chunks)
    q = torch.randn(starts[-1], hq, 16)
    ref = attention_ref.paged_attention(q, cache.k, cache.v, batch, 0.25)
    torch.testing.assert_close(ref, expected(cache, q, starts, 0.25), **TOL[torch.float32])
    out = attention_triton.pod_attention(q, cache.k, cache.v, cache.block_tables, cache.seq_lens,
                                         batch.query_start_loc, starts, batch.num_single, 0.25, num_splits=splits)
    torch.testing.assert_close(out, ref, **TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_attention_kernels_in_half_precision(dtype):
    chunks = [1, 1, 14]
    cache = PagedCache([9, 16, 14], 16, 2, 32, dtype=dtype, seed=3)
    batch, starts = batch_of(cache, chunks)
    q = torch.randn(starts[-1], 4, 32).to(dtype)
    want = expected(cache, q, starts, 0.2).to(dtype)
    out = attention_triton.pod_attention(q, cache.k, cache.v, cache.block_tables, cache.seq_lens,
                                         batch.query_start_loc, starts, batch.num_single, 0.2)
    assert out.dtype == dtype
    torch.testing.assert_close(out, want, **TOL[dtype])


def test_query_may_be_a_strided_view():
    """The layer's query can be a view into a fused QKV projection: its strides go to the kernels."""
    cache = PagedCache([5, 20], 16, 2, 16, seed=4)
    batch, starts = batch_of(cache, [1, 19])
    qkv = torch.randn(starts[-1], 8, 16)
    q = qkv[:, :4]  # token stride 8 * 16, not 4 * 16
    assert not q.is_contiguous()
    ref = attention_ref.paged_attention(q.contiguous(), cache.k, cache.v, batch, 0.25)
    out = attention_triton.pod_attention(q, cache.k, cache.v, cache.block_tables, cache.seq_lens,
                                         batch.query_start_loc, starts, batch.num_single, 0.25)
    torch.testing.assert_close(out, ref, **TOL[torch.float32])
    out = attention_triton.decode_attention(q[:1], cache.k, cache.v, cache.block_tables[:1], cache.seq_lens[:1], 0.25)
    torch.testing.assert_close(out, ref[:1], **TOL[torch.float32])


def test_launchers_name_the_argument_they_cannot_read():
    cache = PagedCache([5], 16, 2, 16)
    q = torch.randn(1, 4, 16)
    with pytest.raises(ValueError, match="key_cache"):
        attention_triton.decode_attention(q, cache.k.transpose(1, 2), cache.v, cache.block_tables, cache.seq_lens, 1.0)
    with pytest.raises(ValueError, match="value_cache: dtype"):
        attention_triton.decode_attention(q, cache.k, cache.v.double(), cache.block_tables, cache.seq_lens, 1.0)
    with pytest.raises(ValueError, match="query: 3 heads"):
        attention_triton.decode_attention(q[:, :3], cache.k, cache.v, cache.block_tables, cache.seq_lens, 1.0)
    with pytest.raises(ValueError, match="block_tables"):
        attention_triton.decode_attention(q, cache.k, cache.v, cache.block_tables.repeat(1, 2)[:, ::2], cache.seq_lens,
                                          1.0)
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="w_down"):
        moe_triton.grouped_expert_gemm(x, [0, 4], torch.randn(1, 6, 8), torch.randn(1, 8, 4), torch.rand(4))
    with pytest.raises(ValueError, match="expert_offsets"):
        moe_triton.grouped_expert_gemm(x, [0, 2, 4], torch.randn(1, 6, 8), torch.randn(1, 8, 3), torch.rand(4))


def test_pod_work_split_shares_follow_the_items():
    assert attention_triton.shares(30, 0) == (1, 0) and attention_triton.shares(0, 5) == (0, 1)
    assert attention_triton.shares(10, 10) == (4, 4)
    assert attention_triton.shares(100, 1) == (7, 1)  # never starve a kind that has work


def test_step_varying_kernel_arguments_are_runtime_values():
    """Work shares, item counts and split sizes change every step: as constexprs each new value
    would compile a kernel while serving. They are plain arguments, kept out of Triton's
    specialisation on 1 and multiples of 16."""
    step_args = {"pod_kernel": ["num_prefill_items", "num_decode_items", "num_splits", "split_len", "prefill_share",
                                "decode_share", "stride_bt"],
                 "decode_kernel": ["stride_bt", "split_len", "num_splits"], "merge_kernel": ["num_splits"],
                 "prefill_kernel": ["stride_bt"]}
    for name, args in step_args.items():
        params = inspect.signature(getattr(attention_jit, name).fn).parameters
        source = inspect.getsource(getattr(attention_jit, name).fn)
        for arg in args:
            assert params[arg].annotation is inspect.Parameter.empty, (name, arg)
            assert f'"{arg}"' in source.split("def ")[0], f"{name}: {arg} is not in do_not_specialize"


def test_sm_ids_fold_into_the_counter_range():
    """Whatever id a program reports (on a GPU %smid, which need not be below the SM count), the
    counter it indexes is below NUM_SMS."""
    import triton
    import triton.language as tl

    @triton.jit
    def record(out_ptr, NUM_SMS: tl.constexpr):
        pid = tl.program_id(0)
        tl.store(out_ptr + pid, attention_jit._sm_id(pid, NUM_SMS, False))

    out = torch.full((10,), -1, dtype=torch.int32)
    record[(10,)](out, NUM_SMS=3)
    assert out.tolist() == [p % 3 for p in range(10)]


# -- gpt-oss's sinks and sliding window ----------------------------------------------------------
# A mixed batch: decodes over 1, 17, 45 and 70 tokens, a whole 40-token prompt, a 12-token chunk
# whose first query (position 48) is past every window tried, a 7-token chunk after 26 cached.
SW_LENS, SW_CHUNKS, SW_PAGE = [1, 17, 45, 70, 40, 60, 33], [1, 1, 1, 1, 40, 12, 7], 16
SW_DECODES = 4


class WindowCase:
    """Random pages for SW_LENS with block 0 owned by no sequence (the placeholder), block
    tables of 16-token pages, queries; `free(window)` writes the placeholder into the entries of
    blocks wholly before each sequence's first query's window, as the scheduler leaves them."""

    def __init__(self, hq, hkv, d=16, seed=0):
        g = torch.Generator().manual_seed(seed)
        pages = [-(-n // SW_PAGE) for n in SW_LENS]
        self.k = torch.randn(sum(pages) + 1, SW_PAGE, hkv, d, generator=g)
        self.v = torch.randn(sum(pages) + 1, SW_PAGE, hkv, d, generator=g)
        order = (torch.randperm(sum(pages), generator=g) + 1).tolist()  # block 0 is nobody's
        self.tables = [[order.pop() for _ in range(n)] for n in pages]
        self.block_tables = torch.tensor([t + [0] * (max(pages) - len(t)) for t in self.tables], dtype=torch.int32)
        self.batch = attention_ref.PagedAttentionBatch.of(self.block_tables, SW_LENS, SW_CHUNKS)
        self.starts = self.batch.query_start_host
        self.q = torch.randn(self.starts[-1], hq, d, generator=g)
        self.sinks = 2 * torch.randn(hq, generator=g)

    def free(self, window):
        freed = 0
        for s, (n, c) in enumerate(zip(SW_LENS, SW_CHUNKS)):
            blocks = max(0, n - c - window + 1) // SW_PAGE if window else 0
            self.block_tables[s, :blocks] = 0
            freed += blocks
        return freed

    def explicit(self, scale, sinks, window):
        """float64, per sequence, query and head: the scores of the keys it sees (causal, within
        the window), the sink appended as one more logit, softmax, the sink's column dropped."""
        hq, hkv = self.q.shape[1], self.k.shape[2]
        out = torch.zeros(self.q.shape, dtype=torch.float64)
        for s, (n, c) in enumerate(zip(SW_LENS, SW_CHUNKS)):
            pos = torch.arange(n)
            blocks = torch.tensor(self.tables[s])[pos // SW_PAGE]
            k, v = self.k[blocks, pos % SW_PAGE].double(), self.v[blocks, pos % SW_PAGE].double()
            for i in range(c):
                p, t = n - c + i, self.starts[s] + i
                seen = (pos <= p) & (pos > p - window) if window else pos <= p
                for h in range(hq):
                    scores = (k[:, h // (hq // hkv)] @ self.q[t, h].double()) * scale
                    scores = scores.masked_fill(~seen, float("-inf"))
                    if sinks is not None:
                        scores = torch.cat([scores, sinks[h:h + 1].double()])
                    out[t, h] = scores.softmax(0)[:n] @ v[:, h // (hq // hkv)]
        return out.float()

    def decode(self, impl, scale, sinks, window, **kw):
        d = SW_DECODES
        return impl.decode_attention(self.q[:d], self.k, self.v, self.block_tables[:d], self.batch.seq_lens[:d], scale,
                                     sinks=sinks, window=window, **kw)

    def prefill(self, impl, scale, sinks, window):
        d = SW_DECODES
        starts = [x - self.starts[d] for x in self.starts[d:]]
        loc = () if impl is attention_ref else (torch.tensor(starts, dtype=torch.int32),)
        return impl.prefill_attention(self.q[self.starts[d]:], self.k, self.v, self.block_tables[d:],
                                      self.batch.seq_lens[d:], *loc, starts, scale, sinks=sinks, window=window)


@pytest.mark.parametrize("window", [0, 5, 16, 40])
@pytest.mark.parametrize("with_sinks", [False, True], ids=["no-sinks", "sinks"])
@pytest.mark.parametrize("hq, hkv", [(4, 4), (8, 2)], ids=["mha", "gqa4"])
def test_reference_sinks_and_window_match_explicit_attention(hq, hkv, with_sinks, window):
    """The torch reference's decode, prefill (a whole prompt, a chunk past the window) and mixed
    batch against the explicit per-head softmax; unchanged when the block-table entries before
    each window hold a placeholder block, whatever that block holds (the reference may gather
    it, masked)."""
    case = WindowCase(hq, hkv, seed=window)
    sinks = case.sinks if with_sinks else None
    want = case.explicit(0.3, sinks, window)
    dense = expected(_as_paged_cache(case), case.q, case.starts, 0.3, sinks, window)  # the GPU check's ground truth
    torch.testing.assert_close(dense, want, **TOL[torch.float32])
    freed = case.free(window)
    assert freed == {0: 0, 5: 9, 16: 6, 40: 1}[window]  # the 70-token decode loses 4, 3, 1 of its 5 blocks
    got = [attention_ref.paged_attention(case.q, case.k, case.v, case.batch, 0.3, sinks, window),
           case.decode(attention_ref, 0.3, sinks, window), case.prefill(attention_ref, 0.3, sinks, window)]
    torch.testing.assert_close(got[0], want, **TOL[torch.float32])
    torch.testing.assert_close(torch.cat(got[1:]), want, **TOL[torch.float32])
    case.k[0], case.v[0] = 1e4 * torch.randn(case.k[0].shape), -1e4 * torch.randn(case.v[0].shape)
    assert torch.equal(attention_ref.paged_attention(case.q, case.k, case.v, case.batch, 0.3, sinks, window), got[0])
    assert torch.equal(case.decode(attention_ref, 0.3, sinks, window), got[1])
    assert torch.equal(case.prefill(attention_ref, 0.3, sinks, window), got[2])


def _as_paged_cache(case):
    """The case's pages and tables as a `paged_samples.PagedCache`."""
    cache = PagedCache(SW_LENS, SW_PAGE, case.k.shape[2], case.k.shape[3])
    cache.k, cache.v, cache.block_tables = case.k, case.v, case.block_tables.clone()
    cache.pages = cache.block_tables.clone()
    return cache


def _triton_sinks_window(hq, hkv, with_sinks, window):
    case = WindowCase(hq, hkv, seed=window)
    sinks = case.sinks if with_sinks else None
    want = case.explicit(0.3, sinks, window)
    case.free(window)
    case.k[0], case.v[0] = float("nan"), float("nan")  # read, a placeholder would poison the output

    def pod(splits):
        return attention_triton.pod_attention(case.q, case.k, case.v, case.block_tables, case.batch.seq_lens,
                                              case.batch.query_start_loc, case.starts, SW_DECODES, 0.3,
                                              num_splits=splits, sinks=sinks, window=window)

    for splits in (None, 3):
        torch.testing.assert_close(pod(splits), want, **TOL[torch.float32])
    d = case.starts[SW_DECODES]
    for splits in (None, 1, attention_triton.MAX_SPLITS):  # the sink folded in exactly once
        torch.testing.assert_close(case.decode(attention_triton, 0.3, sinks, window, num_splits=splits), want[:d],
                                   **TOL[torch.float32])
    torch.testing.assert_close(case.prefill(attention_triton, 0.3, sinks, window), want[d:], **TOL[torch.float32])


# Half of the grid runs by default (each case ~4 s in the interpreter), the rest with -m slow.
SLOW = pytest.mark.slow


@pytest.mark.parametrize("hq, hkv, with_sinks, window", [
    (4, 4, True, 0), (8, 2, False, 5), (4, 4, True, 16), (8, 2, True, 40),
    pytest.param(8, 2, True, 0, marks=SLOW), pytest.param(4, 4, False, 5, marks=SLOW),
    pytest.param(8, 2, True, 16, marks=SLOW), pytest.param(4, 4, True, 40, marks=SLOW)],
    ids=["mha-sinks", "gqa4-window-5", "mha-sinks-window-16", "gqa4-sinks-window-40", "gqa4-sinks", "mha-window-5",
         "gqa4-sinks-window-16", "mha-sinks-window-40"])
def test_triton_sinks_and_window_match_explicit_attention(hq, hkv, with_sinks, window):
    """The POD (split-KV on its decode side or not), decode (splits None, 1 and 16) and prefill
    kernels against the explicit softmax, the placeholder block full of NaN: no program reads a
    block before its queries' window."""
    _triton_sinks_window(hq, hkv, with_sinks, window)


@pytest.mark.slow
@pytest.mark.parametrize("with_sinks, window", [(False, 16), (True, 5), (False, 40)])
@pytest.mark.parametrize("hq, hkv", [(4, 4), (8, 2)], ids=["mha", "gqa4"])
def test_triton_sinks_and_window_the_rest_of_the_grid(hq, hkv, with_sinks, window):
    _triton_sinks_window(hq, hkv, with_sinks, window)


def test_windowed_decode_splits_cut_only_the_window():
    """A decode over 32K tokens is split several ways; in a 128-token window it is one split
    (MIN_SPLIT_LEN), and forced splits cover the window, not the context."""
    q = torch.randn(1, 8, 16)
    cache = torch.empty(1, 16, 2, 16)
    tables = torch.zeros(1, 2048, dtype=torch.int32)
    full = attention_triton.plan_pod(q, cache, tables, [0, 1], 1, 32768)
    windowed = attention_triton.plan_pod(q, cache, tables, [0, 1], 1, 32768, window=128)
    assert full.splits.count > 1 and full.splits.count * full.splits.length >= 32768
    assert windowed.splits.count == 1 and windowed.splits.length == 128 and windowed.window == 128
    forced = attention_triton.plan_pod(q, cache, tables, [0, 1], 1, 32768, num_splits=4, window=128)
    assert forced.splits.count == 4 and forced.splits.length == 32  # 16-position tiles in the interpreter
    case = WindowCase(4, 2)
    with pytest.raises(ValueError, match="plan: built for window 128"):
        attention_triton.pod_attention(case.q, case.k, case.v, case.block_tables, case.batch.seq_lens,
                                       case.batch.query_start_loc, case.starts, SW_DECODES, 0.3, window=0,
                                       plan=attention_triton.plan_pod(case.q, case.k, case.block_tables, case.starts,
                                                                      SW_DECODES, window=128))
    with pytest.raises(ValueError, match="sinks: want a contiguous float32"):
        case.decode(attention_triton, 0.3, case.sinks.double(), 0)
    with pytest.raises(ValueError, match="window: want an int"):
        case.decode(attention_triton, 0.3, None, -1)


def test_dispatch_keeps_the_sink_and_window_variants_apart(monkeypatch):
    """Each variant its own shape key (its own Triton build and timing) and its own POD plan of
    a batch (gpt-oss's sliding and full layers share a step's batch, their decode splits differ);
    the results those of the explicit softmax."""
    monkeypatch.delenv(dispatch.ENV, raising=False)
    monkeypatch.setattr(dispatch, "backend", lambda device: dispatch.FASTEST)
    monkeypatch.setattr(dispatch, "_choice", ShapeChoice(timer=lambda fn, reps, warmup: (1.0, fn())))
    case = WindowCase(8, 2, seed=3)
    for sinks, window in ((None, 0), (case.sinks, 16), (case.sinks, 0), (None, 16), (case.sinks, 16)):
        out = dispatch.paged_attention(case.q, case.k, case.v, case.batch, 0.3, sinks=sinks, window=window)
        torch.testing.assert_close(out, case.explicit(0.3, sinks, window), **TOL[torch.float32])
    keys = {str(k) for k in dispatch._choice.choices}
    assert len(keys) == 4 and any("sinks window=16" in k for k in keys), keys
    plans = [plan for key, plan in case.batch.derived.items() if key[0] == "pod"]
    assert len(plans) == 4 and sorted(plan.window for plan in plans) == [0, 0, 16, 16]


# -- tiles and plans ----------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("interpreted", [True, False])
def test_attention_tiles_fill_a_dot_for_every_group(dtype, interpreted):
    for group in (1, 2, 3, 4, 8, 16, 64):
        for d in (64, 128, 256):
            for fused in (False, True):
                for arch in (80, 90):
                    t = tiles.attention_tiles(d, group, dtype, interpreted, fused, arch)
                    assert t.block_m >= 1 and t.block_m * tiles.pow2(group) >= tiles.MIN_DOT
                    assert t.decode_dot == (group >= 4) and t.decode_rows(group) >= tiles.pow2(group)
                    assert not t.decode_dot or t.decode_rows(group) >= tiles.MIN_DOT
                    assert all(tiles.pow2(n) == n for n in (t.block_m, t.block_n, t.decode_n))


def test_gemm_tiles_grow_with_the_rows_per_expert():
    small, mid, large = (tiles.gemm_tiles(r, torch.bfloat16, False) for r in (4, 48, 1000))
    assert small.block_m < mid.block_m < large.block_m
    assert tiles.gemm_tiles(1000, torch.bfloat16, True) == tiles.gemm_tiles(4, torch.float32, True)  # one config


def test_prefill_plan_puts_each_chunks_last_tile_first():
    block_m = 4
    plan = attention_triton.plan_prefill([0, 1, 2, 12, 17], 2, block_m, torch.device("cpu"))
    assert plan.count == 5 and plan.block_m == block_m
    assert plan.seq.tolist() == [2, 2, 2, 3, 3] and plan.start.tolist() == [8, 4, 0, 4, 0]


def test_decode_splits_fill_the_sms_without_tiny_splits():
    plan = attention_triton.plan_splits
    assert plan(items=4, max_len=32768, block_n=64, num_sms=132).count == attention_triton.MAX_SPLITS
    assert plan(items=2000, max_len=32768, block_n=64, num_sms=132).count == 1  # already enough programs
    assert plan(items=4, max_len=300, block_n=64, num_sms=132).count == 2  # no split under MIN_SPLIT_LEN
    split = plan(items=4, max_len=1000, block_n=64, num_sms=132, num_splits=3)
    assert split.count == 3 and split.length % 64 == 0 and 3 * split.length >= 1000
    with pytest.raises(ValueError, match="num_splits"):
        plan(items=4, max_len=1000, block_n=64, num_sms=132, num_splits=attention_triton.MAX_SPLITS + 1)


def test_dispatch_plans_a_batch_once_for_every_layer(monkeypatch):
    monkeypatch.setenv(dispatch.ENV, "triton")
    built = []
    plan_pod = attention_triton.plan_pod
    monkeypatch.setattr(attention_triton, "plan_pod", lambda *a, **k: built.append(1) or plan_pod(*a, **k))
    cache = PagedCache([3, 16, 30], 16, 2, 16, seed=6)
    batch, starts = batch_of(cache, [1, 1, 12])
    q = torch.randn(starts[-1], 4, 16)
    ref = attention_ref.paged_attention(q, cache.k, cache.v, batch, 0.3)
    for _ in range(3):  # three layers of one step
        torch.testing.assert_close(dispatch.paged_attention(q, cache.k, cache.v, batch, 0.3), ref, **TOL[torch.float32])
    assert len(built) == 1


# -- the per-shape choice on a GPU ---------------------------------------------------------------
def fake_timer(times):
    """A timer that reports `times[label]` ms for a function returning label."""
    def timer(fn, reps, warmup):
        out = fn()
        return times[out], out
    return timer


def test_shape_choice_takes_the_faster_once_per_bucket(caplog):
    calls = []
    choice = ShapeChoice(timer=fake_timer({TRITON: 2.0, REFERENCE: 1.0}))

    def triton_fn():
        calls.append(TRITON)
        return TRITON

    def reference_fn():
        calls.append(REFERENCE)
        return REFERENCE

    small, large = ShapeKey("op", (), (8,)), ShapeKey("op", (), (16,))
    with caplog.at_level(logging.INFO, logger="kernels"):
        assert choice.run(small, triton_fn, reference_fn) == REFERENCE  # decided: the reference is faster
    assert "Triton 2.000 ms, torch reference 1.000 ms" in caplog.text
    calls.clear()
    assert choice.run(small, triton_fn, reference_fn) == REFERENCE and calls == [REFERENCE]  # no timing again
    choice.timer = fake_timer({TRITON: 0.5, REFERENCE: 1.0})
    assert choice.run(large, triton_fn, reference_fn) == TRITON  # another bucket, decided on its own
    assert choice.choices == {small: REFERENCE, large: TRITON}
    assert [(d.implementation, d.triton_ms, d.reference_ms) for d in choice.decisions.values()] == [
        (REFERENCE, 2.0, 1.0), (TRITON, 0.5, 1.0)]


def test_a_failing_triton_kernel_is_an_error_naming_the_shape_never_a_fallback():
    choice = ShapeChoice(timer=fake_timer({REFERENCE: 1.0}))

    def broken():
        raise RuntimeError("out of resources: shared memory")

    key = ShapeKey("grouped_expert_gemm", (torch.bfloat16, 8, 256, 64, 128), (64,), ("pairs",))
    with pytest.raises(KernelFailed, match=r"grouped_expert_gemm\[bfloat16 8 256 64 128; pairs=64\].*out of resources"):
        choice.run(key, broken, lambda: REFERENCE)
    with pytest.raises(KernelFailed, match="out of resources"):
        choice.fixed(key, broken, "rule")
    assert REFERENCE not in choice.choices.values()


def test_once_frozen_nothing_is_timed_and_new_shapes_take_the_nearest_decision():
    timed = []

    def timer(fn, reps, warmup):
        timed.append(fn)
        out = fn()
        return {TRITON: 1.0, REFERENCE: 2.0}[out] if len(timed) <= 2 else {TRITON: 2.0, REFERENCE: 1.0}[out], out

    choice = ShapeChoice(timer=timer)
    key = lambda n: ShapeKey("op", ("bf16",), (n, 4096))  # noqa: E731
    assert choice.run(key(16), lambda: TRITON, lambda: REFERENCE) == TRITON  # small: Triton faster
    assert choice.run(key(1024), lambda: TRITON, lambda: REFERENCE) == REFERENCE  # large: the reference faster
    choice.frozen = True  # serving
    timed.clear()
    assert choice.run(key(32), lambda: TRITON, lambda: REFERENCE) == TRITON  # nearest to 16
    assert choice.run(key(2048), lambda: TRITON, lambda: REFERENCE) == REFERENCE  # nearest to 1024
    other = ShapeKey("other", ("bf16",), (8,))
    assert choice.run(other, lambda: TRITON, lambda: REFERENCE) == TRITON  # nothing decided for its op: Triton
    assert not timed and choice.met_while_serving == 3


def test_buckets_round_up_to_powers_of_two():
    assert [bucket(n) for n in (0, 1, 2, 3, 4, 5, 1000, 1024, 1025)] == [0, 1, 2, 4, 4, 8, 1024, 1024, 2048]


def test_dispatch_times_each_bucket_where_it_picks_the_fastest(monkeypatch):
    """On CUDA `backend` answers FASTEST; here the backend and the timer stand in for a GPU's."""
    monkeypatch.delenv(dispatch.ENV, raising=False)
    monkeypatch.setattr(dispatch, "backend", lambda device: dispatch.FASTEST)
    timed = []

    def timer(fn, reps, warmup):
        timed.append(fn)
        return (0.5 if len(timed) == 1 else 1.0), fn()  # Triton is timed first, and wins

    monkeypatch.setattr(dispatch, "_choice", ShapeChoice(timer=timer))
    x = torch.randn(6, 8)
    w_gate_up, w_down, weights = torch.randn(2, 12, 8) * 0.1, torch.randn(2, 8, 6) * 0.1, torch.rand(6)
    out = dispatch.grouped_expert_gemm(x, [0, 2, 6], w_gate_up, w_down, weights)
    torch.testing.assert_close(out, moe_ref.grouped_expert_gemm(x, [0, 2, 6], w_gate_up, w_down, weights),
                               **TOL[torch.float32])
    assert dispatch._choice.choices == {
        ShapeKey("grouped_expert_gemm", (torch.float32, 2, 12, 8, 6), (8,), ("pairs",)): TRITON}


# -- MoE ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("experts, top_k, renormalize", [(8, 2, True), (16, 4, False), (6, 3, True)])
def test_fused_gating_matches_reference(experts, top_k, renormalize):
    g = torch.Generator().manual_seed(experts)
    logits = torch.randn(45, experts, generator=g)
    logits[3] = 0.25  # every expert tied: the lower ids win
    logits[7, :4] = 2.0  # a tie inside the top-k
    node = torch.arange(experts) % 3
    ref = moe_ref.fused_gating(logits, top_k, renormalize, node, 3)
    out = moe_triton.fused_gating(logits, top_k, renormalize, node, 3)
    assert ref.topk_ids[3].tolist() == list(range(top_k))
    assert torch.equal(out.topk_ids, ref.topk_ids)
    torch.testing.assert_close(out.topk_weights, ref.topk_weights)
    assert torch.equal(out.expert_counts, ref.expert_counts) and torch.equal(out.expert_offsets, ref.expert_offsets)
    assert torch.equal(out.node_counts, ref.node_counts) and torch.equal(out.node_offsets, ref.node_offsets)
    # Inside a segment the order is the atomics' order: compare segments as sets, and the inverse.
    flat = out.topk_ids.reshape(-1)
    off = out.expert_offsets.tolist()
    for e in range(experts):
        segment = out.pair_order[off[e]:off[e + 1]]
        assert (flat[segment] == e).all()
        assert sorted(segment.tolist()) == sorted(ref.pair_order[off[e]:off[e + 1]].tolist())
    assert torch.equal(out.pair_order[out.pair_positions], torch.arange(flat.numel()))
    node_off = out.node_offsets.tolist()
    for n in range(3):
        got = out.node_token_ids[node_off[n]:node_off[n + 1]]
        assert sorted(got.tolist()) == ref.node_token_ids[node_off[n]:node_off[n + 1]].tolist()
    # The reference itself: softmax, top-k, renormalise, as the model defines routing.
    probs = F.softmax(logits, dim=-1)
    rows = [i for i in range(45) if i not in (3, 7)]
    w, ids = torch.topk(probs[rows], top_k)
    assert torch.equal(ref.topk_ids[rows], ids)
    torch.testing.assert_close(ref.topk_weights[rows], w / w.sum(-1, keepdim=True) if renormalize else w)


@pytest.mark.parametrize("impl", [moe_ref, moe_triton], ids=["reference", "triton"])
def test_fused_gating_counts_and_sends_no_padding_row(impl):
    """A captured decode batch pads its rows up to the graph's size: rows at or past `valid` are
    routed (their ids exist) but counted for no expert and sent to no expert node, so the
    dispatch is exactly that of the live rows alone."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(24, 8, generator=g)
    node = torch.arange(8) % 3
    live = impl.fused_gating(logits[:17], 2, True, node, 3)
    padded = impl.fused_gating(logits, 2, True, node, 3, valid=torch.tensor([17], dtype=torch.int32))
    assert torch.equal(padded.topk_ids[:17], live.topk_ids)
    assert torch.equal(padded.expert_counts, live.expert_counts)
    assert torch.equal(padded.node_offsets, live.node_offsets)
    bounds = live.node_offsets.tolist()
    for n in range(3):
        got = padded.node_token_ids[bounds[n]:bounds[n + 1]].tolist()
        assert sorted(got) == sorted(live.node_token_ids[bounds[n]:bounds[n + 1]].tolist())
        assert max(got, default=0) < 17


@pytest.mark.parametrize("padded", [False, True])
def test_fused_gating_sends_each_pair_to_its_replica_slot(padded):
    """With a slot table, token t's pair with expert e goes to slot table[e, t % B] and on to
    that slot's node; Triton and the reference agree (slots, node counts, node tokens), the
    expert counts stay per expert, and a token reaching one node through two slots is sent once."""
    g = torch.Generator().manual_seed(9)
    experts, buckets, t = 8, moe_ref.REPLICA_BUCKETS, 150
    logits = torch.randn(t, experts, generator=g)
    # Slots 0..7 are the experts on nodes 0..3 (two each); slots 8, 9 replicate experts 0 and 5 on
    # nodes 3 and 0. Expert 0's rows alternate between slots 0 and 8, expert 5's take slot 9 a quarter.
    slot_node = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3, 3, 0])
    table = torch.arange(experts, dtype=torch.int32)[:, None].repeat(1, buckets)
    table[0, 1::2] = 8
    table[5, ::4] = 9
    valid = torch.tensor([140], dtype=torch.int32) if padded else None
    ref = moe_ref.fused_gating(logits, 2, True, slot_node, 4, valid, table)
    out = moe_triton.fused_gating(logits, 2, True, slot_node, 4, valid, table)
    rows = torch.arange(t) % buckets
    assert torch.equal(ref.topk_slots, table[ref.topk_ids, rows[:, None]].long())
    assert torch.equal(out.topk_slots, ref.topk_slots) and torch.equal(out.topk_ids, ref.topk_ids)
    assert {8, 9} <= set(ref.topk_slots.flatten().tolist())
    assert torch.equal(out.expert_counts, ref.expert_counts)
    assert torch.equal(out.node_counts, ref.node_counts) and torch.equal(out.node_offsets, ref.node_offsets)
    live = 140 if padded else t
    hits = slot_node[ref.topk_slots[:live]]
    assert ref.node_counts.tolist() == [int((hits == n).any(dim=1).sum()) for n in range(4)]
    bounds = ref.node_offsets.tolist()
    for n in range(4):
        got = out.node_token_ids[bounds[n]:bounds[n + 1]].tolist()
        assert sorted(got) == ref.node_token_ids[bounds[n]:bounds[n + 1]].tolist()
        assert len(set(got)) == len(got)


def test_fused_gating_of_no_tokens():
    for impl in (moe_ref, moe_triton):
        g = impl.fused_gating(torch.zeros(0, 8), 2, True, torch.zeros(8, dtype=torch.int64), 1)
        assert g.topk_ids.shape == (0, 2) and g.expert_counts.sum() == 0 and g.node_counts.tolist() == [0]


def _per_expert_loop(x, offsets, w_gate_up, w_down, row_weights):
    out = torch.zeros_like(x, dtype=torch.float32)
    inter = w_down.shape[2]
    for e in range(len(offsets) - 1):
        for r in range(offsets[e], offsets[e + 1]):
            h = w_gate_up[e].float() @ x[r].float()
            out[r] = row_weights[r] * (w_down[e].float() @ (F.silu(h[:inter]) * h[inter:]))
    return out


@pytest.mark.parametrize("offsets", [[0, 5, 5, 21, 40], [0, 0, 0, 3, 3], [0, 40, 40, 40, 40]],
                         ids=["mixed", "one-expert", "all-in-first"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_expert_gemm_matches_reference_and_loop(offsets, dtype):
    g = torch.Generator().manual_seed(5)
    h, inter = 48, 40  # not multiples of the tiles
    rows = offsets[-1]
    x = torch.randn(rows, h, generator=g).to(dtype)
    w_gate_up = (torch.randn(4, 2 * inter, h, generator=g) * 0.1).to(dtype)
    w_down = (torch.randn(4, h, inter, generator=g) * 0.1).to(dtype)
    row_weights = torch.rand(rows, generator=g)
    loop = _per_expert_loop(x, offsets, w_gate_up, w_down, row_weights).to(dtype)
    ref = moe_ref.grouped_expert_gemm(x, offsets, w_gate_up, w_down, row_weights)
    out = moe_triton.grouped_expert_gemm(x, offsets, w_gate_up, w_down, row_weights)
    tol = TOL[dtype] if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(ref, loop, **tol)
    torch.testing.assert_close(out, ref, **tol)
    # Offsets left on the device: a launch bound from the host's sizes, each program finding its tile.
    on_device = moe_triton.grouped_expert_gemm(x, torch.tensor(offsets), w_gate_up, w_down, row_weights)
    assert torch.equal(on_device, out)


# gpt-oss's experts: 4 experts, hidden 40 and intermediate 24 (neither a power of two nor a
# multiple of the interpreter's 32-wide tiles), expert 1 idle, 3 rows past the last offset.
GPT_OSS_OFFSETS = [0, 5, 5, 21, 30]
GPT_OSS_ROWS = 33
GPT_OSS = moe_ref.ExpertActivation(alpha=ALPHA, limit=LIMIT)


def gpt_oss_case(dtype, biases):
    """(transformers' experts, x, row weights, the kernels' keywords in megainfer's layout)."""
    hf = HFExperts.random(4, 40, 24, seed=11, dtype=dtype)
    g = torch.Generator().manual_seed(12)
    x = torch.randn(GPT_OSS_ROWS, 40, generator=g).to(dtype)
    row_weights = torch.rand(GPT_OSS_ROWS, generator=g)
    w_gate_up, w_down, gate_up_bias, down_bias = hf.megainfer()
    return hf, x, row_weights, dict(w_gate_up=w_gate_up, w_down=w_down, row_weights=row_weights,
                                    gate_up_bias=gate_up_bias if biases else None,
                                    down_bias=down_bias if biases else None)


@pytest.mark.parametrize("clamped", [True, False], ids=["clamped", "silu"])
@pytest.mark.parametrize("biases", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("path", ["per_expert", "batched", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gpt_oss_experts_match_transformers_loop(monkeypatch, path, biases, clamped, dtype):
    """Both reference paths and the Triton kernel against transformers' GptOssExperts computed
    row by row in float32 over its interleaved gate_up_proj: the de-interleave convention, the
    biases (the down bias scaled by the routing weight too) and the clamp, which binds here."""
    hf, x, row_weights, kw = gpt_oss_case(dtype, biases)
    total = GPT_OSS_OFFSETS[-1]
    assert_clamp_binds(hf, x, GPT_OSS_OFFSETS)
    want = hf.forward(x, GPT_OSS_OFFSETS, row_weights, clamped=clamped, biases=biases)
    activation = GPT_OSS if clamped else moe_ref.SWIGLU
    if path == "triton":
        out = moe_triton.grouped_expert_gemm(x, GPT_OSS_OFFSETS, activation=activation, **kw)
        # Offsets on the device: the same kernel, each program finding its tile.
        on_device = moe_triton.grouped_expert_gemm(x, torch.tensor(GPT_OSS_OFFSETS), activation=activation, **kw)
        assert torch.equal(on_device[:total], out[:total])
    else:
        # The path is picked by rows per expert; the other one refuses to run.
        def refuse(*args, **kwargs):
            raise AssertionError(f"the reference took the other path than {path}")

        monkeypatch.setattr(moe_ref, "_batched" if path == "per_expert" else "_per_expert", refuse)
        monkeypatch.setattr(moe_ref, "BATCHED_MAX_ROWS", 0 if path == "per_expert" else 1 << 20)
        out = moe_ref.grouped_expert_gemm(x, GPT_OSS_OFFSETS, activation=activation, **kw)
        assert torch.all(out[total:] == 0)  # rows past the last offset: never computed
    assert out.dtype == dtype and out.shape == x.shape
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=0.1, rtol=0.05)
    torch.testing.assert_close(out[:total].float(), want[:total], **tol)


def test_gpt_oss_experts_need_the_de_interleave():
    """The check above sees the layout: transformers' interleaved rows taken as megainfer's
    gate-first ones give other numbers."""
    hf, x, row_weights, kw = gpt_oss_case(torch.float32, True)
    kw["w_gate_up"] = hf.gate_up_proj.transpose(1, 2).contiguous()
    kw["gate_up_bias"] = hf.gate_up_proj_bias
    out = moe_ref.grouped_expert_gemm(x, GPT_OSS_OFFSETS, activation=GPT_OSS, **kw)
    assert not torch.allclose(out, hf.forward(x, GPT_OSS_OFFSETS, row_weights), atol=1e-2)


def test_expert_activation_is_plain_or_clamped_never_half():
    assert not moe_ref.SWIGLU.clamped and GPT_OSS.clamped
    assert str(moe_ref.SWIGLU) == "swiglu" and str(GPT_OSS) == "clamped-swiglu(alpha=1.702,limit=7)"
    with pytest.raises(ValueError, match="alpha .* and limit .* are set together"):
        moe_ref.ExpertActivation(alpha=1.702)
    with pytest.raises(ValueError, match="limit must be > 0"):
        moe_ref.ExpertActivation(alpha=1.0, limit=0.0)


def test_the_gemm_launcher_names_the_bias_it_cannot_read():
    _, x, _, kw = gpt_oss_case(torch.float32, True)
    with pytest.raises(ValueError, match=r"gate_up_bias: want a contiguous \[4, 48\]"):
        moe_triton.grouped_expert_gemm(x, GPT_OSS_OFFSETS, **kw | dict(gate_up_bias=kw["gate_up_bias"][:, :24]))
    with pytest.raises(ValueError, match="down_bias: dtype torch.float64"):
        moe_triton.grouped_expert_gemm(x, GPT_OSS_OFFSETS, **kw | dict(down_bias=kw["down_bias"].double()))


def test_dispatch_keys_each_expert_variant_apart(monkeypatch):
    """gpt-oss's variant is its own shape (its own kernel, timed on its own); the plain one keeps its key."""
    monkeypatch.delenv(dispatch.ENV, raising=False)
    monkeypatch.setattr(dispatch, "backend", lambda device: dispatch.FASTEST)
    monkeypatch.setattr(dispatch, "_choice", ShapeChoice(timer=lambda fn, reps, warmup: (1.0, fn())))
    hf, x, row_weights, kw = gpt_oss_case(torch.float32, True)
    total = GPT_OSS_OFFSETS[-1]
    plain = dict(kw, gate_up_bias=None, down_bias=None)
    dispatch.grouped_expert_gemm(x, GPT_OSS_OFFSETS, **plain)
    out = dispatch.grouped_expert_gemm(x, GPT_OSS_OFFSETS, activation=GPT_OSS, **kw)
    dispatch.grouped_expert_gemm(x, GPT_OSS_OFFSETS, activation=GPT_OSS, **dict(kw, gate_up_bias=None))
    torch.testing.assert_close(out[:total], hf.forward(x, GPT_OSS_OFFSETS, row_weights)[:total], atol=1e-4, rtol=1e-4)
    assert [str(k) for k in dispatch._choice.choices] == [
        "grouped_expert_gemm[float32 4 48 40 24; pairs=64]",
        "grouped_expert_gemm[float32 4 48 40 24 clamped-swiglu(alpha=1.702,limit=7) bias=gate_up+down; pairs=64]",
        "grouped_expert_gemm[float32 4 48 40 24 clamped-swiglu(alpha=1.702,limit=7) bias=down; pairs=64]"]
    assert all(d.reason == "faster" for d in dispatch.decisions())  # both ran: none failed


# -- dispatch and the engine --------------------------------------------------------------------
def test_dispatch_picks_by_device_and_honours_the_override(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.delenv(dispatch.ENV, raising=False)
    assert dispatch.backend(cpu) == "reference"
    monkeypatch.setenv(dispatch.ENV, "triton")
    assert dispatch.backend(cpu) == "triton"  # the interpreter is on in this module
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(dispatch.KernelUnavailable, match="TRITON_INTERPRET=1"):
        dispatch.backend(cpu)
    monkeypatch.setenv(dispatch.ENV, "cuda-graphs")
    with pytest.raises(dispatch.KernelUnavailable, match="reference, triton"):
        dispatch.backend(cpu)


def test_engine_tokens_unchanged_with_the_triton_kernels(monkeypatch, qwen3_ref):
    """The HF test checkpoint's greedy tokens through POD attention, fused gating and the grouped
    GEMM (all interpreted) equal those of the reference kernels."""
    from megainfer import LLM, SamplingParams

    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    prompts = [p[:12] for p in qwen3_ref.prompts[:3]]
    monkeypatch.setenv(dispatch.ENV, "reference")
    want = [o.outputs[0].token_ids for o in LLM(str(qwen3_ref.path), max_num_batched_tokens=16).generate(prompts, params)]
    monkeypatch.setenv(dispatch.ENV, "triton")
    got = [o.outputs[0].token_ids for o in LLM(str(qwen3_ref.path), max_num_batched_tokens=16).generate(prompts, params)]
    assert got == want


def test_deepseek_tokens_unchanged_with_the_latent_kernels(monkeypatch, deepseek_ref):
    """The tiny DeepSeek checkpoints (MLA with and without the q bottleneck, 4 and 6 heads) through
    the latent-attention kernels, chunked so that steps hold decodes and prompt chunks together:
    greedy tokens equal to the reference kernels'."""
    from megainfer import LLM, SamplingParams

    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    prompts = [p[:12] for p in deepseek_ref.prompts[:3]]
    monkeypatch.setenv(dispatch.ENV, "reference")
    want = [o.outputs[0].token_ids for o in LLM(str(deepseek_ref.path), max_num_batched_tokens=16).generate(prompts,
                                                                                                           params)]
    monkeypatch.setenv(dispatch.ENV, "triton")
    got = [o.outputs[0].token_ids for o in LLM(str(deepseek_ref.path), max_num_batched_tokens=16).generate(prompts,
                                                                                                          params)]
    assert got == want


def compile_check(*args: str) -> subprocess.CompletedProcess:
    """`python -m kernels.compile_check` outside the interpreter (it has no compiler)."""
    import triton

    if not shutil.which(triton.knobs.nvidia.ptxas.path) or not shutil.which(triton.knobs.nvidia.cuobjdump.path):
        pytest.skip("this Triton has no ptxas/cuobjdump to compile for NVIDIA GPUs")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"TRITON_DEFAULT_FP_FUSION": "1"}
    return subprocess.run([sys.executable, "-m", "kernels.compile_check", *args], capture_output=True, text=True,
                          timeout=1200, env=env)


def test_kernels_compile_for_a_gpu_without_one():
    """The tensor-core paths and %smid compiled for an A100 (sm_80), an L40S (sm_89, 99 KiB of
    shared memory per program) and an H100 (sm_90) by Triton's own ptxas, the rows nearest a
    limit or that differ by architecture (about 30 s on two cores): the POD kernel at Qwen3's
    16-head groups with two programs fitting on an SM, head dim 64, the decode and prefill
    grouped-GEMM rows (gpt-oss's biased, clamped one too, at its 2880-wide experts), DeepSeek-V3's
    latent-attention kernels at TP 8 (a [16, 512] accumulator), all without spills and within the
    architecture's shared memory."""
    out = compile_check("--quick", "--arch", "80", "89", "90")
    assert out.returncode == 0, out.stdout + out.stderr
    for arch in ("sm_80", "sm_89", "sm_90"):
        section = out.stdout.split(arch)[1].split("sm_")[0]
        assert "pod_kernel" in section and "reads %smid" in section and "_gate_up_kernel" in section, out.stdout
        assert "gpt-oss-120b 512 rows/expert bf16 bias+clamp" in section, out.stdout
        assert "latent_decode_kernel" in section and "deepseek-v3 tp8 16x512+64 bf16" in section, out.stdout


@pytest.mark.slow
@pytest.mark.parametrize("arch", [80, 89, 90])
def test_every_tile_row_compiles_without_spills(arch):
    """Every row of the tile tables at Mixtral, Qwen3 and other heads and expert shapes, for A100,
    L40S and H100 (about a minute each on two cores)."""
    out = compile_check("--arch", str(arch))
    assert out.returncode == 0, out.stdout + out.stderr


def test_bench_kernels_smoke_run_in_the_interpreter(tmp_path):
    path = tmp_path / "kernels.json"
    env = os.environ | {"TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-m", "megainfer", "bench", "kernels", "--smoke", "--json", str(path)],
                         capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr
    result = json.loads(path.read_text())
    assert result["smoke"] and "the times say nothing" in out.stdout
    ratios = [result["hybrid"][0]["pod_vs_serial"], result["hybrid"][0]["pod_vs_sdpa"],
              result["decode"][0]["triton_vs_sdpa"], result["moe"][0]["grouped_vs_loop"]]
    assert all(r > 0 for r in ratios)


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the benchmark runs")
def test_bench_kernels_says_no_gpu_and_fails():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "megainfer", "bench", "kernels"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode != 0 and "no CUDA device" in out.stderr and "Traceback" not in out.stderr


def test_shape_choice_takes_triton_when_the_reference_runs_out_of_memory(caplog):
    def timer(fn, reps, warmup):
        return 1.0, fn()

    def gathers_too_much():
        raise torch.cuda.OutOfMemoryError("CUDA out of memory gathering pages")

    choice = ShapeChoice(timer=timer)
    key = ShapeKey("op", (), (8,))
    with caplog.at_level(logging.INFO, logger="kernels"):
        assert choice.run(key, lambda: TRITON, gathers_too_much) == TRITON
    assert choice.choices == {key: TRITON} and "out of memory" in caplog.text
    assert "out of memory" in choice.decisions[key].reason


def test_gating_takes_triton_untimed_so_every_rank_routes_alike(monkeypatch):
    """A timed choice is per process; gating's must not differ between a node's ranks."""
    monkeypatch.delenv(dispatch.ENV, raising=False)
    monkeypatch.setattr(dispatch, "backend", lambda device: dispatch.FASTEST)
    timed = []
    monkeypatch.setattr(dispatch, "_choice", ShapeChoice(timer=lambda fn, reps, warmup: timed.append(fn)))
    logits = torch.randn(5, 8, generator=torch.Generator().manual_seed(0))
    out = dispatch.fused_gating(logits, 2, True)
    expected = moe_ref.fused_gating(logits, 2, True)
    assert torch.equal(out.topk_ids, expected.topk_ids) and not timed
    assert set(dispatch._choice.choices.values()) == {TRITON}


# -- the start-up warm-up (kernels/startup.py) -----------------------------------------------------
def test_warm_up_decides_a_nodes_shapes_at_start_and_serving_times_nothing(monkeypatch):
    """On CUDA a node warms up before it serves: every grid shape timed and decided, then frozen.
    Here the backend and the timer stand in for a GPU's (the kernels run in the interpreter)."""
    from kernels import startup

    monkeypatch.delenv(dispatch.ENV, raising=False)
    monkeypatch.setattr(dispatch, "backend", lambda device: dispatch.FASTEST)
    timed = []

    def timer(fn, reps, warmup):
        timed.append(fn)
        return 1.0, fn()  # a tie: Triton keeps the shape

    monkeypatch.setattr(dispatch, "_choice", ShapeChoice(timer=timer))
    cache = PagedCache([64] * 4, 16, 2, 32, torch.float32, seed=0)
    grid = startup.attention_grid(max_decodes=4, max_tokens=20, max_len=40)
    # a step's decodes and prompt tokens together within its 20 tokens
    assert grid == [(0, 16, 40), (0, 20, 40), (1, 0, 40), (1, 16, 40), (4, 0, 40), (4, 16, 40)]
    startup.warm_up_attention(cache.k, cache.v, 8, 32 ** -0.5, grid)
    startup.warm_up_gating(lambda logits: dispatch.fused_gating(logits, 2, True), 6, 20, torch.float32,
                           torch.device("cpu"))
    w_gate_up, w_down = torch.randn(3, 24, 32) * 0.1, torch.randn(3, 32, 12) * 0.1
    startup.warm_up_experts(w_gate_up, w_down, 2, 40)
    ops = {d.op for d in dispatch.decisions()}
    assert ops == {"paged_attention", "fused_gating", "grouped_expert_gemm"}
    attention = [d for d in dispatch.decisions() if d.op == "paged_attention"]
    assert len(attention) == len(grid)  # each point its own bucket
    report = startup.KernelReport(dispatch.FASTEST, "timed", tuple(dispatch.decisions()))
    assert report.by_operator()["paged_attention"] == {TRITON: 6}
    assert "paged_attention: triton on 6 shapes" in "\n".join(report.lines())

    dispatch.freeze()
    timed.clear()
    serving = PagedCache([33, 21, 7], 16, 2, 32, torch.float32, seed=1)  # 2 decodes + a 5-token chunk: unseen
    batch, starts = batch_of(serving, [1, 1, 5])
    q = torch.randn(starts[-1], 8, 32)
    out = dispatch.paged_attention(q, serving.k, serving.v, batch, 32 ** -0.5)
    torch.testing.assert_close(out, expected(serving, q, starts, 32 ** -0.5), **TOL[torch.float32])
    assert not timed and dispatch.shapes_met_while_serving() == 1  # the nearest decision, untimed


def test_kernel_report_on_the_cpu_names_the_references_and_why():
    from kernels import startup

    warmup = startup.Warmup(torch.device("cpu"))
    assert not warmup.active
    report = warmup.finish()
    assert report.mode == "reference" and report.lines(timing=False) == [
        "kernels: reference (cpu tensors: the torch references (the Triton kernels run on CUDA))"]


def test_the_warm_up_batches_carry_the_dtypes_serving_does():
    """Triton builds a variant per pointer type: a warm-up batch whose block tables or lengths had
    another dtype than serving's would leave serving's variant to be built mid-serving."""
    from types import SimpleNamespace

    from kernels import startup
    from megainfer.runner.model_runner import prepare_batch

    seqs = [SimpleNamespace(num_computed_tokens=9, token_ids=list(range(10)), block_table=[3]),
            SimpleNamespace(num_computed_tokens=0, token_ids=list(range(5)), block_table=[4])]
    _, _, serving = prepare_batch(seqs, [1, 5], 1, 16, torch.device("cpu"))
    warm, _ = startup._paged_batch(1, 5, 10, 16, 8, torch.device("cpu"))
    for field in ("block_tables", "seq_lens", "query_start_loc", "slot_mapping"):
        assert getattr(warm, field).dtype == getattr(serving, field).dtype, field


def test_a_failing_reference_decides_for_triton_and_says_why():
    choice = ShapeChoice(timer=lambda fn, reps, warmup: (1.0, fn()))
    key = ShapeKey("op", (), (8,))

    def broken():
        raise RuntimeError("cuDNN: no kernel for this shape")

    assert choice.run(key, lambda: TRITON, broken) == TRITON
    assert "reference failed" in choice.decisions[key].reason and "cuDNN" in choice.decisions[key].reason


def test_the_reference_is_not_timed_where_it_would_gather_too_much(monkeypatch):
    """A shape whose pages the reference would gather beyond the limit runs Triton untimed."""
    monkeypatch.delenv(dispatch.ENV, raising=False)
    monkeypatch.setattr(dispatch, "backend", lambda device: dispatch.FASTEST)
    timed = []
    monkeypatch.setattr(dispatch, "_choice", ShapeChoice(timer=lambda fn, reps, warmup: timed.append(fn)))
    monkeypatch.setattr(dispatch, "REFERENCE_GATHER_LIMIT", 1024)
    cache = PagedCache([40, 33], 16, 2, 32, torch.float32, seed=2)
    batch, starts = batch_of(cache, [1, 1])
    q = torch.randn(starts[-1], 8, 32)
    out = dispatch.paged_attention(q, cache.k, cache.v, batch, 32 ** -0.5)
    torch.testing.assert_close(out, expected(cache, q, starts, 32 ** -0.5), **TOL[torch.float32])
    (decision,) = dispatch.decisions()
    assert not timed and decision.implementation == TRITON and "would gather" in decision.reason


# -- the attention half's fused kernels ---------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_matches_reference(dtype):
    from kernels import norm_rope_ref, norm_rope_triton

    g = torch.Generator().manual_seed(3)
    x = torch.randn(7, 96, generator=g).to(dtype)
    residual = torch.randn(7, 2 * 96, generator=g).to(dtype)[:, ::2]  # strided rows: a view, as the stream may be
    weight = torch.rand(96, generator=g).to(dtype)
    want, want_sum = norm_rope_ref.add_rms_norm(x, residual, weight, 1e-6)
    got, got_sum = norm_rope_triton.add_rms_norm(x, residual.contiguous(), weight, 1e-6)
    # Equal in float32; in bf16 the interpreter's rounding of float32 to bf16 is not the GPU's.
    torch.testing.assert_close(got_sum, want_sum, **(TOL[dtype] if dtype != torch.float32 else dict(atol=0, rtol=0)))
    torch.testing.assert_close(got, want, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_layer_norm_matches_torchs_layer_norm(dtype):
    """DBRX's bias-free LayerNorm after the residual add: the reference is torch's own, the
    Triton kernel (its CENTER variant) agrees; a hidden size short of the tile (96 of 128)."""
    from kernels import norm_rope_ref, norm_rope_triton

    g = torch.Generator().manual_seed(5)
    x = torch.randn(7, 96, generator=g).to(dtype)
    residual = (torch.randn(7, 96, generator=g) + 3.0).to(dtype)  # off-centre rows: the mean matters
    weight = torch.rand(96, generator=g).to(dtype)
    want, want_sum = norm_rope_ref.add_layer_norm(x, residual, weight, 1e-5)
    module = torch.nn.LayerNorm(96, eps=1e-5, bias=False, dtype=dtype).requires_grad_(False)
    module.weight.copy_(weight)
    torch.testing.assert_close(want, module(residual + x))  # what transformers' DbrxBlock runs
    got, got_sum = norm_rope_triton.add_layer_norm(x, residual, weight, 1e-5)
    torch.testing.assert_close(got_sum, want_sum, **(TOL[dtype] if dtype != torch.float32 else dict(atol=0, rtol=0)))
    torch.testing.assert_close(got, want, **(TOL[dtype] if dtype != torch.float32 else dict(atol=1e-5, rtol=1e-5)))
    assert (got.float() - norm_rope_ref.add_rms_norm(x, residual, weight, 1e-5)[0].float()).abs().max() > 0.1


@pytest.mark.parametrize("dtype, d", [(torch.float32, 32), (torch.bfloat16, 32), (torch.float32, 24)])
def test_rotary_store_kv_matches_reference_and_writes_the_cache(dtype, d):
    from kernels import norm_rope_ref, norm_rope_triton
    from megainfer.model.rotary import RotaryEmbedding

    g = torch.Generator().manual_seed(4)
    hq, hkv, tokens = 4, 2, 5
    qkv = torch.randn(tokens, (hq + 2 * hkv) * d, generator=g).to(dtype)
    qk = qkv[:, :(hq + hkv) * d].view(tokens, hq + hkv, d)  # strided, as the layer's view of its projection
    v = qkv[:, (hq + hkv) * d:].view(tokens, hkv, d)
    rotary = RotaryEmbedding(d, 10000.0, 64, dtype, "cpu")
    positions = torch.tensor([0, 5, 17, 63, 2])
    slots = torch.tensor([3, 9, 0, 14, 7])
    caches = [torch.zeros(4, 4, hkv, d, dtype=dtype) for _ in range(4)]
    want = norm_rope_ref.rotary_store_kv(qk, v, positions, rotary.cos, rotary.sin, caches[0], caches[1], slots, hq)
    got = norm_rope_triton.rotary_store_kv(qk, v, positions, rotary.cos, rotary.sin, caches[2], caches[3], slots, hq)
    torch.testing.assert_close(got, want, **TOL[dtype])
    torch.testing.assert_close(caches[2], caches[0], **TOL[dtype])
    assert torch.equal(caches[3], caches[1])  # the values, copied
    assert caches[2].view(-1, hkv, d)[1].abs().sum() == 0  # slots nobody wrote stay untouched
