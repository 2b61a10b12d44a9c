"""Compile the Triton kernels for NVIDIA GPUs on a machine without one: every tile-table row
at real model shapes, in bf16 (and the fp32 rows once), through Triton's own ptxas. Reports
registers per thread, spilled bytes (local memory), shared memory per program and how many
programs fit on one SM, and fails where a row spills, needs more shared memory than the
architecture has, or (the POD kernel) leaves no room for a second program on an SM.

    python -m kernels.compile_check [--arch 90 [89 ...]] [--quick]

This checks that the tensor-core paths and %smid compile and fit; it cannot check numbers
(the GPU tests in tests/kernels/test_kernels_gpu.py do). Needs TRITON_INTERPRET unset: the
interpreter has no compiler.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from dataclasses import dataclass

import torch

from kernels.launch import interpreted
from kernels.moe_ref import REPLICA_BUCKETS
from kernels.tiles import attention_tiles, gemm_tiles, pow2

# Attention heads (query, kv, head dim): Mixtral 8x7B (GQA 4), Qwen3-MoE at GQA 4 and 16,
# multi-head (element-wise decode), and head dims 64 and 256 for the table's other rows.
ATTENTION = (("mixtral", 32, 8, 128), ("qwen3-gqa4", 16, 4, 128), ("qwen3-gqa16", 64, 4, 128), ("mha", 16, 16, 128),
             ("gqa2-d64", 16, 8, 64), ("gqa4-d256", 16, 4, 256))
# gpt-oss-20b and -120b's attention (GQA 8, head dim 64), compiled in its two variants: sinks
# with a sliding window (every other layer) and sinks alone (the rest).
GPT_OSS_ATTENTION = ("gpt-oss", 64, 8, 64)
# DeepSeek's latent attention (heads per rank, kv_lora_rank, qk_rope_head_dim): V3's 128 heads at
# TP 8 and TP 1, V2-Lite's 16 at TP 2.
LATENT_ATTENTION = (("deepseek-v3 tp8", 16, 512, 64), ("deepseek-v3 tp1", 128, 512, 64),
                    ("deepseek-v2-lite tp2", 8, 512, 64))
# Experts (count, hidden, intermediate) and the mean rows per expert of each GEMM tile row.
EXPERTS = (("mixtral", 8, 4096, 14336), ("qwen3-30b-a3b", 128, 2048, 768))
# gpt-oss's experts, compiled with their biases and clamped SwiGLU: widths of 2880, not a power
# of two (the last column and reduction tiles are partial, masked).
GPT_OSS_EXPERTS = (("gpt-oss-20b", 32, 2880, 2880), ("gpt-oss-120b", 128, 2880, 2880))
ROWS_PER_EXPERT = (8, 48, 512)
PAGE = 16
SHARED_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}  # bytes per block, opt-in maximum
SHARED_PER_SM = {80: 164 * 1024, 86: 100 * 1024, 89: 100 * 1024, 90: 228 * 1024}  # bytes; each block also takes 1 KiB
REGISTERS_PER_SM = 65536  # 32-bit registers, every architecture here
# Integer arguments that are multiples of 16 at every launch (query strides: heads x head dim).
ALIGNED_INTS = {"stride_qt", "stride_qh"}
TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


@dataclass(frozen=True)
class Report:
    kernel: str
    shape: str
    registers: int  # per thread
    spilled: int  # bytes of local memory per thread (register spills, stack)
    shared: int  # bytes per program
    num_warps: int
    arch: int
    min_resident: int  # programs that must fit on one SM together (POD: a prefill and a decode one)
    reads_smid: bool  # the PTX reads %smid (the POD kernel must)

    @property
    def resident(self) -> int:
        """Programs that fit on one SM at once, by registers (allocated in 8s per thread) and shared memory."""
        by_registers = REGISTERS_PER_SM // (-(-self.registers // 8) * 8 * 32 * self.num_warps)
        by_shared = SHARED_PER_SM.get(self.arch, 100 * 1024) // (self.shared + 1024)
        return min(by_registers, by_shared)

    @property
    def ok(self) -> bool:
        return (self.spilled == 0 and self.shared <= SHARED_LIMIT.get(self.arch, 99 * 1024)
                and self.resident >= self.min_resident and (self.reads_smid or self.kernel != "pod_kernel"))


def _signature(fn, constexprs: dict, pointers: dict[str, str]) -> dict[str, str]:
    """Triton's type of each argument: constexpr, a typed pointer, float32 `scale`, `eps`, `alpha` and `limit`
    (the expert GEMM's clamp), else int32."""
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = pointers.get(name, "*i32")
        else:
            sig[name] = "fp32" if name in ("scale", "eps", "alpha", "limit") else "i32"
    return sig


def _alignment(fn, sig: dict[str, str], aligned_ints: set[str]) -> dict:
    """What Triton's JIT assumes at a launch with torch tensors: every pointer 16-byte aligned,
    and the integer arguments that are multiples of 16 there (do_not_specialize ones never)."""
    return {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
            if sig[name].startswith("*") or name in aligned_ints}


def _resources(cubin: bytes) -> tuple[int, int]:
    """(registers, local bytes) of the cubin's one function, as cuobjdump reports them."""
    import triton

    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([triton.knobs.nvidia.cuobjdump.path, "-res-usage", f.name], capture_output=True,
                              text=True, check=True).stdout
    fields = dict(item.split(":") for item in text.split() if item.count(":") == 1 and item.split(":")[1].isdigit())
    return int(fields["REG"]), int(fields["LOCAL"]) + int(fields["STACK"])


def compile_one(fn, constexprs: dict, pointers: dict[str, str], num_warps: int, num_stages: int, arch: int,
                shape: str, min_resident: int = 1) -> Report:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = _signature(fn, constexprs, pointers)
    src = ASTSource(fn, sig, constexprs, _alignment(fn, sig, ALIGNED_INTS))
    kernel = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                            options={"num_warps": num_warps, "num_stages": num_stages})
    registers, spilled = _resources(kernel.asm["cubin"])
    return Report(fn.__name__, shape, registers, spilled, kernel.metadata.shared, num_warps, arch, min_resident,
                  "%smid" in kernel.asm["ptx"])


