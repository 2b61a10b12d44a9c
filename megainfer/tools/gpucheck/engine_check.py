"""The `engine` check: megainfer's colocated engine against transformers on the same device,
from the same tiny checkpoints (`tiny_checkpoints.py`). float32: the greedy tokens are equal and
the logits agree. bfloat16: each implementation's greedy tokens leave float32's where rounding
moves them, and megainfer's may not do so clearly (float32 preferring its own pick by more than
a near-tie) more often than transformers' own bfloat16 does, give or take one prompt; measured
against float32 along the same contexts, megainfer's logits are as faithful as transformers'
bfloat16 ones. Then the shipped demo model on the device against the CPU, which needs no
transformers.

On CUDA the engine runs the compiled Triton kernels, forced (MEGAINFER_KERNELS=triton, set by
the runner): a kernel that cannot run fails the check instead of falling back."""

from __future__ import annotations

import gc
import math
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from megainfer.tools.gpucheck.context import CheckContext
from megainfer.tools.gpucheck.tiny_checkpoints import KINDS, tiny_prompts, write_tiny_checkpoint

NEW_TOKENS = 32  # greedy tokens per prompt
NUM_KV_BLOCKS = 64  # the prompts need at most 25 blocks of 16 tokens
# float32: the two only sum in different orders (cuBLAS against Triton's IEEE dots; TF32 off).
FLOAT32_LOGIT_ATOL = 1e-3
# bfloat16: where the two part, float32's logits (along the shared context) for the two
# candidates are at most this far apart, or float32 prefers megainfer's pick. The logits here spread with a std of ~1.6, their two best are ~0.35 apart at the
# median, and bfloat16 moves them by up to ~0.27 between the two implementations (measured on
# the CPU, where the partings came at gaps of one bfloat16 ulp, 0.03). On the H200 (2026-11-27)
# transformers' bfloat16 parted from megainfer's Mixtral at a gap of 3.25 in its own logits: judged
# by transformers' bfloat16, a routing flip on its side failed the check.
BFLOAT16_NEAR_TIE = 0.25
# A clear miss: where an implementation's bfloat16 greedy tokens first leave float32's and float32
# preferred its own pick by more than BFLOAT16_NEAR_TIE. Rounding makes them too: one expert
# routed differently at a near-tie of the router moves every later logit by whole units, and
# which side meets such a tie is luck (on the CPU, 2026-11-28, gpt-oss's megainfer bfloat16 parted
# from transformers' at float32 margins of 1.7 and 0.41 with a mean logit error 7% below
# transformers'). So megainfer may miss clearly as often as transformers' bfloat16, plus this many.
BFLOAT16_EXTRA_MISSES = 1
# bfloat16: megainfer's mean |logit error| against float32 may exceed transformers' by this
# factor on the same contexts (0.96-0.99 on the CPU; logits unrelated to the model are ~1.8 off, 18-70x).
BFLOAT16_ERROR_RATIO = 1.5


@dataclass
class Greedy:
    tokens: list[list[int]]  # per prompt, the greedy ids
    logits: list[torch.Tensor]  # per prompt, [tokens, vocab] float32 on the CPU: what chose each token


def load_transformers(path, dtype: str, device: str):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to(device).eval()


def transformers_greedy(path, prompts: list[list[int]], dtype: str, device: str, new_tokens: int = NEW_TOKENS) -> Greedy:
    model = load_transformers(path, dtype, device)
    tokens, logits = [], []
    for prompt in prompts:
        out = model.generate(torch.tensor([prompt], device=device), max_new_tokens=new_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=0, return_dict_in_generate=True, output_logits=True)
        tokens.append(out.sequences[0, len(prompt):].tolist())
        logits.append(torch.cat(out.logits).float().cpu())
    return Greedy(tokens, logits)


@torch.no_grad()
def transformers_forced(path, prompts: list[list[int]], tokens: list[list[int]], dtype: str,
                        device: str) -> list[torch.Tensor]:
    """transformers' logits for the contexts `tokens` were chosen in: [len(tokens), vocab] per prompt."""
    model = load_transformers(path, dtype, device)
    out = []
    for prompt, generated in zip(prompts, tokens, strict=True):
        context = torch.tensor([prompt + generated[:-1]], device=device)
        out.append(model(context).logits[0, len(prompt) - 1:].float().cpu())
    return out


