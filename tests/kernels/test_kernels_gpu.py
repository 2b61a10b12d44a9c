"""The GPU check suite of the kernels: the GPU check's kernel cases
(megainfer/tools/gpucheck/kernel_checks.py: every Triton kernel against float32 ground truth
at Mixtral-8x7B, Mixtral-8x22B, Qwen3-30B-A3B and Qwen3-235B-A22B shapes in bfloat16, contexts
up to 32K, POD reading %smid, the grouped GEMM from decode to prefill sizes, fused gating, the
hot path free of host synchronisations), one test each; and the dispatch keeping, per shape
bucket, whichever of Triton and torch is faster.

Marked gpu: skipped, with the reason, where there is no CUDA device (tests/conftest.py) and
in a session that runs Triton's interpreter (tests/kernels/conftest.py compiles the kernels
only for sessions run with -m gpu): python -m pytest tests/kernels -m gpu
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from kernels import attention_triton, dispatch, moe_ref, moe_triton  # noqa: E402
from kernels import paged_attention_ref as attention_ref  # noqa: E402
from kernels.bench import run as bench_run  # noqa: E402
from kernels.choice import TRITON, ShapeChoice, cuda_time_ms  # noqa: E402
from kernels.paged_samples import PagedCache, batch_of  # noqa: E402
from megainfer.tools.gpucheck import kernel_checks as checks  # noqa: E402
from megainfer.tools.gpucheck.context import CheckContext  # noqa: E402
from megainfer.tools.gpucheck.records import RecordLog, Status  # noqa: E402

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")
HEADS = {"mixtral-gqa4": (32, 8), "qwen3-gqa4": (16, 4), "qwen3-gqa16": (64, 4)}  # query heads, kv heads
HEAD_DIM, PAGE = 128, 16
SCALE = HEAD_DIM ** -0.5
EXPERTS = {"mixtral-8x7b": (8, 2, 4096, 14336), "qwen3-30b-a3b": (128, 8, 2048, 768)}  # experts, top-k, hidden, inter


@pytest.fixture(autouse=True)
def compiled():
    if attention_triton.INTERPRETED:
        pytest.skip("Triton's interpreter is on in this session (TRITON_INTERPRET=1): these tests check the compiled "
                    "kernels; run them as python -m pytest tests/kernels -m gpu")


def _queries(n: int, hq: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device=CUDA).manual_seed(seed)
    return (2 * torch.randn(n, hq, HEAD_DIM, generator=g, device=CUDA)).to(torch.bfloat16)


def _offsets(counts: list[int]) -> list[int]:
    offsets = [0]
    for c in counts:
        offsets.append(offsets[-1] + c)
    return offsets


# -- the GPU check's kernel cases (megainfer/tools/gpucheck/kernel_checks.py) at real shapes ------
CHECKS = {**{f"decode {h}": (checks.check_decode, h) for h in checks.REAL.heads},
          **{f"prefill {h}": (checks.check_prefill, h) for h in checks.REAL.heads},
          **{f"pod {h}": (checks.check_pod, h) for h in checks.REAL.heads},
          "pod one kind": (checks.check_pod_one_kind, checks.REAL.heads[-1]),
          **{f"gpt-oss attention {'sinks+window' if w else 'sinks'}": (checks.check_gpt_oss_attention,
                                                                       checks.GPT_OSS_REAL, w) for w in (True, False)},
          **{f"gemm {e.model} {t}": (checks.check_grouped_gemm, e, t) for e in checks.REAL.experts
             for t in checks.REAL.expert_tokens},
          "latent attention": (checks.check_latent_attention, checks.LATENT_REAL),
          "gating": (checks.check_gating, checks.REAL.experts[0])}


@pytest.mark.parametrize("name", CHECKS)
def test_kernel_at_real_shapes(name, tmp_path):
    fn, *args = CHECKS[name]
    ctx = CheckContext("kernels", CUDA, tmp_path, deadline=float("inf"))
    fn(ctx, checks.REAL, *args)
    failed = [r for r in RecordLog(tmp_path).read() if r.status is not Status.PASSED]
    assert not failed, [(r.case, r.detail) for r in failed]


@pytest.mark.parametrize("check", [checks.check_smid_folds, lambda ctx: checks.check_hot_path(ctx, checks.REAL)],
                         ids=["smid-folds", "hot-path-without-host-sync"])
def test_smid_and_the_hot_path(check, tmp_path):
    check(CheckContext("kernels", CUDA, tmp_path, deadline=float("inf")))
    failed = [r for r in RecordLog(tmp_path).read() if r.status is not Status.PASSED]
    assert not failed, [(r.case, r.detail) for r in failed]


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
