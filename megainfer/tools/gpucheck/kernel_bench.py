"""The `kernel_bench` check: `megainfer bench kernels` (kernels/bench.py) inside the check, its
ratios recorded as figures: POD fused against the serial pair and against SDPA, the split-KV
decode against SDPA, DeepSeek's latent attention against its torch reference, the grouped expert GEMM against a per-expert cuBLAS loop. On the CPU the
smoke shapes under Triton's interpreter: the times mean nothing there."""

from __future__ import annotations

from kernels import bench
from megainfer.tools.gpucheck.context import CheckContext


def run(ctx: CheckContext) -> None:
    suite = bench.FULL if ctx.on_gpu else bench.SMOKE
    label = "" if ctx.on_gpu else " (smoke shapes, interpreter: times mean nothing)"
    with ctx.case(f"hybrid batches: POD vs the serial pair and SDPA{label}") as case:
        for r in bench.bench_hybrid(suite, ctx.device):
            key = f"{r['heads']} {r['name']}"
            case.figures[f"{key} pod_vs_serial"] = round(r["pod_vs_serial"], 3)
            case.figures[f"{key} pod_vs_sdpa"] = round(r["pod_vs_sdpa"], 3)
    with ctx.case(f"decode: split-KV vs SDPA{label}") as case:
        for r in bench.bench_decode(suite, ctx.device):
            case.figures[f"{r['heads']} {r['decodes']}x{r['context']} triton_vs_sdpa"] = round(r["triton_vs_sdpa"], 3)
    with ctx.case(f"latent attention (MLA): Triton vs the torch reference{label}") as case:
        for r in bench.bench_latent(suite, ctx.device):
            case.figures[f"{r['heads']} {r['batch']} triton_vs_reference"] = round(r["triton_vs_reference"], 3)
    with ctx.case(f"experts: grouped GEMM vs a per-expert cuBLAS loop{label}") as case:
        for r in bench.bench_moe(suite, ctx.device):
            case.figures[f"{r['model']} {r['tokens']} tokens grouped_vs_loop"] = round(r["grouped_vs_loop"], 3)