@contextmanager
def recorded_logits():
    """Records, per request id, the logits the colocated engine samples from (the engine's own,
    unchanged): every path of its sampler (the one-argmax path of greedy-only rows too) is
    reached through `model_runner.sample_tokens`."""
    from megainfer.runner import model_runner

    seen: dict[str, list[torch.Tensor]] = {}
    original = model_runner.sample_tokens

    def recording(sampler, logits, seqs, layout):
        for row, sequence in enumerate(layout.sampled_sequences):
            seen.setdefault(seqs[sequence].request_id, []).append(logits[row].float().cpu())
        return original(sampler, logits, seqs, layout)

    model_runner.sample_tokens = recording
    try:
        yield seen
    finally:
        model_runner.sample_tokens = original


def megainfer_greedy(path, prompts: list[list[int]], dtype: str, device: str, new_tokens: int = NEW_TOKENS) -> Greedy:
    """All prompts in one batch, as the engine serves them; logits recorded where the sampler reads them."""
    from megainfer import LLM, SamplingParams
    from megainfer.request_group import engine_request_id

    with recorded_logits() as seen:
        llm = LLM(str(path), dtype=dtype, device=device, num_kv_blocks=NUM_KV_BLOCKS)
        outs = llm.generate(prompts, SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True),
                            use_tqdm=False)
    # Recorded by engine request: each prompt's one completion (megainfer/request_group.py).
    return Greedy([o.outputs[0].token_ids for o in outs],
                  [torch.stack(seen[engine_request_id(o.request_id, 0)]) for o in outs])


def first_disagreement(ours: Greedy, ref: Greedy, logit_atol: float, near_tie: float) -> str:
    """"" where `ours` matches `ref` up to rounding, else what differs first.

    Each prompt is walked step by step while both chose the same tokens, the step where they
    part included (both saw the same context there): every logit within `logit_atol`, and a
    choice of its own only where `ref`'s logits for the two candidates are within `near_tie`.
    After a parting the contexts differ, so later steps are not compared."""
    for i, (our_tokens, ref_tokens) in enumerate(zip(ours.tokens, ref.tokens, strict=True)):
        if len(our_tokens) != len(ref_tokens):
            return f"prompt {i}: {len(our_tokens)} tokens, transformers {len(ref_tokens)}"
        for step, (mine, theirs) in enumerate(zip(our_tokens, ref_tokens)):
            diff = (ours.logits[i][step] - ref.logits[i][step]).abs().max().item()
            if diff > logit_atol:
                return f"prompt {i} step {step}: logits differ by up to {diff:.3g} (allowed {logit_atol:g})"
            if mine != theirs:
                margin = (ref.logits[i][step][theirs] - ref.logits[i][step][mine]).item()
                if margin > near_tie:
                    return (f"prompt {i} step {step}: chose {mine}, transformers {theirs}, whose logit is "
                            f"higher by {margin:.3g} (a near-tie is at most {near_tie:g})")
                break  # a near-tie parted them: the contexts differ from here on
    return ""


def mean_error(logits: list[torch.Tensor], truth: list[torch.Tensor]) -> float:
    """Mean |logit - truth| over every prompt, step and vocabulary entry."""
    return torch.cat([(a - b).abs().flatten() for a, b in zip(logits, truth, strict=True)]).mean().item()


def equal_tokens(ours: Greedy, ref: Greedy) -> float:
    """The share of positions where the two chose the same token."""
    pairs = [(a, b) for x, y in zip(ours.tokens, ref.tokens) for a, b in zip(x, y)]
    return sum(a == b for a, b in pairs) / max(len(pairs), 1)


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


@contextmanager
def kernels_chosen_per_shape():
    """MEGAINFER_KERNELS unset for the block (the runner forces Triton on CUDA, which a CPU engine
    cannot run, and which an engine timed per shape does not)."""
    import os

    from kernels import dispatch

    forced = os.environ.pop(dispatch.ENV, None)
    try:
        yield
    finally:
        if forced is not None:
            os.environ[dispatch.ENV] = forced


