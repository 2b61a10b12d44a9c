"""`megainfer bench kernels`: the Triton kernels against their peers, in bf16 on a GPU.

- Hybrid batches in POD-Attention's regime (one prefill chunk of 1K-4K tokens beside many
  decodes over 4K-16K contexts): the POD fused kernel against the same work as two launches
  one after the other (the prefill kernel, then the split-KV decode kernel), and against the
  torch reference (SDPA over gathered pages).
- Decode attention alone: the split-KV decode kernel against torch SDPA on the gathered K/V.
- DeepSeek-V3's latent attention (MLA, absorbed; 16 heads at TP 8 over a 512 + 64-wide cache):
  the latent kernels against the torch reference (SDPA over the gathered pages, keys and values
  the same 576-wide tensor, cut to the latent), on decode-only and hybrid batches.
- The grouped SwiGLU expert GEMM against a per-expert loop of cuBLAS GEMMs (`F.linear`).

Every ratio is the peer's time over the kernel's, both measured in the same run (above 1:
the Triton kernel is faster). Plans (work tiles, split counts) are built once per batch
outside the timed calls, as serving builds them once per step. Times are CUDA-event means
after warm-up. `--smoke` runs tiny shapes instead, on a CPU under Triton's interpreter
(TRITON_INTERPRET=1) too: it checks the benchmark runs, its times mean nothing.
"""

from __future__ import annotations

import json
import platform
import time
from dataclasses import asdict, dataclass

import torch

from kernels.launch import interpreted
from kernels.paged_attention_ref import PagedAttentionBatch


class NoGPU(RuntimeError):
    pass


@dataclass(frozen=True)
class Heads:
    name: str
    q: int  # query heads
    kv: int  # kv heads
    dim: int  # head dim


@dataclass(frozen=True)
class HybridConfig:
    name: str
    decodes: int
    context: int  # tokens cached per decoding sequence
    chunk: int  # the prefill chunk's tokens (after a prefix of `context` tokens)


@dataclass(frozen=True)
class DecodeConfig:
    decodes: int
    context: int


@dataclass(frozen=True)
class LatentHeads:
    name: str
    heads: int  # query heads per rank
    rank: int  # kv_lora_rank: the cached latent's width
    rope: int  # qk_rope_head_dim: the cached rotary key's width
    qk_head_dim: int  # nope + rope: the softmax scale's


@dataclass(frozen=True)
class MoeConfig:
    model: str
    experts: int
    top_k: int
    hidden: int
    inter: int
    tokens: int


@dataclass(frozen=True)
class Suite:
    """The shapes of one run."""
    heads: tuple[Heads, ...]
    hybrid: tuple[HybridConfig, ...]
    decode: tuple[DecodeConfig, ...]
    moe: tuple[MoeConfig, ...]
    latent: LatentHeads  # timed on `decode`'s batches and `hybrid`'s second
    page: int  # tokens per KV page
    dtype: torch.dtype
    iters: int  # timed calls per measurement
    warmup: int


MIXTRAL, QWEN3 = Heads("mixtral-8x7b", 32, 8, 128), Heads("qwen3-moe-gqa16", 64, 4, 128)
FULL = Suite(
    heads=(MIXTRAL, QWEN3),
    hybrid=(HybridConfig("chunk1k-ctx4k", 128, 4096, 1024), HybridConfig("chunk2k-ctx8k", 96, 8192, 2048),
            HybridConfig("chunk4k-ctx16k", 64, 16384, 4096)),
    decode=(DecodeConfig(64, 4096), DecodeConfig(64, 16384), DecodeConfig(8, 32768)),
    moe=(MoeConfig("mixtral-8x7b", 8, 2, 4096, 14336, 256), MoeConfig("mixtral-8x7b", 8, 2, 4096, 14336, 4096),
         MoeConfig("qwen3-30b-a3b", 128, 8, 2048, 768, 256), MoeConfig("qwen3-30b-a3b", 128, 8, 2048, 768, 4096)),
    latent=LatentHeads("deepseek-v3 tp8", 16, 512, 64, 192), page=16, dtype=torch.bfloat16, iters=20, warmup=3)
