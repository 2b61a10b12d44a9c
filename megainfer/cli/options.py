"""Argument types and option groups shared by several subcommands."""

from __future__ import annotations

import argparse


MAX_LAYER_GROUPS_HELP = ("layered: G from --group-tokens but at most this many, each cohort filling 8,192 prompt "
                         "tokens (the layered-prefill paper's --num-stages)")
GROUP_TABLE_HELP = ("layered, with --max-layer-groups: a cohort's groups by its tokens, TOKENS:G rows rising, "
                    "--max-layer-groups above the last (the paper's engine at --num-stages 16: "
                    "512:1,1024:2,2048:4,4096:8); default ceil(tokens / --group-tokens)")
FILL_COHORTS_HELP = ("layered: cut any prompt so that every cohort fills its 8,192 tokens, the rest of a cut prompt "
                     "leading the next cohort (the paper's engine); default: only a cohort's first prompt is cut")


def length_range(text: str) -> tuple[int, int]:
    """'A:B' (or 'A') -> (A, B) with 1 <= A <= B."""
    parts = text.split(":")
    try:
        lo, hi = (int(parts[0]), int(parts[-1])) if len(parts) in (1, 2) else (0, -1)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a length range; write A:B, e.g. 32:256") from None
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"{text!r}: need 1 <= A <= B in A:B")
    return lo, hi


def group_table(text: str) -> tuple[tuple[int, int], ...]:
    """'512:1,1024:2' -> ((512, 1), (1024, 2)); EngineConfig checks the rows rise."""
    try:
        return tuple((int(t), int(g)) for t, g in (row.split(":") for row in text.split(",")))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a group table; write TOKENS:G rows, e.g. "
                                         "512:1,1024:2,2048:4,4096:8") from None


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be positive")
    return value


def gpu_memory_utilization(text: str) -> float:
    """A share of the GPU's total memory, 0 < u <= 1 (vLLM's --gpu-memory-utilization)."""
    from megainfer.config import check_gpu_memory_utilization

    try:
        return check_gpu_memory_utilization(float(text), "--gpu-memory-utilization", argparse.ArgumentTypeError)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None


def add_engine_options(parser: argparse.ArgumentParser) -> None:
    """Model and engine knobs, mapped onto EngineConfig by `engine_config`."""
    parser.add_argument("--model", default="tiny-mixtral",
                        help="checkpoint directory, Hugging Face repo id in the local cache (org/name[@revision]; "
                             "never downloaded), megainfer-demo, or a preset name")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help="auto (default): the checkpoint's torch_dtype, float32 for presets; a bfloat16 "
                             "checkpoint runs in bfloat16 on the CPU too (pass --dtype float32 there for speed "
                             "on CPUs without bfloat16 support)")
    parser.add_argument("--device", default="auto", help="auto (default: cuda if torch sees a GPU, else cpu), "
                                                         "cpu, cuda or cuda:N")
    parser.add_argument("--max-model-len", type=positive_int, default=None,
                        help="prompt plus generated tokens per request, at most (default: the model's "
                             "max_position_embeddings; it cannot exceed it)")
    parser.add_argument("--seed", type=int, default=0, help="weights (presets) and sampling seed")
    parser.add_argument("--block-size", type=positive_int, default=16, help="tokens per KV block")
    parser.add_argument("--num-kv-blocks", type=positive_int, default=None,
                        help="KV-cache blocks (default: sized from memory)")
    parser.add_argument("--gpu-memory-utilization", type=gpu_memory_utilization, default=0.9,
                        help="share of the GPU's total memory this process may use, 0 < u <= 1 (default 0.9, as "
                             "vLLM): weights, activations and KV cache together; the KV cache gets what a profiling "
                             "step at the largest batch leaves. Ignored on the CPU (a 2 GiB KV cache)")
    parser.add_argument("--max-num-seqs", type=positive_int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=positive_int, default=512,
                        help="token budget per step (chunked-prefill chunk size)")
    parser.add_argument("--threads", type=positive_int, default=None, help="CPU threads for torch")
    parser.add_argument("--prefill-policy", choices=["chunked", "layered"], default="chunked",
                        help="chunked (Sarathi token budget) or layered (one layer group per step)")
    parser.add_argument("--group-tokens", type=positive_int, default=512,
                        help="layered: prompt tokens per layer group (G = ceil(tokens / this))")
    parser.add_argument("--num-layer-groups", type=positive_int, default=None, help="layered: a fixed G")
    parser.add_argument("--max-layer-groups", type=positive_int, default=None, help=MAX_LAYER_GROUPS_HELP)
    parser.add_argument("--layered-group-table", type=group_table, default=None, help=GROUP_TABLE_HELP)
    parser.add_argument("--layered-fill-cohorts", action="store_true", help=FILL_COHORTS_HELP)
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                        help="keep computed full KV blocks and share them with later prompts of the same prefix "
                             "(default on, as vLLM; --no-enable-prefix-caching turns it off)")


def engine_config(args: argparse.Namespace, **extra):
    from megainfer.engine_config import EngineConfig

    return EngineConfig(dtype=args.dtype, device=args.device, seed=args.seed, block_size=args.block_size,
                        num_kv_blocks=args.num_kv_blocks, max_num_seqs=args.max_num_seqs,
                        max_model_len=args.max_model_len,
                        max_num_batched_tokens=args.max_num_batched_tokens, num_threads=args.threads,
                        prefill_policy=args.prefill_policy, group_tokens=args.group_tokens,
                        num_layer_groups=args.num_layer_groups, max_layer_groups=args.max_layer_groups,
                        layered_group_table=args.layered_group_table, layered_fill_cohorts=args.layered_fill_cohorts,
                        enable_prefix_caching=args.enable_prefix_caching,
                        gpu_memory_utilization=args.gpu_memory_utilization, **extra)