@contextmanager
def highest_float32_precision():
    """transformers' float32 matmuls in full IEEE precision (no TF32), as megainfer's are."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


def check_float32(ctx: CheckContext, path: Path, kind: str, prompts: list[list[int]]) -> Greedy | None:
    """The case; returns transformers' float32 greedy run (None where the case failed before it),
    which the bfloat16 case judges by."""
    device = ctx.device.type
    ref = None
    with ctx.case(f"{kind} float32: greedy tokens and logits equal to transformers") as case, \
            highest_float32_precision():
        ref = transformers_greedy(path, prompts, "float32", device)
        free_memory(ctx.device)
        ours = megainfer_greedy(path, prompts, "float32", device)
        free_memory(ctx.device)
        case.figures["equal_tokens"] = equal_tokens(ours, ref)
        case.figures["max_logit_diff"] = max((a - b).abs().max().item() for a, b in zip(ours.logits, ref.logits)
                                             if a.shape == b.shape)
        if ours.tokens != ref.tokens:
            raise AssertionError(f"tokens differ: {first_disagreement(ours, ref, math.inf, 0.0)}")
        problem = first_disagreement(ours, ref, FLOAT32_LOGIT_ATOL, near_tie=0.0)
        if problem:
            raise AssertionError(problem)
    return ref


def bfloat16_partings(ours: Greedy, ref: Greedy, truth: list[torch.Tensor]) -> dict:
    """Where megainfer's and transformers' bfloat16 tokens part, what float32 (`truth`, along the
    shared context) and transformers' bfloat16 say about the two candidates: figures for the
    record (which side rounding moved is `bfloat16_misses`' to judge)."""
    figures = {"partings": 0, "worst_float32_margin": 0.0, "worst_bfloat16_margin": 0.0}
    for i, (our_tokens, ref_tokens) in enumerate(zip(ours.tokens, ref.tokens, strict=True)):
        for step, (mine, theirs) in enumerate(zip(our_tokens, ref_tokens)):
            if mine == theirs:
                continue
            float32_margin = (truth[i][step][theirs] - truth[i][step][mine]).item()
            bfloat16_margin = (ref.logits[i][step][theirs] - ref.logits[i][step][mine]).item()
            figures["partings"] += 1
            figures["worst_float32_margin"] = max(figures["worst_float32_margin"], float32_margin)
            figures["worst_bfloat16_margin"] = max(figures["worst_bfloat16_margin"], bfloat16_margin)
            break  # the contexts differ from here on
    return figures


def clear_misses(bfloat16: Greedy, float32: Greedy, near_tie: float) -> list[str]:
    """Each prompt's first step where `bfloat16`'s greedy token leaves `float32`'s and float32's
    logits (its own, along the context the two still share there) prefer float32's pick by more
    than `near_tie`."""
    misses = []
    for i, (tokens, truth) in enumerate(zip(bfloat16.tokens, float32.tokens, strict=True)):
        for step, (mine, theirs) in enumerate(zip(tokens, truth)):
            if mine != theirs:
                margin = (float32.logits[i][step][theirs] - float32.logits[i][step][mine]).item()
                if margin > near_tie:
                    misses.append(f"prompt {i} step {step}: chose {mine}, float32 {theirs} by {margin:.3g}")
                break  # the contexts differ from here on
    return misses


def bfloat16_misses(ours: Greedy, ref: Greedy, float32: Greedy, near_tie: float = BFLOAT16_NEAR_TIE,
                    extra: int = BFLOAT16_EXTRA_MISSES) -> tuple[dict, str]:
    """megainfer's (`ours`) and transformers' (`ref`) bfloat16 clear misses of `float32`'s greedy
    tokens: the figures, and what is wrong where megainfer's exceed transformers' by more than
    `extra` ("" where they do not)."""
    ours_misses, their_misses = clear_misses(ours, float32, near_tie), clear_misses(ref, float32, near_tie)
    figures = {"clear_misses": len(ours_misses), "transformers_clear_misses": len(their_misses)}
    if len(ours_misses) <= len(their_misses) + extra:
        return figures, ""
    return figures, (f"megainfer's bfloat16 tokens clearly left float32's in {len(ours_misses)} of "
                     f"{len(ours.tokens)} prompts, transformers' in {len(their_misses)} (allowed {extra} more); "
                     f"first: {ours_misses[0]}")


def check_bfloat16(ctx: CheckContext, path: Path, kind: str, prompts: list[list[int]],
                   float32: Greedy | None) -> None:
    """`float32`: transformers' float32 greedy run of the same prompts (the float32 case's), or None
    to make it here."""
    device = ctx.device.type
    with ctx.case(f"{kind} bfloat16: agrees with transformers up to rounding") as case, highest_float32_precision():
        ref = transformers_greedy(path, prompts, "bfloat16", device)
        if float32 is None:
            float32 = transformers_greedy(path, prompts, "float32", device)
        free_memory(ctx.device)
        ours = megainfer_greedy(path, prompts, "bfloat16", device)
        free_memory(ctx.device)
        case.figures["equal_tokens"] = equal_tokens(ours, ref)
        truth = transformers_forced(path, prompts, ours.tokens, "float32", device)
        theirs = transformers_forced(path, prompts, ours.tokens, "bfloat16", device)
        free_memory(ctx.device)
        ours_error, their_error = mean_error(ours.logits, truth), mean_error(theirs, truth)
        case.figures |= {"megainfer_error": ours_error, "transformers_error": their_error,
                         "error_ratio": ours_error / their_error if their_error else None}
        # Rounding moves single logits too far for a per-logit bound (a token routed to other
        # experts), so the tokens are judged by their misses of float32's and the logits by their
        # mean error below.
        misses, problem = bfloat16_misses(ours, ref, float32)
        case.figures |= bfloat16_partings(ours, ref, truth) | misses
        if problem:
            raise AssertionError(problem)
        if not 0 < ours_error <= BFLOAT16_ERROR_RATIO * their_error:
            raise AssertionError(f"megainfer's bfloat16 logits are off float32 by {ours_error:.4f} on average, "
                                 f"transformers' by {their_error:.4f} (allowed {BFLOAT16_ERROR_RATIO}x)")


def check_demo(ctx: CheckContext) -> None:
    """The shipped demo model on the device, float32, against the CPU engine (no transformers needed)."""
    from megainfer.model_resolution import DEMO_MODEL

    prompts = [[0, 5, 9, 14], [0, 77, 3]]
    with ctx.case(f"{DEMO_MODEL} float32 on {ctx.device.type}: greedy tokens equal to the CPU engine's") as case, \
            highest_float32_precision():
        ours = megainfer_greedy(DEMO_MODEL, prompts, "float32", ctx.device.type, new_tokens=16)
        case.figures["tokens"] = sum(len(t) for t in ours.tokens)
        if ctx.on_gpu:
            with kernels_chosen_per_shape():
                cpu = megainfer_greedy(DEMO_MODEL, prompts, "float32", "cpu", new_tokens=16)
            case.figures["equal_tokens"] = equal_tokens(ours, cpu)
            if ours.tokens != cpu.tokens:
                raise AssertionError(f"tokens differ from the CPU engine's: {ours.tokens} vs {cpu.tokens}")
        else:
            case.detail = "on the CPU this only shows the engine runs here"
        free_memory(ctx.device)


def check_no_build_while_serving(ctx: CheckContext) -> None:
    """The engine warms its kernels up at start (timed per shape, MEGAINFER_KERNELS unset): serving
    prompts of many lengths afterwards builds no Triton variant and times nothing."""
    from kernels import dispatch
    from kernels.compile_watch import WATCH
    from megainfer import LLM, SamplingParams
    from megainfer.model_resolution import DEMO_MODEL

    with ctx.case(f"{DEMO_MODEL} bfloat16: kernels decided at start, none built while serving") as case:
        if not ctx.on_gpu:
            case.skip("no CUDA device: nothing compiles on the CPU")
            return
        with kernels_chosen_per_shape():
            llm = LLM(DEMO_MODEL, dtype="bfloat16", device="cuda", max_num_seqs=64, max_num_batched_tokens=512)
            before = WATCH.built_while_serving  # earlier engines of this process are not this one's
            report = llm.engine.runner.kernels
            case.figures |= {"mode": report.mode, "warm_up_s": round(report.seconds, 2), "built_at_start": report.built}
            for op, counts in report.by_operator().items():
                case.figures[op] = ", ".join(f"{impl} {n}" for impl, n in sorted(counts.items()))
            prompts = [[0, *range(3, 3 + n)] for n in (1, 7, 30, 120, 400)]
            llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
            built = WATCH.built_while_serving - before
            case.figures |= {"built_while_serving": built, "shapes_met_while_serving": dispatch.shapes_met_while_serving()}
        if not WATCH.installed:
            raise AssertionError("Triton's JIT cache hook is not installed: builds cannot be counted here")
        if report.mode != dispatch.FASTEST or not report.decisions:
            raise AssertionError(f"the dispatch ran in mode {report.mode!r} with {len(report.decisions)} shapes "
                                 "decided, not timed per shape")
        if built:
            raise AssertionError(f"{built} Triton variant(s) built while serving: {WATCH.last_while_serving}")
        free_memory(ctx.device)


def run(ctx: CheckContext) -> None:
    try:
        import transformers  # noqa: F401
        missing = ""
    except ImportError as exc:
        missing = f"transformers cannot be imported here ({exc})"
    prompts = tiny_prompts()
    with tempfile.TemporaryDirectory(prefix="gpucheck-") as tmp:
        for kind in KINDS:
            if missing:
                for dtype in ("float32", "bfloat16"):
                    with ctx.case(f"{kind} {dtype} against transformers") as case:
                        case.skip(missing)
                continue
            path = Path(tmp) / kind
            write_tiny_checkpoint(kind, path)
            check_bfloat16(ctx, path, kind, prompts, check_float32(ctx, path, kind, prompts))
    check_demo(ctx)
    check_no_build_while_serving(ctx)