def attention_reports(name: str, hq: int, hkv: int, d: int, dtype: torch.dtype, arch: int, sinks: bool = False,
                      window: bool = False) -> list[Report]:
    """The attention kernels at these heads; sinks, window: their gpt-oss variants (the merge
    kernel, the same for every variant, only with the plain ones)."""
    from kernels import attention_jit as jit
    from kernels.attention_triton import MAX_SPLITS

    group = hq // hkv
    t = attention_tiles(d, group, dtype, interpreted=False, arch=arch)
    f = attention_tiles(d, group, dtype, interpreted=False, fused=True, arch=arch)
    ty = "*" + TYPES[dtype]
    # Without sinks the launchers pass the int32 seq_lens for sinks_ptr (never read).
    pointers = {n: ty for n in ("q_ptr", "k_ptr", "v_ptr", "out_ptr")} | {
        "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "sinks_ptr": "*fp32" if sinks else "*i32"}
    heads = dict(HQ=hq, HKV=hkv, D=d, PAGE=PAGE, GROUP=group, BLOCK_D=pow2(max(d, 16)), IEEE=dtype == torch.float32,
                 SINKS=sinks, WINDOWED=window)
    decode = dict(BLOCK_G=t.decode_rows(group), BLOCK_N=t.decode_n, DOT=t.decode_dot)
    prefill = dict(GROUP_PAD=pow2(group), BLOCK_M=t.block_m, BLOCK_N=t.block_n)
    pod = dict(GROUP_PAD=pow2(group), NUM_SMS=132, USE_SMID=True, BLOCK_M=f.block_m, BLOCK_N=f.block_n,
               DECODE_G=f.decode_rows(group), DECODE_N=f.decode_n, DECODE_DOT=f.decode_dot)
    variant = "+".join(n for n, on in (("sinks", sinks), ("window", window)) if on)
    shape = f"{name} {hq}/{hkv}x{d} {TYPES[dtype]}{' ' + variant if variant else ''}"
    merge = dict(HQ=hq, D=d, MAX_SPLITS=MAX_SPLITS, BLOCK_D=pow2(d))
    reports = [compile_one(jit.decode_kernel, heads | decode, pointers, 4, t.num_stages, arch, shape),
               compile_one(jit.prefill_kernel, heads | prefill, pointers, t.num_warps, t.num_stages, arch, shape),
               compile_one(jit.pod_kernel, heads | pod, pointers, f.num_warps, f.num_stages, arch, shape, 2)]
    if variant:
        return reports
    return reports + [compile_one(jit.merge_kernel, merge, pointers, 4, 1, arch, shape)]


def latent_reports(name: str, heads: int, rank: int, rope: int, dtype: torch.dtype, arch: int) -> list[Report]:
    """The latent-attention kernels (DeepSeek's MLA) at these shapes."""
    from kernels import latent_attention_jit as jit
    from kernels.latent_attention_triton import latent_tiles

    t = latent_tiles(heads, rank, dtype, interpreted=False)
    ty = "*" + TYPES[dtype]
    pointers = {"q_ptr": ty, "cache_ptr": ty, "out_ptr": ty, "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32"}
    common = dict(H=heads, RANK=rank, ROPE=rope, PAGE=PAGE, BLOCK_N=t.block_n, BLOCK_C=pow2(rank),
                  BLOCK_P=max(16, pow2(rope)), IEEE=dtype == torch.float32)
    shape = f"{name} {heads}x{rank}+{rope} {TYPES[dtype]}"
    return [compile_one(jit.latent_decode_kernel, common | dict(BLOCK_H=t.decode_h), pointers,
                        t.decode_warps, t.num_stages, arch, shape),
            compile_one(jit.latent_prefill_kernel, common | dict(BLOCK_T=t.block_t, BLOCK_H=t.block_h), pointers,
                        t.prefill_warps, t.num_stages, arch, shape)]


def gemm_reports(name: str, experts: int, h: int, i: int, rows: int, dtype: torch.dtype, arch: int,
                 gpt_oss: bool = False) -> list[Report]:
    """The grouped GEMM's two kernels; gpt_oss: with biases and the clamped SwiGLU."""
    from kernels import moe_triton

    t = gemm_tiles(rows, dtype, interpreted=False)
    ty = "*" + TYPES[dtype]
    pointers = {n: ty for n in ("x_ptr", "w_ptr", "h_ptr", "out_ptr", "bias_ptr")} | {"row_weight_ptr": "*fp32"}
    consts = dict(H=h, I=i, NUM_EXPERTS=experts, BLOCK_E=pow2(experts), BLOCK_M=t.block_m, BLOCK_N=t.block_n,
                  BLOCK_K=t.block_k, IEEE=dtype == torch.float32, HAS_BIAS=gpt_oss, CLAMPED=gpt_oss)
    shape = f"{name} {rows} rows/expert {TYPES[dtype]}{' bias+clamp' if gpt_oss else ''}"
    return [compile_one(fn, {k: v for k, v in consts.items() if k in fn.arg_names}, pointers, t.num_warps,
                        t.num_stages, arch, shape)
            for fn in (moe_triton._gate_up_kernel, moe_triton._down_kernel)]


def gating_reports(name: str, experts: int, top_k: int, nodes: int, dtype: torch.dtype, arch: int) -> list[Report]:
    """The gating kernels with and without a live-row count (a captured decode batch's padding)."""
    from kernels import moe_triton

    pointers = {"logits_ptr": "*" + TYPES[dtype], "ids_ptr": "*i64", "weights_ptr": "*fp32",
                "pair_order_ptr": "*i64", "pair_positions_ptr": "*i64", "expert_offsets_ptr": "*i64",
                "node_offsets_ptr": "*i64", "node_tokens_ptr": "*i64", "slots_ptr": "*i64"}
    reports = []
    for has_valid, buckets in ((False, 0), (True, 0), (True, REPLICA_BUCKETS)):
        shape = (f"{name} k={top_k}, {nodes} nodes{', padded' if has_valid else ''}"
                 f"{', replicas' if buckets else ''}")
        reports.append(compile_one(moe_triton._gating_kernel, dict(
            E=experts, K=top_k, RENORMALIZE=True, NUM_NODES=nodes, BLOCK_E=pow2(experts), BLOCK_K=pow2(top_k),
            HAS_VALID=has_valid, BUCKETS=buckets), pointers, 4, 1, arch, shape))
        if buckets:  # the scatter kernel is the same with or without replicas
            continue
        reports.append(compile_one(moe_triton._scatter_kernel, dict(
            K=top_k, NUM_NODES=nodes, BLOCK_K=pow2(top_k), HAS_VALID=has_valid), pointers, 4, 1, arch, shape))
    return reports


def fused_reports(name: str, hq: int, hkv: int, d: int, hidden: int, dtype: torch.dtype, arch: int,
                  layer_norm: bool = False) -> list[Report]:
    """The attention half's fused kernels: the residual add with its norm (RMSNorm, or DBRX's
    LayerNorm), the rotation with the KV write."""
    from kernels import norm_rope_triton as t

    ty = "*" + TYPES[dtype]
    norm = compile_one(t._add_rms_norm_kernel, dict(H=hidden, BLOCK=pow2(hidden), CENTER=layer_norm),
                       {n: ty for n in ("x_ptr", "res_ptr", "w_ptr", "out_ptr", "sum_ptr")}, 4, 1, arch,
                       f"{name} hidden {hidden} {TYPES[dtype]}{' layernorm' if layer_norm else ''}")
    rope = compile_one(t._rotary_store_kv_kernel,
                       dict(NUM_Q=hq, HEADS=hq + hkv, D=d, HALF=d // 2, HALF_PAD=pow2(d // 2), D_PAD=pow2(d)),
                       {n: ty for n in ("qk_ptr", "v_ptr", "cos_ptr", "sin_ptr", "k_cache_ptr", "v_cache_ptr",
                                        "out_ptr")} | {"pos_ptr": "*i64", "slot_ptr": "*i64"}, 1, 1, arch,
                       f"{name} {hq}/{hkv}x{d} {TYPES[dtype]}")
    return [norm, rope]


def all_reports(arch: int, quick: bool = False) -> list[Report]:
    """Every tile-table row at the shapes above. quick: the rows nearest a limit or that differ
    by architecture: the attention kernels at Qwen3's 16-head groups (POD with %smid, two
    programs per SM, in registers and shared memory) and at head dim 64 (prefill warps by
    arch), DeepSeek-V3's latent attention at TP 8 (a [16, 512] float32 accumulator per
    program), the GEMM's decode row (72 KiB: one program per SM on sm_86/89) and prefill row
    (96 KiB on sm_90, the most shared memory of any row), and gpt-oss's biased, clamped prefill
    row (two more accumulator-sized values live at the activation)."""
    if interpreted():
        raise RuntimeError("TRITON_INTERPRET=1 is set: the interpreter has no compiler; unset it to compile")
    if quick:
        return (attention_reports(*ATTENTION[2], torch.bfloat16, arch)
                + attention_reports(*ATTENTION[4], torch.bfloat16, arch)
                # gpt-oss's sinks with a window: its prefill comes nearest the register limit (252 on sm_90)
                + attention_reports(*GPT_OSS_ATTENTION, torch.bfloat16, arch, sinks=True, window=True)
                + latent_reports(*LATENT_ATTENTION[0], torch.bfloat16, arch)
                + gemm_reports(*EXPERTS[1], ROWS_PER_EXPERT[0], torch.bfloat16, arch)
                + gemm_reports(*EXPERTS[1], ROWS_PER_EXPERT[-1], torch.bfloat16, arch)
                + gemm_reports(*GPT_OSS_EXPERTS[1], ROWS_PER_EXPERT[-1], torch.bfloat16, arch, gpt_oss=True))
    reports = [r for shape in ATTENTION for r in attention_reports(*shape, torch.bfloat16, arch)]
    reports += attention_reports(*GPT_OSS_ATTENTION, torch.bfloat16, arch, sinks=True, window=True)
    reports += attention_reports(*GPT_OSS_ATTENTION, torch.bfloat16, arch, sinks=True)
    reports += attention_reports(*ATTENTION[0], torch.float32, arch)
    reports += [r for shape in LATENT_ATTENTION for r in latent_reports(*shape, torch.bfloat16, arch)]
    reports += latent_reports(*LATENT_ATTENTION[0], torch.float32, arch)
    reports += [r for e in EXPERTS for rows in ROWS_PER_EXPERT for r in gemm_reports(*e, rows, torch.bfloat16, arch)]
    reports += [r for e in GPT_OSS_EXPERTS for rows in ROWS_PER_EXPERT
                for r in gemm_reports(*e, rows, torch.bfloat16, arch, gpt_oss=True)]
    reports += gemm_reports(*EXPERTS[1], ROWS_PER_EXPERT[0], torch.float32, arch)
    reports += gating_reports("qwen3-235b", 128, 8, 32, torch.bfloat16, arch)
    reports += fused_reports("qwen3-235b tp4", 16, 1, 128, 4096, torch.bfloat16, arch)
    reports += fused_reports("mixtral-8x22b", 48, 8, 128, 6144, torch.bfloat16, arch)
    reports += fused_reports("dbrx", 48, 8, 128, 6144, torch.bfloat16, arch, layer_norm=True)
    return reports


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kernels.compile_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, nargs="+", default=[90],
                        help="compute capabilities x10, one or more (80: A100, 89: L40S, 90: H100)")
    parser.add_argument("--quick", action="store_true",
                        help="only the rows nearest a limit or that differ by architecture")
    args = parser.parse_args(argv)
    ok = True
    for arch in args.arch:
        reports = all_reports(arch, args.quick)
        print(f"sm_{arch} (shared memory: {SHARED_LIMIT.get(arch, 99 * 1024) // 1024} KiB per program at most)")
        print(f"{'kernel':16s} {'shape':34s} {'warps':>5s} {'regs':>5s} {'spilled B':>9s} {'shared KiB':>10s} "
              f"{'per SM':>6s}")
        for r in reports:
            print(f"{r.kernel:16s} {r.shape:34s} {r.num_warps:5d} {r.registers:5d} {r.spilled:9d} "
                  f"{r.shared / 1024:10.1f} {r.resident:6d}{'  reads %smid' if r.reads_smid else ''}"
                  f"{'' if r.ok else '  <- does not fit'}")
        ok = ok and all(r.ok for r in reports)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
