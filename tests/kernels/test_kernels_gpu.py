"""The GPU check suite of the kernels: the compiled Triton kernels (never the interpreter)
against float32 attention and per-expert GEMMs at real shapes in bfloat16: Mixtral-8x7B's
heads (32 query, 8 kv: GQA 4) and Qwen3-MoE-shaped groups of 4 and 16 (16/4, 64/4), head
dim 128, 16-token pages, contexts up to 32K; the POD kernel reading %smid, with and without
split-KV decodes; the grouped expert GEMM at Mixtral-8x7B and Qwen3-30B-A3B expert shapes;
fused gating at Qwen3's routing shape; the hot path free of host synchronisations; and the
dispatch keeping, per shape bucket, whichever of Triton and torch is faster.

Marked gpu: skipped, with the reason, where there is no CUDA device (tests/conftest.py) and
in a session that runs Triton's interpreter (tests/kernels/conftest.py compiles the kernels
only for sessions run with -m gpu): python -m pytest tests/kernels -m gpu
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from kernels import attention_jit, attention_triton, dispatch, moe_ref, moe_triton  # noqa: E402
from kernels import paged_attention_ref as attention_ref  # noqa: E402
from kernels.bench import run as bench_run  # noqa: E402
from kernels.choice import TRITON, ShapeChoice, cuda_time_ms  # noqa: E402
from tests.kernels.paged import PagedCache, batch_of, expected  # noqa: E402

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")
HEADS = {"mixtral-gqa4": (32, 8), "qwen3-gqa4": (16, 4), "qwen3-gqa16": (64, 4)}  # query heads, kv heads
HEAD_DIM, PAGE = 128, 16
SCALE = HEAD_DIM ** -0.5
BF16 = dict(atol=2e-2, rtol=2e-2)  # bf16 outputs against float32 attention
EXPERTS = {"mixtral-8x7b": (8, 2, 4096, 14336), "qwen3-30b-a3b": (128, 8, 2048, 768)}  # experts, top-k, hidden, inter


@pytest.fixture(autouse=True)
def compiled():
    if attention_triton.INTERPRETED:
        pytest.skip("Triton's interpreter is on in this session (TRITON_INTERPRET=1): these tests check the compiled "
                    "kernels; run them as python -m pytest tests/kernels -m gpu")


@triton.jit
def _record_sm(out_ptr, NUM_SMS: tl.constexpr):
    pid = tl.program_id(0)
    tl.store(out_ptr + pid, attention_jit._sm_id(pid, NUM_SMS, True))


def _queries(n: int, hq: int, seed: int) -> torch.Tensor:
    """bf16 queries, doubled so attention over 32K keys is peaked, not a flat average."""
    g = torch.Generator(device=CUDA).manual_seed(seed)
    return (2 * torch.randn(n, hq, HEAD_DIM, generator=g, device=CUDA)).to(torch.bfloat16)


def _offsets(counts: list[int]) -> list[int]:
    offsets = [0]
    for c in counts:
        offsets.append(offsets[-1] + c)
    return offsets


def _ptx(fn) -> list[str]:
    """PTX of every variant of a @triton.jit kernel compiled on this device so far."""
    device = torch.cuda.current_device()
    if hasattr(fn, "device_caches"):  # Triton 3.3 and later
        kernels = fn.device_caches[device][0].values()
    else:
        kernels = fn.cache[device].values()
    return [k.asm["ptx"] for k in kernels]


# -- attention ----------------------------------------------------------------------------------
@pytest.mark.parametrize("heads", HEADS)
def test_decode_at_real_shapes(heads):
    hq, hkv = HEADS[heads]
    lens = [1, 17, 4096, 16384, 30001, 32768]  # one token, a partial page, page-aligned contexts up to 32K
    cache = PagedCache(lens, PAGE, hkv, HEAD_DIM, torch.bfloat16, seed=1, device=CUDA)
    q = _queries(len(lens), hq, 1)
    want = expected(cache, q, list(range(len(lens) + 1)), SCALE)
    torch_out = attention_ref.decode_attention(q, cache.k, cache.v, cache.block_tables, cache.seq_lens, SCALE)
    torch_err = (torch_out.float() - want).abs().mean().item()
    for splits in (None, 1, attention_triton.MAX_SPLITS):
        out = attention_triton.decode_attention(q, cache.k, cache.v, cache.block_tables, cache.seq_lens, SCALE,
                                                num_splits=splits, max_seq_len=max(lens))
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out.float(), want, **BF16)
        # On average within twice the error of torch's own bf16 SDPA (FlashAttention's test bar).
        assert (out.float() - want).abs().mean().item() <= 2 * torch_err + 1e-4


@pytest.mark.parametrize("heads", HEADS)
def test_prefill_at_real_shapes(heads):
    hq, hkv = HEADS[heads]
    chunks = [2048, 1024, 3000, 1]  # a whole prompt, chunks after 15K and 29.7K prefixes, one token
    lens = [2048, 16384, 32768, 9000]
    cache = PagedCache(lens, PAGE, hkv, HEAD_DIM, torch.bfloat16, seed=2, device=CUDA)
    batch, starts = batch_of(cache, chunks)
    q = _queries(starts[-1], hq, 2)
    out = attention_triton.prefill_attention(q, cache.k, cache.v, cache.block_tables, cache.seq_lens,
                                             batch.query_start_loc, starts, SCALE)
    torch.testing.assert_close(out.float(), expected(cache, q, starts, SCALE), **BF16)


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("splits", [None, 1, 4])
def test_pod_with_smid_at_real_shapes(heads, splits):
    """POD-Attention's regime: 64 decodes over 4K-16K contexts beside a 2K chunk after an 8K
    prefix and a whole 512-token prompt, one launch, programs taking roles by their SM."""
    hq, hkv = HEADS[heads]
    contexts = torch.randint(4096, 16385, (64,), generator=torch.Generator().manual_seed(3)).tolist()
    chunks = [1] * len(contexts) + [2048, 512]
    cache = PagedCache(contexts + [8192 + 2048, 512], PAGE, hkv, HEAD_DIM, torch.bfloat16, seed=3, device=CUDA)
    batch, starts = batch_of(cache, chunks)
    q = _queries(starts[-1], hq, 3)
    out = attention_triton.pod_attention(q, cache.k, cache.v, cache.block_tables, cache.seq_lens,
                                         batch.query_start_loc, starts, batch.num_single, SCALE,
                                         max_decode_len=max(contexts), num_splits=splits)
    torch.testing.assert_close(out.float(), expected(cache, q, starts, SCALE), **BF16)
    assert any("%smid" in ptx for ptx in _ptx(attention_jit.pod_kernel)), "the POD kernel did not read %smid"


def test_pod_one_kind_only_at_real_shapes():
    hq, hkv = HEADS["qwen3-gqa16"]
    for chunks, lens in (([1] * 32, [16384] * 32), ([4096], [12288])):
        cache = PagedCache(lens, PAGE, hkv, HEAD_DIM, torch.bfloat16, seed=4, device=CUDA)
        batch, starts = batch_of(cache, chunks)
        q = _queries(starts[-1], hq, 4)
        out = attention_triton.pod_attention(q, cache.k, cache.v, cache.block_tables, cache.seq_lens,
                                             batch.query_start_loc, starts, batch.num_single, SCALE)
        torch.testing.assert_close(out.float(), expected(cache, q, starts, SCALE), **BF16)


def test_smid_folds_into_the_counter_range():
    sms = torch.cuda.get_device_properties(CUDA).multi_processor_count
    out = torch.full((8 * sms,), -1, dtype=torch.int32, device=CUDA)
    _record_sm[(8 * sms,)](out, NUM_SMS=sms)
    ids = out.unique()
    assert ids.min().item() >= 0 and ids.max().item() < sms and ids.numel() > 1  # programs spread over SMs
    _record_sm[(8 * sms,)](out, NUM_SMS=7)  # fewer counters than SMs: every id still folds in
    assert out.min().item() >= 0 and out.max().item() < 7


# -- MoE ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("model", EXPERTS)
@pytest.mark.parametrize("tokens", [4, 256, 4096])  # decode to prefill: each row of the GEMM tile table
def test_grouped_expert_gemm_at_expert_shapes(model, tokens):
    experts, top_k, hidden, inter = EXPERTS[model]
    g = torch.Generator(device=CUDA).manual_seed(tokens)
    pairs = tokens * top_k
    x = torch.randn(pairs, hidden, generator=g, device=CUDA).to(torch.bfloat16)
    w_gate_up = (torch.randn(experts, 2 * inter, hidden, generator=g, device=CUDA) * hidden ** -0.5).to(torch.bfloat16)
    w_down = (torch.randn(experts, hidden, inter, generator=g, device=CUDA) * inter ** -0.5).to(torch.bfloat16)
    # Skewed routing (expert e drawn in proportion to e + 1) and an idle last expert.
    popularity = torch.arange(1, experts + 1, dtype=torch.float32, device=CUDA)
    popularity[-1] = 0
    ids = torch.multinomial(popularity, pairs, replacement=True, generator=g)
    counts = torch.bincount(ids, minlength=experts).tolist()
    weights = torch.rand(pairs, generator=g, device=CUDA)
    out = moe_triton.grouped_expert_gemm(x, _offsets(counts), w_gate_up, w_down, weights)
    want = moe_ref._per_expert(x.float(), counts, w_gate_up.float(), w_down.float()) * weights[:, None]
    torch.testing.assert_close(out.float(), want, atol=3e-2, rtol=3e-2)
    on_device = torch.tensor(_offsets(counts), device=CUDA)
    assert torch.equal(moe_triton.grouped_expert_gemm(x, on_device, w_gate_up, w_down, weights), out)


def test_fused_gating_at_qwen3_routing_shape():
    experts, top_k = EXPERTS["qwen3-30b-a3b"][:2]
    g = torch.Generator(device=CUDA).manual_seed(5)
    logits = torch.randn(4096, experts, generator=g, device=CUDA).to(torch.bfloat16)
    node = torch.arange(experts, device=CUDA) % 4
    out = moe_triton.fused_gating(logits, top_k, True, node, 4)
    ref = moe_ref.fused_gating(logits, top_k, True, node, 4)
    # bf16 logits differ by a bf16 step (>= 0.4%) or not at all, so no two probabilities are
    # near-ties that the two softmaxes' last bits could order differently; exact ties go to the
    # lower id in both.
    assert torch.equal(out.topk_ids, ref.topk_ids)
    torch.testing.assert_close(out.topk_weights, ref.topk_weights, atol=1e-5, rtol=1e-5)
    assert torch.equal(out.expert_counts, ref.expert_counts) and torch.equal(out.node_counts, ref.node_counts)
    assert torch.equal(out.expert_counts, torch.bincount(out.topk_ids.flatten(), minlength=experts))
    flat = out.topk_ids.flatten()
    assert torch.equal(flat[out.pair_order[out.pair_positions]], flat)
    bounds = out.node_offsets.tolist()
    for n in range(4):
        sent = out.node_token_ids[bounds[n]:bounds[n + 1]].sort().values
        assert torch.equal(sent, (node[out.topk_ids] == n).any(1).nonzero().flatten())


# -- the hot path ---------------------------------------------------------------------------------
def test_hot_path_launches_without_host_synchronisation():
    """With a step's plan built (dispatch builds it once per batch) and the expert offsets left
    on the device, POD attention, fused gating and the grouped GEMM queue their work without
    waiting for the GPU: torch's sync debug mode raises on any synchronising call."""
    hq, hkv = HEADS["qwen3-gqa16"]
    cache = PagedCache([8192] * 16 + [4096 + 1024], PAGE, hkv, HEAD_DIM, torch.bfloat16, seed=6, device=CUDA)
    batch, starts = batch_of(cache, [1] * 16 + [1024])
    q = _queries(starts[-1], hq, 6)
    experts, top_k, hidden, inter = EXPERTS["qwen3-30b-a3b"]
    hidden_states = torch.randn(256, hidden, device=CUDA).to(torch.bfloat16)
    logits = torch.randn(256, experts, device=CUDA).to(torch.bfloat16)
    node = torch.arange(experts, device=CUDA) % 4
    w_gate_up = (torch.randn(experts, 2 * inter, hidden, device=CUDA) * 0.02).to(torch.bfloat16)
    w_down = (torch.randn(experts, hidden, inter, device=CUDA) * 0.02).to(torch.bfloat16)

    def step():
        plan = attention_triton.plan_pod(q, cache.k, cache.block_tables, starts, batch.num_single, 8192)
        attention_triton.pod_attention(q, cache.k, cache.v, cache.block_tables, cache.seq_lens,
                                       batch.query_start_loc, starts, batch.num_single, SCALE, plan=plan)
        gating = moe_triton.fused_gating(logits, top_k, True, node, 4)
        rows = hidden_states[gating.pair_order // top_k]
        moe_triton.grouped_expert_gemm(rows, gating.expert_offsets, w_gate_up, w_down,
                                       gating.topk_weights.flatten()[gating.pair_order])

    step()  # compiles outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


# -- dispatch and the benchmark -------------------------------------------------------------------
def test_dispatch_keeps_the_faster_implementation_per_shape(monkeypatch):
    """Each bucket is timed once; re-timed with more reps, what the dispatch kept is not slower
    than the other implementation (25% allowed for timing noise)."""
    monkeypatch.delenv(dispatch.ENV, raising=False)
    monkeypatch.setattr(dispatch, "_choice", ShapeChoice())
    experts, top_k, hidden, inter = EXPERTS["qwen3-30b-a3b"]
    calls = []
    for tokens in (256, 4096):
        x = torch.randn(tokens * top_k, hidden, device=CUDA).to(torch.bfloat16)
        w_gate_up = (torch.randn(experts, 2 * inter, hidden, device=CUDA) * 0.02).to(torch.bfloat16)
        w_down = (torch.randn(experts, hidden, inter, device=CUDA) * 0.02).to(torch.bfloat16)
        offsets = _offsets(torch.bincount(torch.randint(0, experts, (x.shape[0],), device=CUDA),
                                          minlength=experts).tolist())
        weights = torch.rand(x.shape[0], device=CUDA)
        args = (x, offsets, w_gate_up, w_down, weights)
        calls.append((lambda a=args: moe_triton.grouped_expert_gemm(*a), lambda a=args: moe_ref.grouped_expert_gemm(*a),
                      lambda a=args: dispatch.grouped_expert_gemm(*a)))
    hq, hkv = HEADS["mixtral-gqa4"]
    cache = PagedCache([8192] * 64 + [8192 + 2048], PAGE, hkv, HEAD_DIM, torch.bfloat16, seed=7, device=CUDA)
    batch, starts = batch_of(cache, [1] * 64 + [2048])
    q = _queries(starts[-1], hq, 7)
    plan = attention_triton.plan_pod(q, cache.k, cache.block_tables, starts, batch.num_single, 8192)  # as dispatch
    calls.append((lambda: attention_triton.pod_attention(q, cache.k, cache.v, cache.block_tables, cache.seq_lens,
                                                         batch.query_start_loc, starts, batch.num_single, SCALE,
                                                         plan=plan),
                  lambda: attention_ref.paged_attention(q, cache.k, cache.v, batch, SCALE),
                  lambda: dispatch.paged_attention(q, cache.k, cache.v, batch, SCALE)))
    for triton_fn, reference_fn, dispatched in calls:
        before = set(dispatch._choice.choices)
        dispatched()
        (key,) = set(dispatch._choice.choices) - before
        triton_ms, _ = cuda_time_ms(triton_fn, reps=20, warmup=3)
        reference_ms, _ = cuda_time_ms(reference_fn, reps=20, warmup=3)
        choice = dispatch._choice.choices[key]
        kept, other = (triton_ms, reference_ms) if choice == TRITON else (reference_ms, triton_ms)
        assert kept <= 1.25 * other, (key, choice, triton_ms, reference_ms)


def test_bench_kernels_smoke_run_compiled(tmp_path):
    path = tmp_path / "kernels.json"
    assert bench_run(str(path), smoke=True) == 0
    assert path.exists()
