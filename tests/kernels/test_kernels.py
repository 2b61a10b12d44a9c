"""Kernels: the Triton kernels against their torch references under Triton's interpreter
(small shapes: the interpreter is slow), the references against plain dense attention and
a per-expert loop, the dispatch point, and the engine unchanged with the Triton kernels in."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

# The interpreter is chosen when a @triton.jit function is defined: before the kernels import.
os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from kernels import attention_triton, dispatch, moe_ref, moe_triton  # noqa: E402
from kernels import paged_attention_ref as attention_ref  # noqa: E402
from kernels.paged_attention_ref import PagedAttentionBatch  # noqa: E402

if not attention_triton.INTERPRETED:
    pytest.skip("Triton kernels were imported before TRITON_INTERPRET=1 was set", allow_module_level=True)

TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
       torch.float16: dict(atol=2e-3, rtol=2e-3)}


class PagedCache:
    """Random keys and values for sequences of given lengths, in shuffled pages."""

    def __init__(self, lens, page, hkv, d, dtype=torch.float32, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.lens, self.page = list(lens), page
        pages = [-(-n // page) for n in lens]
        num_blocks = sum(pages) + 3
        self.k = torch.randn(num_blocks, page, hkv, d, generator=g).to(dtype)
        self.v = torch.randn(num_blocks, page, hkv, d, generator=g).to(dtype)
        order = torch.randperm(num_blocks, generator=g)
        self.block_tables = torch.zeros(len(lens), max(pages + [1]), dtype=torch.int32)
        used = 0
        for s, n in enumerate(pages):
            self.block_tables[s, :n] = order[used:used + n]
            used += n
        self.seq_lens = torch.tensor(lens, dtype=torch.int32)

    def dense(self, s):
        """Sequence s's keys and values as plain [len, Hkv, D] tensors."""
        pos = torch.arange(self.lens[s])
        blocks = self.block_tables[s, pos // self.page].long()
        return self.k[blocks, pos % self.page], self.v[blocks, pos % self.page]


def dense_attention(q, k, v, scale):
    """q [n, Hq, D] are the last n positions of a sequence whose keys are k [L, Hkv, D]."""
    n, hq, _ = q.shape
    length, hkv, _ = k.shape
    k, v = k.float().repeat_interleave(hq // hkv, 1), v.float().repeat_interleave(hq // hkv, 1)
    scores = torch.einsum("nhd,lhd->hnl", q.float(), k) * scale
    visible = torch.arange(length)[None, :] <= torch.arange(length - n, length)[:, None]
    return torch.einsum("hnl,lhd->nhd", scores.masked_fill(~visible, float("-inf")).softmax(-1), v)


def expected(cache, q, starts, scale):
    return torch.cat([dense_attention(q[starts[s]:starts[s + 1]], *cache.dense(s), scale)
                      for s in range(len(cache.lens)) if starts[s + 1] > starts[s]])


def batch_of(cache, chunks):
    """A PagedAttentionBatch for sequences computing `chunks[s]` new tokens (ones first)."""
    starts = [0]
    for n in chunks:
        starts.append(starts[-1] + n)
    return PagedAttentionBatch(cache.block_tables, cache.seq_lens, torch.tensor(starts, dtype=torch.int32),
                               torch.zeros(starts[-1], dtype=torch.int64), sum(1 for n in chunks if n == 1),
                               cache.lens, starts), starts


# -- attention ----------------------------------------------------------------------------------
@pytest.mark.parametrize("hq, hkv", [(4, 4), (4, 1), (8, 1), (8, 2)])  # GQA ratios 1, 4, 8, 4
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


@pytest.mark.parametrize("hq, hkv, page", [(4, 4, 16), (8, 2, 1), (8, 1, 16)])
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


@pytest.mark.parametrize("chunks", [[1, 1, 1, 12, 30], [1, 1, 1], [9, 30], [1]],
                         ids=["hybrid", "decode-only", "prefill-only", "one-decode"])
@pytest.mark.parametrize("hq, hkv, page", [(4, 2, 16), (8, 1, 1)])
def test_pod_fused_kernel_matches_the_hybrid_reference(chunks, hq, hkv, page):
    lens = [3, 16, 40, 12, 30][:len(chunks)]
    lens = [max(n, c) for n, c in zip(lens, chunks)]
    cache = PagedCache(lens, page, hkv, 16, seed=2)
    batch, starts = batch_of(cache, chunks)
    q = torch.randn(starts[-1], hq, 16)
    ref = attention_ref.paged_attention(q, cache.k, cache.v, batch, 0.25)
    torch.testing.assert_close(ref, expected(cache, q, starts, 0.25), **TOL[torch.float32])
    out = attention_triton.pod_attention(q, cache.k, cache.v, cache.block_tables, cache.seq_lens,
                                         batch.query_start_loc, starts, batch.num_single, 0.25)
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


def test_pod_work_split_shares_follow_the_items():
    assert attention_triton._shares(30, 0) == (1, 0) and attention_triton._shares(0, 5) == (0, 1)
    assert attention_triton._shares(10, 10) == (4, 4)
    assert attention_triton._shares(100, 1) == (7, 1)  # never starve a kind that has work


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
    want = [o.token_ids for o in LLM(str(qwen3_ref.path), max_num_batched_tokens=16).generate(prompts, params)]
    monkeypatch.setenv(dispatch.ENV, "triton")
    got = [o.token_ids for o in LLM(str(qwen3_ref.path), max_num_batched_tokens=16).generate(prompts, params)]
    assert got == want


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the benchmark runs")
def test_bench_kernels_says_no_gpu_and_fails():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "megainfer", "bench", "kernels"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode != 0 and "no CUDA device" in out.stderr and "Traceback" not in out.stderr
