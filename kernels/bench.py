"""`megainfer bench kernels`: the Triton kernels against their peers on a GPU, in bf16.

- Attention, on POD-Attention's hybrid batches (its Table 1 regime: 80-250 decodes at 12K
  context beside one prefill chunk of 1K-16K tokens): the POD fused kernel, the same work as
  two launches one after the other (split-KV decode, then prefill), and the torch
  reference (SDPA over gathered pages).
- MoE, the grouped SwiGLU GEMM against the per-expert loop of `F.linear` calls.

Times are CUDA-event medians; each row's ratios compare kernels measured in the same run.
"""

from __future__ import annotations

import json
import platform
import statistics
from dataclasses import asdict, dataclass

import torch

from kernels.paged_attention_ref import PagedAttentionBatch


class NoGPU(RuntimeError):
    pass


@dataclass(frozen=True)
class HybridConfig:
    name: str
    decodes: int
    context: int  # tokens cached per decoding sequence
    chunk: int  # the prefill chunk's tokens (its prefix: `context` tokens)


# Llama-3-8B-shaped attention (32 query heads, 8 kv heads, head dim 128), 16-token pages.
HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16
HYBRID = (HybridConfig("decode-heavy", 250, 12288, 1024),
          HybridConfig("balanced", 160, 12288, 4096),
          HybridConfig("prefill-heavy", 80, 12288, 16384))
MOE = (("mixtral-8x7b", 8, 2, 4096, 14336, 512), ("qwen3-30b-a3b", 128, 8, 2048, 768, 2048))


def _time(fn, iters: int = 20, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _hybrid_batch(cfg: HybridConfig, device: torch.device, dtype: torch.dtype):
    lens = [cfg.context] * cfg.decodes + [cfg.context + cfg.chunk]
    pages = [-(-n // PAGE) for n in lens]
    num_blocks = sum(pages)
    g = torch.Generator(device=device).manual_seed(0)
    kc = torch.randn(num_blocks, PAGE, KV_HEADS, HEAD_DIM, device=device, dtype=dtype, generator=g)
    vc = torch.randn_like(kc)
    tables = torch.zeros(len(lens), max(pages), dtype=torch.int32, device=device)
    used = 0
    for s, n in enumerate(pages):
        tables[s, :n] = torch.arange(used, used + n, device=device)
        used += n
    starts = list(range(cfg.decodes + 1)) + [cfg.decodes + cfg.chunk]
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    batch = PagedAttentionBatch(tables, seq_lens, torch.tensor(starts, dtype=torch.int32, device=device),
                                torch.zeros(starts[-1], dtype=torch.int64, device=device), cfg.decodes, lens, starts)
    q = torch.randn(starts[-1], HEADS, HEAD_DIM, device=device, dtype=dtype, generator=g)
    return q, kc, vc, batch


def bench_attention(device: torch.device) -> list[dict]:
    from kernels import attention_triton as t
    from kernels import paged_attention_ref as r

    rows = []
    scale = HEAD_DIM ** -0.5
    for cfg in HYBRID:
        q, kc, vc, b = _hybrid_batch(cfg, device, torch.bfloat16)
        d = b.num_single
        prefill_starts = [s - d for s in b.query_start_host[d:]]
        prefill_loc = b.query_start_loc[d:] - d

        def pod():
            t.pod_attention(q, kc, vc, b.block_tables, b.seq_lens, b.query_start_loc, b.query_start_host, d, scale)

        def serial():
            t.decode_attention(q[:d], kc, vc, b.block_tables[:d], b.seq_lens[:d], scale)
            t.prefill_attention(q[d:], kc, vc, b.block_tables[d:], b.seq_lens[d:], prefill_loc, prefill_starts, scale)

        def sdpa():
            r.paged_attention(q, kc, vc, b, scale)

        times = {"pod_ms": _time(pod), "serial_ms": _time(serial), "torch_sdpa_ms": _time(sdpa)}
        rows.append({**asdict(cfg), **times, "pod_vs_serial": times["serial_ms"] / times["pod_ms"],
                     "pod_vs_sdpa": times["torch_sdpa_ms"] / times["pod_ms"]})
    return rows


def bench_moe(device: torch.device) -> list[dict]:
    from kernels import moe_ref, moe_triton

    rows = []
    for name, experts, top_k, hidden, inter, tokens in MOE:
        g = torch.Generator(device=device).manual_seed(0)
        pairs = tokens * top_k
        x = torch.randn(pairs, hidden, device=device, dtype=torch.bfloat16, generator=g)
        w_gate_up = torch.randn(experts, 2 * inter, hidden, device=device, dtype=torch.bfloat16, generator=g) * 0.02
        w_down = torch.randn(experts, hidden, inter, device=device, dtype=torch.bfloat16, generator=g) * 0.02
        ids = torch.randint(0, experts, (pairs,), generator=g, device=device).sort().values
        counts = torch.bincount(ids, minlength=experts).tolist()
        offsets = [0]
        for c in counts:
            offsets.append(offsets[-1] + c)
        weights = torch.rand(pairs, device=device, generator=g)
        fused = _time(lambda: moe_triton.grouped_expert_gemm(x, offsets, w_gate_up, w_down, weights))
        loop = _time(lambda: moe_ref._per_expert(x, counts, w_gate_up, w_down) * weights[:, None])
        rows.append({"model": name, "experts": experts, "top_k": top_k, "tokens": tokens, "fused_ms": fused,
                     "per_expert_loop_ms": loop, "fused_vs_loop": loop / fused})
    return rows


def run(json_path: str | None = None) -> int:
    if not torch.cuda.is_available():
        raise NoGPU("megainfer bench kernels measures Triton kernels on a GPU, and torch sees no CUDA device here; "
                    "the kernels' correctness tests run on the CPU: TRITON_INTERPRET=1 pytest tests/test_kernels.py")
    device = torch.device("cuda")
    attention, moe = bench_attention(device), bench_moe(device)
    print(f"{'hybrid batch':14s} {'decodes':>7s} {'context':>7s} {'chunk':>6s} {'POD ms':>8s} {'serial ms':>9s} "
          f"{'SDPA ms':>8s} {'POD/serial':>10s} {'POD/SDPA':>8s}")
    for r in attention:
        print(f"{r['name']:14s} {r['decodes']:7d} {r['context']:7d} {r['chunk']:6d} {r['pod_ms']:8.3f} "
              f"{r['serial_ms']:9.3f} {r['torch_sdpa_ms']:8.3f} {r['pod_vs_serial']:9.2f}x {r['pod_vs_sdpa']:7.2f}x")
    print()
    print(f"{'MoE':14s} {'experts':>7s} {'top_k':>5s} {'tokens':>6s} {'fused ms':>8s} {'loop ms':>8s} {'fused/loop':>10s}")
    for r in moe:
        print(f"{r['model']:14s} {r['experts']:7d} {r['top_k']:5d} {r['tokens']:6d} {r['fused_ms']:8.3f} "
              f"{r['per_expert_loop_ms']:8.3f} {r['fused_vs_loop']:9.2f}x")
    balanced = next(r for r in attention if r["name"] == "balanced")
    print(f"goal: POD at least 1.2x the serial pair on the balanced batch: {balanced['pod_vs_serial']:.2f}x")
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"benchmark": "kernels", "device": torch.cuda.get_device_name(device),
                       "torch": torch.__version__, "machine": platform.node(), "dtype": "bfloat16",
                       "attention": attention, "moe": moe}, f, indent=2)
    return 0