SMOKE = Suite(
    heads=(Heads("tiny-gqa4", 8, 2, 32),),
    hybrid=(HybridConfig("tiny", 3, 40, 20),),
    decode=(DecodeConfig(3, 40),),
    moe=(MoeConfig("tiny", 4, 2, 32, 48, 8),),
    latent=LatentHeads("tiny-mla", 8, 32, 16, 24), page=16, dtype=torch.float32, iters=2, warmup=1)
BALANCED = "chunk2k-ctx8k"  # the batch the goal is stated on


def _time_ms(fn, device: torch.device, iters: int, warmup: int) -> float:
    """Mean milliseconds per call: CUDA events on a GPU, the wall clock elsewhere."""
    for _ in range(warmup):
        fn()
    if device.type != "cuda":
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - start) * 1e3 / iters
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def _paged_batch(lens: list[int], chunks: list[int], heads: Heads, suite: Suite, device: torch.device):
    """(query, key cache, value cache, batch): sequences of `lens` cached tokens whose last
    `chunks[s]` are this step's queries (one-token chunks first), pages in order."""
    g = torch.Generator(device=device).manual_seed(0)
    pages = [-(-n // suite.page) for n in lens]
    kc = torch.randn(sum(pages), suite.page, heads.kv, heads.dim, device=device, generator=g).to(suite.dtype)
    vc = torch.randn(kc.shape, device=device, generator=g).to(suite.dtype)
    tables = torch.zeros(len(lens), max(pages), dtype=torch.int32)
    first = 0
    for s, n in enumerate(pages):
        tables[s, :n] = torch.arange(first, first + n)
        first += n
    batch = PagedAttentionBatch.of(tables.to(device), lens, chunks)
    q = torch.randn(batch.query_start_host[-1], heads.q, heads.dim, device=device, generator=g).to(suite.dtype)
    return q, kc, vc, batch


def bench_hybrid(suite: Suite, device: torch.device) -> list[dict]:
    """POD against the serial pair and the torch reference on each hybrid batch."""
    from kernels import attention_triton as t
    from kernels import paged_attention_ref as r

    rows = []
    for heads in suite.heads:
        scale = heads.dim ** -0.5
        for cfg in suite.hybrid:
            lens = [cfg.context] * cfg.decodes + [cfg.context + cfg.chunk]
            q, kc, vc, b = _paged_batch(lens, [1] * cfg.decodes + [cfg.chunk], heads, suite, device)
            d = cfg.decodes
            pod_plan = t.plan_pod(q, kc, b.block_tables, b.query_start_host, d, cfg.context)
            prefill_starts = [s - d for s in b.query_start_host[d:]]
            prefill_loc = b.query_start_loc[d:] - d
            prefill_plan = t.plan_prefill(prefill_starts, 0, t.tiles_for(q, kc).block_m, device)

            def pod():
                t.pod_attention(q, kc, vc, b.block_tables, b.seq_lens, b.query_start_loc, b.query_start_host, d,
                                scale, plan=pod_plan)

            def serial():
                t.prefill_attention(q[d:], kc, vc, b.block_tables[d:], b.seq_lens[d:], prefill_loc, prefill_starts,
                                    scale, plan=prefill_plan)
                t.decode_attention(q[:d], kc, vc, b.block_tables[:d], b.seq_lens[:d], scale, max_seq_len=cfg.context)

            times = {name: _time_ms(fn, device, suite.iters, suite.warmup) for name, fn in
                     (("pod_ms", pod), ("serial_ms", serial),
                      ("torch_sdpa_ms", lambda: r.paged_attention(q, kc, vc, b, scale)))}
            rows.append({"heads": heads.name, **asdict(cfg), **times,
                         "pod_vs_serial": times["serial_ms"] / times["pod_ms"],
                         "pod_vs_sdpa": times["torch_sdpa_ms"] / times["pod_ms"]})
    return rows


def bench_decode(suite: Suite, device: torch.device) -> list[dict]:
    """The split-KV decode kernel against SDPA on the gathered pages (the torch reference)."""
    from kernels import attention_triton as t
    from kernels import paged_attention_ref as r

    rows = []
    for heads in suite.heads:
        scale = heads.dim ** -0.5
        for cfg in suite.decode:
            q, kc, vc, b = _paged_batch([cfg.context] * cfg.decodes, [1] * cfg.decodes, heads, suite, device)
            triton_ms = _time_ms(lambda: t.decode_attention(q, kc, vc, b.block_tables, b.seq_lens, scale,
                                                            max_seq_len=cfg.context), device, suite.iters,
                                 suite.warmup)
            sdpa_ms = _time_ms(lambda: r.paged_attention(q, kc, vc, b, scale), device, suite.iters, suite.warmup)
            rows.append({"heads": heads.name, **asdict(cfg), "triton_ms": triton_ms, "torch_sdpa_ms": sdpa_ms,
                         "triton_vs_sdpa": sdpa_ms / triton_ms})
    return rows


def bench_latent(suite: Suite, device: torch.device) -> list[dict]:
    """The latent-attention kernels against the torch reference on decode-only batches and on the
    second hybrid batch."""
    from kernels import latent_attention_ref as r
    from kernels import latent_attention_triton as t

    h = suite.latent
    heads = Heads(h.name, h.heads, 1, h.rank + h.rope)
    scale = h.qk_head_dim ** -0.5
    batches = [(f"decode {c.decodes}x{c.context}", [c.context] * c.decodes, [1] * c.decodes) for c in suite.decode]
    hybrid = suite.hybrid[min(1, len(suite.hybrid) - 1)]
    batches.append((f"hybrid {hybrid.name}", [hybrid.context] * hybrid.decodes + [hybrid.context + hybrid.chunk],
                    [1] * hybrid.decodes + [hybrid.chunk]))
    rows = []
    for name, lens, chunks in batches:
        q, cache, _, b = _paged_batch(lens, chunks, heads, suite, device)
        d = b.num_single
        plan = t.plan_latent(q, h.rank, b.block_tables, suite.page, b.query_start_host, d, max(lens[:d], default=0))
        triton_ms = _time_ms(lambda: t.latent_attention(q, cache, b.block_tables, b.seq_lens, b.query_start_loc,
                                                        b.query_start_host, d, scale, h.rank, plan=plan),
                             device, suite.iters, suite.warmup)
        reference_ms = _time_ms(lambda: r.latent_attention(q, cache, b, scale, h.rank), device, suite.iters,
                                suite.warmup)
        rows.append({"heads": h.name, "batch": name, "triton_ms": triton_ms, "torch_reference_ms": reference_ms,
                     "triton_vs_reference": reference_ms / triton_ms})
    return rows


def bench_moe(suite: Suite, device: torch.device) -> list[dict]:
    """The grouped expert GEMM against one cuBLAS GEMM pair per expert."""
    from kernels import moe_ref, moe_triton

    rows = []
    for cfg in suite.moe:
        g = torch.Generator(device=device).manual_seed(0)
        pairs = cfg.tokens * cfg.top_k
        x = torch.randn(pairs, cfg.hidden, device=device, generator=g).to(suite.dtype)
        w_gate_up = (torch.randn(cfg.experts, 2 * cfg.inter, cfg.hidden, device=device, generator=g) * 0.02
                     ).to(suite.dtype)
        w_down = (torch.randn(cfg.experts, cfg.hidden, cfg.inter, device=device, generator=g) * 0.02).to(suite.dtype)
        counts = torch.bincount(torch.randint(0, cfg.experts, (pairs,), generator=g, device=device),
                                minlength=cfg.experts).tolist()
        offsets = [0]
        for c in counts:
            offsets.append(offsets[-1] + c)
        weights = torch.rand(pairs, device=device, generator=g)
        fused = _time_ms(lambda: moe_triton.grouped_expert_gemm(x, offsets, w_gate_up, w_down, weights), device,
                         suite.iters, suite.warmup)
        loop = _time_ms(lambda: moe_ref._per_expert(x, counts, w_gate_up, w_down) * weights[:, None], device,
                        suite.iters, suite.warmup)
        rows.append({**asdict(cfg), "grouped_ms": fused, "per_expert_cublas_ms": loop, "grouped_vs_loop": loop / fused})
    return rows


def _print(hybrid: list[dict], decode: list[dict], latent: list[dict], moe: list[dict]) -> None:
    print(f"{'hybrid batch':16s} {'heads':16s} {'decodes':>7s} {'context':>7s} {'chunk':>6s} {'POD ms':>8s} "
          f"{'serial ms':>9s} {'SDPA ms':>8s} {'serial/POD':>10s} {'SDPA/POD':>8s}")
    for r in hybrid:
        print(f"{r['name']:16s} {r['heads']:16s} {r['decodes']:7d} {r['context']:7d} {r['chunk']:6d} "
              f"{r['pod_ms']:8.3f} {r['serial_ms']:9.3f} {r['torch_sdpa_ms']:8.3f} {r['pod_vs_serial']:9.2f}x "
              f"{r['pod_vs_sdpa']:7.2f}x")
    print()
    print(f"{'decode':16s} {'heads':16s} {'decodes':>7s} {'context':>7s} {'Triton ms':>9s} {'SDPA ms':>8s} "
          f"{'SDPA/Triton':>11s}")
    for r in decode:
        print(f"{'':16s} {r['heads']:16s} {r['decodes']:7d} {r['context']:7d} {r['triton_ms']:9.3f} "
              f"{r['torch_sdpa_ms']:8.3f} {r['triton_vs_sdpa']:10.2f}x")
    print()
    print(f"{'latent (MLA)':16s} {'batch':28s} {'Triton ms':>9s} {'ref ms':>8s} {'ref/Triton':>10s}")
    for r in latent:
        print(f"{r['heads']:16s} {r['batch']:28s} {r['triton_ms']:9.3f} {r['torch_reference_ms']:8.3f} "
              f"{r['triton_vs_reference']:9.2f}x")
    print()
    print(f"{'MoE':16s} {'experts':>7s} {'top_k':>5s} {'tokens':>6s} {'grouped ms':>10s} {'loop ms':>8s} "
          f"{'loop/grouped':>12s}")
    for r in moe:
        print(f"{r['model']:16s} {r['experts']:7d} {r['top_k']:5d} {r['tokens']:6d} {r['grouped_ms']:10.3f} "
              f"{r['per_expert_cublas_ms']:8.3f} {r['grouped_vs_loop']:11.2f}x")


def _device(smoke: bool) -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda")
    if not smoke:
        raise NoGPU("megainfer bench kernels measures Triton kernels on a GPU, and torch sees no CUDA device here; "
                    "`TRITON_INTERPRET=1 megainfer bench kernels --smoke` checks the benchmark itself on the CPU, and "
                    "the kernels' correctness tests run there too: python -m pytest tests/kernels")
    if not interpreted():
        raise NoGPU("--smoke without a CUDA device runs the kernels in Triton's interpreter: set TRITON_INTERPRET=1")
    return torch.device("cpu")


def run(json_path: str | None = None, smoke: bool = False) -> int:
    device = _device(smoke)
    suite = SMOKE if smoke else FULL
    hybrid, decode, moe = bench_hybrid(suite, device), bench_decode(suite, device), bench_moe(suite, device)
    latent = bench_latent(suite, device)
    _print(hybrid, decode, latent, moe)
    balanced = [r for r in hybrid if r["name"] == BALANCED]
    for r in balanced:
        print(f"goal: POD at least 1.2x the serial pair on {BALANCED} ({r['heads']}): {r['pod_vs_serial']:.2f}x")
    if smoke:
        print("smoke run: tiny shapes" + ("" if device.type == "cuda" else " in Triton's interpreter") +
              "; the times say nothing about the kernels")
    if json_path:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({platform.machine()})"
        with open(json_path, "w") as f:
            json.dump({"benchmark": "kernels", "smoke": smoke, "device": name, "torch": torch.__version__,
                       "machine": platform.node(), "dtype": str(suite.dtype).removeprefix("torch."),
                       "hybrid": hybrid, "decode": decode, "latent": latent, "moe": moe}, f, indent=2)
    return 0
