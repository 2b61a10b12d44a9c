"""The `kernels` check: every Triton kernel, called directly (never through the dispatch, so a
kernel that fails to build or launch is a failure, not a fallback), against float32 ground
truth at the shapes real models give it, in bf16, with the torch reference's own error beside
it. On the CPU: the same cases at small shapes in float32 under Triton's interpreter.

Real shapes (head dim 128, 16-token pages): attention heads of Mixtral-8x7B (32 query / 8 kv,
GQA 4), Mixtral-8x22B (48/8, GQA 6), Qwen3-30B-A3B (32/4, GQA 8) and Qwen3-235B-A22B (64/4,
GQA 16); contexts up to 32K; POD hybrid batches (64 decodes over 4K-16K beside a 2K chunk and a
512-token prompt) reading %smid; expert GEMMs of Qwen3-30B-A3B, Qwen3-235B-A22B and
Mixtral-8x22B from decode (4 tokens) to prefill (4096) sizes, and gpt-oss-20b's (biases, the
clamped SwiGLU, widths of 2880); DeepSeek-V3's latent attention at TP 8 (16 heads over a
512 + 64-wide [c | k_r] cache, contexts up to 32K, a hybrid batch); fused gating at Qwen3's routing shape; the attention half's
fused kernels (residual add + RMSNorm, rotary + KV write); and a step's hot path launched
without a host synchronisation."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import moe_ref
from kernels import paged_attention_ref as attention_ref
from kernels.paged_samples import PagedCache, batch_of, expected
from megainfer.tools.gpucheck.context import CheckContext


@dataclass(frozen=True)
class Heads:
    model: str
    q: int
    kv: int
    dim: int

    def __str__(self) -> str:
        return f"{self.model} {self.q}/{self.kv}x{self.dim}"


@dataclass(frozen=True)
class Experts:
    model: str
    count: int
    top_k: int
    hidden: int
    inter: int


@dataclass(frozen=True)
class Scale:
    dtype: torch.dtype
    heads: tuple[Heads, ...]
    page: int
    decode_lens: tuple[int, ...]
    prefill: tuple[tuple[int, ...], tuple[int, ...]]  # (chunks, lens)
    pod_decodes: int
    pod_context: tuple[int, int]  # decode contexts drawn from [lo, hi]
    pod_chunks: tuple[tuple[int, int], ...]  # (prefix, chunk) of each prefill beside the decodes
    experts: tuple[Experts, ...]
    gpt_oss_experts: tuple[Experts, ...]  # with biases and the clamped SwiGLU
    expert_tokens: tuple[int, ...]
    gating_tokens: int
    atol: float  # against float32 ground truth


REAL = Scale(
    dtype=torch.bfloat16,
    heads=(Heads("mixtral-8x7b", 32, 8, 128), Heads("mixtral-8x22b", 48, 8, 128), Heads("qwen3-30b-a3b", 32, 4, 128),
           Heads("qwen3-235b-a22b", 64, 4, 128)),
    page=16, decode_lens=(1, 17, 4096, 16384, 30001, 32768), prefill=((2048, 1024, 3000, 1), (2048, 16384, 32768, 9000)),
    pod_decodes=64, pod_context=(4096, 16384), pod_chunks=((8192, 2048), (0, 512)),
    experts=(Experts("qwen3-30b-a3b", 128, 8, 2048, 768), Experts("qwen3-235b-a22b", 128, 8, 4096, 1536),
             Experts("mixtral-8x22b", 8, 2, 6144, 16384)),
    gpt_oss_experts=(Experts("gpt-oss-20b", 32, 4, 2880, 2880),),
    expert_tokens=(4, 256, 4096), gating_tokens=4096, atol=2e-2)
SMALL = Scale(
    dtype=torch.float32, heads=(Heads("gqa4", 8, 2, 32), Heads("gqa16", 16, 1, 32)), page=16,
    decode_lens=(1, 17, 40), prefill=((9, 1), (30, 20)), pod_decodes=3, pod_context=(20, 40),
    pod_chunks=((16, 12),), experts=(Experts("tiny", 4, 2, 32, 48),),
    gpt_oss_experts=(Experts("tiny-gpt-oss", 4, 2, 40, 24),), expert_tokens=(4, 12), gating_tokens=16, atol=2e-4)


def _queries(n: int, hq: int, d: int, dtype: torch.dtype, device: torch.device, seed: int) -> torch.Tensor:
    """Queries doubled so attention over long contexts is peaked, not a flat average."""
    g = torch.Generator(device=device).manual_seed(seed)
    return (2 * torch.randn(n, hq, d, generator=g, device=device)).to(dtype)


def _errors(case, out: torch.Tensor, want: torch.Tensor, reference: torch.Tensor | None, atol: float) -> None:
    """Record the kernel's error (and the torch reference's) against `want`; fail beyond `atol`
    anywhere, or, where the reference ran, above twice its mean error (FlashAttention's bar)."""
    err = (out.float() - want).abs()
    case.figures |= {"max_abs_err": err.max().item(), "mean_abs_err": err.mean().item()}
    if reference is not None:
        case.figures["torch_mean_abs_err"] = (reference.float() - want).abs().mean().item()
    torch.testing.assert_close(out.float(), want, atol=atol, rtol=atol)
    if reference is not None:
        bar = 2 * case.figures["torch_mean_abs_err"] + 1e-4
        if case.figures["mean_abs_err"] > bar:
            raise AssertionError(f"mean error {case.figures['mean_abs_err']:.3g} exceeds twice the torch reference's "
                                 f"({bar:.3g})")


def _ptx_reads_smid(fn, device: torch.device) -> bool:
    """Whether any variant of a @triton.jit kernel compiled on `device` so far reads %smid."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    kernels = fn.device_caches[index][0].values() if hasattr(fn, "device_caches") else fn.cache[index].values()
    return any("%smid" in k.asm["ptx"] for k in kernels)


def check_decode(ctx: CheckContext, scale: Scale, heads: Heads) -> None:
    from kernels import attention_triton

    splits_tried = (None, 1, attention_triton.MAX_SPLITS)
    with ctx.case(f"decode {heads} contexts up to {max(scale.decode_lens)}") as case:
        cache = PagedCache(list(scale.decode_lens), scale.page, heads.kv, heads.dim, scale.dtype, seed=1,
                           device=ctx.device)
        q = _queries(len(scale.decode_lens), heads.q, heads.dim, scale.dtype, ctx.device, 1)
        sc = heads.dim ** -0.5
        want = expected(cache, q, list(range(len(scale.decode_lens) + 1)), sc)
        reference = attention_ref.decode_attention(q, cache.k, cache.v, cache.block_tables, cache.seq_lens, sc)
        for splits in splits_tried:
            out = attention_triton.decode_attention(q, cache.k, cache.v, cache.block_tables, cache.seq_lens, sc,
                                                    num_splits=splits, max_seq_len=max(scale.decode_lens))
            _errors(case, out, want, reference if ctx.on_gpu else None, scale.atol)
        case.detail = f"splits {', '.join(str(s) for s in splits_tried)} against float32 attention"


def check_prefill(ctx: CheckContext, scale: Scale, heads: Heads) -> None:
    from kernels import attention_triton

    chunks, lens = scale.prefill
    with ctx.case(f"prefill {heads} chunks {'/'.join(map(str, chunks))}") as case:
        cache = PagedCache(list(lens), scale.page, heads.kv, heads.dim, scale.dtype, seed=2, device=ctx.device)
        batch, starts = batch_of(cache, list(chunks))
        q = _queries(starts[-1], heads.q, heads.dim, scale.dtype, ctx.device, 2)
        sc = heads.dim ** -0.5
        out = attention_triton.prefill_attention(q, cache.k, cache.v, cache.block_tables, cache.seq_lens,
                                                 batch.query_start_loc, starts, sc)
        _errors(case, out, expected(cache, q, starts, sc), None, scale.atol)


def check_pod(ctx: CheckContext, scale: Scale, heads: Heads) -> None:
    """POD-Attention's regime: decodes beside prefill chunks in one launch, with and without split-KV."""
    from kernels import attention_jit, attention_triton

    lo, hi = scale.pod_context
    with ctx.case(f"pod {heads} {scale.pod_decodes} decodes + chunks "
                  f"{'/'.join(str(c) for _, c in scale.pod_chunks)}") as case:
        contexts = torch.randint(lo, hi + 1, (scale.pod_decodes,), generator=torch.Generator().manual_seed(3)).tolist()
        chunks = [1] * len(contexts) + [c for _, c in scale.pod_chunks]
        lens = contexts + [p + c for p, c in scale.pod_chunks]
        cache = PagedCache(lens, scale.page, heads.kv, heads.dim, scale.dtype, seed=3, device=ctx.device)
        batch, starts = batch_of(cache, chunks)
        q = _queries(starts[-1], heads.q, heads.dim, scale.dtype, ctx.device, 3)
        sc = heads.dim ** -0.5
        want = expected(cache, q, starts, sc)
        for splits in (None, 4):
            out = attention_triton.pod_attention(q, cache.k, cache.v, cache.block_tables, cache.seq_lens,
                                                 batch.query_start_loc, starts, batch.num_single, sc,
                                                 max_decode_len=max(contexts), num_splits=splits)
            _errors(case, out, want, None, scale.atol)
        if ctx.on_gpu:
            case.figures["reads_smid"] = _ptx_reads_smid(attention_jit.pod_kernel, ctx.device)
            if not case.figures["reads_smid"]:
                raise AssertionError("the POD kernel's PTX does not read %smid")


def check_pod_one_kind(ctx: CheckContext, scale: Scale, heads: Heads) -> None:
    from kernels import attention_triton

    lo, hi = scale.pod_context
    with ctx.case(f"pod {heads} decodes only, then one prefill only") as case:
        for seed, (chunks, lens) in enumerate((([1] * 8, [hi] * 8), ([hi // 4], [hi - hi // 4 + hi // 4]))):
            cache = PagedCache(lens, scale.page, heads.kv, heads.dim, scale.dtype, seed=4 + seed, device=ctx.device)
            batch, starts = batch_of(cache, chunks)
            q = _queries(starts[-1], heads.q, heads.dim, scale.dtype, ctx.device, 4 + seed)
            sc = heads.dim ** -0.5
            out = attention_triton.pod_attention(q, cache.k, cache.v, cache.block_tables, cache.seq_lens,
                                                 batch.query_start_loc, starts, batch.num_single, sc)
            _errors(case, out, expected(cache, q, starts, sc), None, scale.atol)


@dataclass(frozen=True)
class GptOssAttention:
    """gpt-oss's attention: a sink logit per query head on every layer, a sliding window on
    every other; pages of 16 tokens. Contexts longer than the window, prompts shorter than it,
    a chunk whose first query is past it; the block-table entries wholly before each window
    hold a placeholder (block 0), as the scheduler leaves them once it frees those blocks."""
    heads: Heads
    window: int
    decode_lens: tuple[int, ...]
    prefill: tuple[tuple[int, ...], tuple[int, ...]]  # (chunks, lens)
    pod: tuple[tuple[int, ...], tuple[int, ...]]  # (chunks, lens), the decodes first


GPT_OSS_REAL = GptOssAttention(
    heads=Heads("gpt-oss", 64, 8, 64), window=128, decode_lens=(1, 100, 128, 129, 4096, 32768),
    prefill=((2048, 512, 100, 1), (2048, 8192, 100, 4000)),
    pod=((1,) * 32 + (1024, 77), tuple(range(200, 200 + 32 * 500, 500)) + (1024 + 3000, 77)))
GPT_OSS_SMALL = GptOssAttention(
    heads=Heads("gpt-oss-like", 8, 2, 32), window=16, decode_lens=(1, 16, 17, 40),
    prefill=((30, 12, 1), (30, 52, 40)), pod=((1, 1, 1, 12), (20, 40, 5, 36)))


def _sinks(heads: Heads, device: torch.device) -> torch.Tensor:
    """Sink logits about as large as the doubled queries' scores, so they weigh in."""
    return 2 * torch.randn(heads.q, generator=torch.Generator(device=device).manual_seed(8), device=device)


def check_gpt_oss_attention(ctx: CheckContext, scale: Scale, shapes: GptOssAttention, windowed: bool) -> None:
    """The decode (splits None, 1 and 16), prefill and POD kernels with sinks, and the window
    where `windowed` (gpt-oss's sliding layers; its full layers have sinks alone), against
    float32 ground truth; on the GPU the torch reference's error beside the decode's."""
    from kernels import attention_triton

    heads, window = shapes.heads, shapes.window if windowed else 0
    label = f"{heads} sinks{f', window {window}' if window else ''}"
    sinks, sc = _sinks(heads, ctx.device), heads.dim ** -0.5
    with ctx.case(f"decode {label}, contexts up to {max(shapes.decode_lens)}") as case:
        lens = list(shapes.decode_lens)
        cache, case.figures["placeholders"], q, want = _gpt_oss_sample(ctx, scale, heads, lens, [1] * len(lens),
                                                                       sinks, window, 8)
        reference = attention_ref.decode_attention(q, cache.k, cache.v, cache.block_tables, cache.seq_lens, sc,
                                                   sinks, window) if ctx.on_gpu else None
        for splits in (None, 1, attention_triton.MAX_SPLITS):
            out = attention_triton.decode_attention(q, cache.k, cache.v, cache.block_tables, cache.seq_lens, sc,
                                                    num_splits=splits, max_seq_len=max(lens), sinks=sinks,
                                                    window=window)
            _errors(case, out, want, reference, scale.atol)
    chunks, lens = shapes.prefill
    with ctx.case(f"prefill {label}, chunks {'/'.join(map(str, chunks))} of {'/'.join(map(str, lens))}") as case:
        cache, case.figures["placeholders"], q, want = _gpt_oss_sample(ctx, scale, heads, lens, chunks, sinks,
                                                                       window, 9)
        batch, starts = batch_of(cache, list(chunks))
        out = attention_triton.prefill_attention(q, cache.k, cache.v, cache.block_tables, cache.seq_lens,
                                                 batch.query_start_loc, starts, sc, sinks=sinks, window=window)
        _errors(case, out, want, None, scale.atol)
    chunks, lens = shapes.pod
    decodes = chunks.count(1)
    with ctx.case(f"pod {label}, {decodes} decodes + chunks {'/'.join(map(str, chunks[decodes:]))}") as case:
        cache, case.figures["placeholders"], q, want = _gpt_oss_sample(ctx, scale, heads, lens, chunks, sinks,
                                                                       window, 10)
        batch, starts = batch_of(cache, list(chunks))
        for splits in (None, 4):
            out = attention_triton.pod_attention(q, cache.k, cache.v, cache.block_tables, cache.seq_lens,
                                                 batch.query_start_loc, starts, decodes, sc,
                                                 max_decode_len=max(lens[:decodes]), num_splits=splits, sinks=sinks,
                                                 window=window)
            _errors(case, out, want, None, scale.atol)


def _gpt_oss_sample(ctx: CheckContext, scale: Scale, heads: Heads, lens, chunks, sinks: torch.Tensor, window: int,
                    seed: int):
    """(a cache whose block-table entries before each window hold placeholders, how many do, the
    queries, their float32 attention read from the pages themselves)."""
    cache = PagedCache(list(lens), scale.page, heads.kv, heads.dim, scale.dtype, seed=seed, device=ctx.device)
    freed = cache.free_before_window(chunks, window) if window else 0
    starts = [0]
    for c in chunks:
        starts.append(starts[-1] + c)
    q = _queries(starts[-1], heads.q, heads.dim, scale.dtype, ctx.device, seed)
    return cache, freed, q, expected(cache, q, starts, heads.dim ** -0.5, sinks, window)


@dataclass(frozen=True)
class LatentShapes:
    """DeepSeek's latent attention (MLA, absorbed): heads per rank, latent and rotary widths, the
    softmax scale's head dim (nope + rope), decode contexts and a hybrid batch."""

    model: str
    heads: int
    rank: int
    rope: int
    qk_head_dim: int
    decode_lens: tuple[int, ...]
    hybrid: tuple[tuple[int, ...], tuple[int, ...]]  # (chunks, lens): decodes (1) first


LATENT_REAL = LatentShapes("deepseek-v3 tp8", 16, 512, 64, 192, (1, 17, 4096, 16384, 32768),
                           ((1,) * 32 + (2048, 512), tuple(range(300, 300 + 32 * 400, 400)) + (8192 + 2048, 512)))
LATENT_SMALL = LatentShapes("mla-like", 8, 32, 16, 24, (1, 17, 40), ((1, 1, 12, 30), (20, 40, 28, 30)))


def check_latent_attention(ctx: CheckContext, scale: Scale, shapes: LatentShapes) -> None:
    """The latent-attention kernels (decode with splits None, 1 and 16; a hybrid batch of decodes
    and prompt chunks) against float32 attention over the same [c | k_r] pages, the values their
    latent columns; on the GPU the torch reference's error beside the decode's."""
    from kernels import latent_attention_ref, latent_attention_triton

    label = f"{shapes.model} {shapes.heads}x{shapes.rank}+{shapes.rope}"
    sc = shapes.qk_head_dim ** -0.5
    for name, chunks, lens in (("decode", (1,) * len(shapes.decode_lens), shapes.decode_lens),
                               ("hybrid", *shapes.hybrid)):
        decodes = chunks.count(1)
        title = (f"latent decode {label}, contexts up to {max(lens)}" if name == "decode" else
                 f"latent hybrid {label}, {decodes} decodes + chunks {'/'.join(map(str, chunks[decodes:]))}")
        with ctx.case(title) as case:
            cache = PagedCache(list(lens), scale.page, 1, shapes.rank + shapes.rope, scale.dtype, seed=11,
                               device=ctx.device)
            cache.v = cache.k  # the values are the keys' latent columns
            batch, starts = batch_of(cache, list(chunks))
            q = _queries(starts[-1], shapes.heads, shapes.rank + shapes.rope, scale.dtype, ctx.device, 11)
            want = expected(cache, q, starts, sc)[..., :shapes.rank]
            reference = latent_attention_ref.latent_attention(q, cache.k, batch, sc, shapes.rank) \
                if ctx.on_gpu and name == "decode" else None
            for splits in ((None, 1, 16) if name == "decode" else (None, 4)):
                out = latent_attention_triton.latent_attention(
                    q, cache.k, batch.block_tables, batch.seq_lens, batch.query_start_loc, starts, decodes, sc,
                    shapes.rank, max_decode_len=max(lens[:decodes], default=0), num_splits=splits)
                _errors(case, out, want, reference, scale.atol)


def check_grouped_gemm(ctx: CheckContext, scale: Scale, experts: Experts, tokens: int) -> None:
    from kernels import moe_triton

    with ctx.case(f"grouped expert GEMM {experts.model} {tokens} tokens x top-{experts.top_k}") as case:
        g = torch.Generator(device=ctx.device).manual_seed(tokens)
        pairs = tokens * experts.top_k
        e, h, i = experts.count, experts.hidden, experts.inter
        x = torch.randn(pairs, h, generator=g, device=ctx.device).to(scale.dtype)
        w_gate_up = (torch.randn(e, 2 * i, h, generator=g, device=ctx.device) * h ** -0.5).to(scale.dtype)
        w_down = (torch.randn(e, h, i, generator=g, device=ctx.device) * i ** -0.5).to(scale.dtype)
        # Skewed routing (expert e drawn in proportion to e + 1) and an idle last expert.
        popularity = torch.arange(1, e + 1, dtype=torch.float32, device=ctx.device)
        popularity[-1] = 0
        ids = torch.multinomial(popularity, pairs, replacement=True, generator=g)
        counts = torch.bincount(ids, minlength=e).tolist()
        offsets = [0]
        for c in counts:
            offsets.append(offsets[-1] + c)
        weights = torch.rand(pairs, generator=g, device=ctx.device)
        out = moe_triton.grouped_expert_gemm(x, offsets, w_gate_up, w_down, weights)
        want = moe_ref._per_expert(x.float(), counts, w_gate_up.float(), w_down.float()) * weights[:, None]
        atol = 3e-2 if scale.dtype == torch.bfloat16 else scale.atol
        _errors(case, out, want, None, atol)
        on_device = moe_triton.grouped_expert_gemm(x, torch.tensor(offsets, device=ctx.device), w_gate_up, w_down,
                                                   weights)
        if not torch.equal(on_device, out):
            raise AssertionError("offsets on the device give another result than the same offsets from the host")


def check_gpt_oss_gemm(ctx: CheckContext, scale: Scale, experts: Experts, tokens: int) -> None:
    """gpt-oss's experts: per-expert biases and the clamped SwiGLU (alpha 1.702, limit 7), with
    gate and up pre-activations wide enough (std about 4) that the clamp binds; the torch
    reference in the same dtype beside it."""
    from kernels import moe_triton

    activation = moe_ref.ExpertActivation(alpha=1.702, limit=7.0)
    with ctx.case(f"grouped expert GEMM {experts.model} (biases, clamped SwiGLU) {tokens} tokens x "
                  f"top-{experts.top_k}") as case:
        g = torch.Generator(device=ctx.device).manual_seed(100 + tokens)
        pairs = tokens * experts.top_k
        e, h, i = experts.count, experts.hidden, experts.inter

        def randn(*shape, std=1.0):
            return (torch.randn(*shape, generator=g, device=ctx.device) * std).to(scale.dtype)

        x = randn(pairs, h)
        w_gate_up, gate_up_bias = randn(e, 2 * i, h, std=4 * h ** -0.5), randn(e, 2 * i)
        w_down, down_bias = randn(e, h, i, std=0.1 * i ** -0.5), randn(e, h)
        ids = torch.randint(0, e, (pairs,), generator=g, device=ctx.device)
        counts = torch.bincount(ids, minlength=e).tolist()
        offsets = [0]
        for c in counts:
            offsets.append(offsets[-1] + c)
        weights = torch.rand(pairs, generator=g, device=ctx.device)
        above = sum(int((x[a:b].float() @ w_gate_up[k, :i].float().T + gate_up_bias[k, :i].float()
                         > activation.limit).sum()) for k, (a, b) in enumerate(zip(offsets, offsets[1:])))
        case.figures["gate_above_limit"] = above / (pairs * i)  # the share of gate values the clamp cuts
        if not case.figures["gate_above_limit"]:
            raise AssertionError("no gate pre-activation exceeds the limit: the clamp is untested")
        variant = dict(activation=activation, gate_up_bias=gate_up_bias, down_bias=down_bias)
        out = moe_triton.grouped_expert_gemm(x, offsets, w_gate_up, w_down, weights, **variant)
        want = moe_ref._per_expert(x.float(), counts, w_gate_up.float(), w_down.float(), activation=activation,
                                   gate_up_bias=gate_up_bias.float(), down_bias=down_bias.float()) * weights[:, None]
        reference = moe_ref.grouped_expert_gemm(x, offsets, w_gate_up, w_down, weights, **variant)
        atol = 3e-2 if scale.dtype == torch.bfloat16 else scale.atol
        _errors(case, out, want, reference, atol)
        on_device = moe_triton.grouped_expert_gemm(x, torch.tensor(offsets, device=ctx.device), w_gate_up, w_down,
                                                   weights, **variant)
        if not torch.equal(on_device, out):
            raise AssertionError("offsets on the device give another result than the same offsets from the host")


def check_gating(ctx: CheckContext, scale: Scale, experts: Experts) -> None:
    from kernels import moe_triton

    with ctx.case(f"fused gating {experts.model} {scale.gating_tokens} tokens, 4 expert nodes") as case:
        g = torch.Generator(device=ctx.device).manual_seed(5)
        # bf16 logits differ by a bf16 step or not at all, so the two softmaxes cannot order a
        # near-tie differently; exact ties go to the lower id in both.
        logits = torch.randn(scale.gating_tokens, experts.count, generator=g, device=ctx.device).to(torch.bfloat16)
        node = torch.arange(experts.count, device=ctx.device) % 4
        out = moe_triton.fused_gating(logits, experts.top_k, True, node, 4)
        ref = moe_ref.fused_gating(logits, experts.top_k, True, node, 4)
        if not torch.equal(out.topk_ids, ref.topk_ids):
            raise AssertionError("top-k ids differ from the torch reference")
        torch.testing.assert_close(out.topk_weights, ref.topk_weights, atol=1e-5, rtol=1e-5)
        if not (torch.equal(out.expert_counts, ref.expert_counts) and torch.equal(out.node_counts, ref.node_counts)):
            raise AssertionError("expert or node counts differ from the torch reference")
        flat = out.topk_ids.flatten()
        if not torch.equal(flat[out.pair_order[out.pair_positions]], flat):
            raise AssertionError("pair_order and pair_positions are not inverse permutations")
        _check_node_tokens(out, node)
        case.figures["max_weight_err"] = (out.topk_weights - ref.topk_weights).abs().max().item()


def _check_node_tokens(gating, slot_node: torch.Tensor) -> None:
    """Each node's token list is the tokens with a pair on one of its slots (a slot is its
    expert where there are no replicas: `topk_slots` is then the ids)."""
    bounds = gating.node_offsets.tolist()
    for n in range(len(bounds) - 1):
        sent = gating.node_token_ids[bounds[n]:bounds[n + 1]].sort().values
        if not torch.equal(sent, (slot_node[gating.topk_slots] == n).any(1).nonzero().flatten()):
            raise AssertionError(f"node {n}'s token list differs from the tokens routed to it")


def check_replica_gating(ctx: CheckContext, scale: Scale, experts: Experts) -> None:
    """Gating with a slot table (hot experts held twice, megainfer/expert_replicas.py): each pair's
    slot and each node's tokens as the reference picks them."""
    from kernels import REPLICA_BUCKETS, moe_triton

    with ctx.case(f"fused gating with replica slots {experts.model} {scale.gating_tokens} tokens, 4 expert nodes") \
            as case:
        g = torch.Generator(device=ctx.device).manual_seed(6)
        logits = torch.randn(scale.gating_tokens, experts.count, generator=g, device=ctx.device).to(torch.bfloat16)
        per = experts.count // 4
        room = per + 1  # each node one spare slot: experts 0..3 get a second replica on the next node
        slot_node = torch.arange(4 * room, device=ctx.device) // room
        table = (torch.arange(experts.count, device=ctx.device) // per * room
                 + torch.arange(experts.count, device=ctx.device) % per)[:, None].repeat(1, REPLICA_BUCKETS)
        for e in range(4):
            table[e, 1::2] = ((e + 1) % 4) * room + per  # expert e (< 4) also on node e + 1, in its spare slot
        table = table.to(torch.int32)
        out = moe_triton.fused_gating(logits, experts.top_k, True, slot_node, 4, None, table)
        ref = moe_ref.fused_gating(logits, experts.top_k, True, slot_node, 4, None, table)
        if not (torch.equal(out.topk_ids, ref.topk_ids) and torch.equal(out.topk_slots, ref.topk_slots)):
            raise AssertionError("top-k ids or their slots differ from the torch reference")
        if not torch.equal(out.node_counts, ref.node_counts):
            raise AssertionError("node counts differ from the torch reference")
        _check_node_tokens(out, slot_node)
        case.figures["replica_pairs"] = int((out.topk_slots % room == per).sum().item())


def check_fused(ctx: CheckContext, scale: Scale, heads: Heads, hidden: int) -> None:
    """The attention half's fused kernels against their float32 ground truth, the references beside."""
    from kernels import norm_rope_ref, norm_rope_triton
    from megainfer.model.rotary import RotaryEmbedding

    tokens = 512 if ctx.on_gpu else 9
    g = torch.Generator(device=ctx.device).manual_seed(7)
    for norm in ("rms", "layer"):  # Mixtral's and Qwen3's RMSNorm, DBRX's bias-free LayerNorm
        name = "RMSNorm" if norm == "rms" else "LayerNorm (DBRX)"
        ref_fn, triton_fn = ((norm_rope_ref.add_rms_norm, norm_rope_triton.add_rms_norm) if norm == "rms" else
                             (norm_rope_ref.add_layer_norm, norm_rope_triton.add_layer_norm))
        with ctx.case(f"residual add + {name}, {tokens} tokens x {hidden}") as case:
            x, res = (torch.randn(tokens, hidden, generator=g, device=ctx.device) + 1.0 for _ in range(2))
            weight = torch.rand(hidden, generator=g, device=ctx.device)
            want = ref_fn(x, res, weight, 1e-5)[0]
            low = [t.to(scale.dtype) for t in (x, res, weight)]
            _errors(case, triton_fn(*low, 1e-5)[0], want, ref_fn(*low, 1e-5)[0], scale.atol)
    with ctx.case(f"rotary + KV write {heads}, {tokens} tokens") as case:
        qk = torch.randn(tokens, heads.q + heads.kv, heads.dim, generator=g, device=ctx.device)
        v = torch.randn(tokens, heads.kv, heads.dim, generator=g, device=ctx.device)
        positions = torch.randint(0, 32768, (tokens,), generator=g, device=ctx.device)
        slots = torch.randperm(tokens * 2, generator=g, device=ctx.device)[:tokens]
        caches = [torch.zeros(-(-tokens * 2 // scale.page), scale.page, heads.kv, heads.dim, device=ctx.device)
                  for _ in range(2)]
        exact = RotaryEmbedding(heads.dim, 1e6, 32768, torch.float32, ctx.device)
        want = norm_rope_ref.rotary_store_kv(qk, v, positions, exact.cos, exact.sin, *caches, slots, heads.q)
        rotary = RotaryEmbedding(heads.dim, 1e6, 32768, scale.dtype, ctx.device)
        low = [[c.to(scale.dtype) for c in caches] for _ in range(2)]
        ref = norm_rope_ref.rotary_store_kv(qk.to(scale.dtype), v.to(scale.dtype), positions, rotary.cos, rotary.sin,
                                            *low[0], slots, heads.q)
        out = norm_rope_triton.rotary_store_kv(qk.to(scale.dtype), v.to(scale.dtype), positions, rotary.cos,
                                               rotary.sin, *low[1], slots, heads.q)
        _errors(case, out, want, ref, scale.atol)
        torch.testing.assert_close(low[1][0].float(), caches[0], atol=scale.atol, rtol=scale.atol)
        if not torch.equal(low[1][1], low[0][1]):
            raise AssertionError("the values written to the cache differ from the reference's")


def check_smid_folds(ctx: CheckContext) -> None:
    import triton
    import triton.language as tl

    from kernels import attention_jit

    @triton.jit
    def record_sm(out_ptr, NUM_SMS: tl.constexpr):
        pid = tl.program_id(0)
        tl.store(out_ptr + pid, attention_jit._sm_id(pid, NUM_SMS, True))

    with ctx.case("%smid folds into the per-SM counters") as case:
        sms = torch.cuda.get_device_properties(ctx.device).multi_processor_count
        out = torch.full((8 * sms,), -1, dtype=torch.int32, device=ctx.device)
        record_sm[(8 * sms,)](out, NUM_SMS=sms)
        ids = out.unique()
        case.figures |= {"sms": sms, "distinct_sms_seen": ids.numel()}
        if not (ids.min().item() >= 0 and ids.max().item() < sms and ids.numel() > 1):
            raise AssertionError(f"SM ids {ids.min().item()}..{ids.max().item()} over {ids.numel()} distinct, want "
                                 f"several in [0, {sms})")
        record_sm[(8 * sms,)](out, NUM_SMS=7)
        if not (out.min().item() >= 0 and out.max().item() < 7):
            raise AssertionError("with 7 counters, SM ids did not fold into [0, 7)")


def check_hot_path(ctx: CheckContext, scale: Scale) -> None:
    """POD attention, fused gating and the grouped GEMM queue a step's work without waiting for the
    GPU: torch's sync debug mode raises on any synchronising call."""
    from kernels import attention_triton, moe_triton

    heads, experts = scale.heads[-1], scale.experts[0]
    with ctx.case(f"a step's hot path without host synchronisation ({heads}, {experts.model})"):
        cache = PagedCache([8192] * 16 + [4096 + 1024], scale.page, heads.kv, heads.dim, scale.dtype, seed=6,
                           device=ctx.device)
        batch, starts = batch_of(cache, [1] * 16 + [1024])
        q = _queries(starts[-1], heads.q, heads.dim, scale.dtype, ctx.device, 6)
        hidden = torch.randn(256, experts.hidden, device=ctx.device).to(scale.dtype)
        logits = torch.randn(256, experts.count, device=ctx.device).to(scale.dtype)
        node = torch.arange(experts.count, device=ctx.device) % 4
        w_gate_up = (torch.randn(experts.count, 2 * experts.inter, experts.hidden, device=ctx.device) * 0.02).to(
            scale.dtype)
        w_down = (torch.randn(experts.count, experts.hidden, experts.inter, device=ctx.device) * 0.02).to(scale.dtype)

        def step():
            plan = attention_triton.plan_pod(q, cache.k, cache.block_tables, starts, batch.num_single, 8192)
            attention_triton.pod_attention(q, cache.k, cache.v, cache.block_tables, cache.seq_lens,
                                           batch.query_start_loc, starts, batch.num_single, heads.dim ** -0.5,
                                           plan=plan)
            gating = moe_triton.fused_gating(logits, experts.top_k, True, node, 4)
            rows = hidden[gating.pair_order // experts.top_k]
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


def run(ctx: CheckContext) -> None:
    scale = REAL if ctx.on_gpu else SMALL
    for heads in scale.heads:
        check_decode(ctx, scale, heads)
        check_pod(ctx, scale, heads)
        check_prefill(ctx, scale, heads)
    check_pod_one_kind(ctx, scale, scale.heads[-1])
    for windowed in ((True, False) if ctx.on_gpu else (True,)):  # the interpreter: the window's, with sinks
        check_gpt_oss_attention(ctx, scale, GPT_OSS_REAL if ctx.on_gpu else GPT_OSS_SMALL, windowed)
    check_latent_attention(ctx, scale, LATENT_REAL if ctx.on_gpu else LATENT_SMALL)
    for experts in scale.experts:
        for tokens in scale.expert_tokens:
            check_grouped_gemm(ctx, scale, experts, tokens)
    for experts in scale.gpt_oss_experts:
        for tokens in scale.expert_tokens:
            check_gpt_oss_gemm(ctx, scale, experts, tokens)
    check_gating(ctx, scale, scale.experts[0])
    check_replica_gating(ctx, scale, scale.experts[0])
    check_fused(ctx, scale, scale.heads[-1], scale.experts[1].hidden if ctx.on_gpu else scale.experts[0].hidden)
    if ctx.on_gpu:
        check_smid_folds(ctx)
        check_hot_path(ctx, scale)
