"""`megainfer bench ...`: benchmarks. Each prints a table, writes JSON with --json, and
measures against a peer in the same run (a ratio), because shared machines are noisy."""

from __future__ import annotations

import argparse

from megainfer.cli.options import add_engine_options, engine_config, length_range, positive_int


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmarks (engine)", description="Benchmarks.")
    benches = p.add_subparsers(dest="bench", required=True, metavar="BENCH")

    e = benches.add_parser("engine", help="offline throughput of the engine, optionally against transformers",
                           description="Offline throughput on a mixed-length workload of random prompts.")
    add_engine_options(e)
    e.add_argument("--num-prompts", type=positive_int, default=64)
    e.add_argument("--input-len", type=length_range, default=(32, 256), help="prompt lengths A:B (uniform)")
    e.add_argument("--output-len", type=length_range, default=(32, 128), help="output lengths C:D (uniform)")
    e.add_argument("--vs-hf", action="store_true", help="also run transformers' generate on the same prompts")
    e.add_argument("--hf-batch-size", type=positive_int, default=64,
                   help="transformers batch size (prompts left-padded, as vLLM's HF baseline does)")
    e.add_argument("--workload-seed", type=int, default=0)
    e.add_argument("--json", metavar="PATH", help="write the results as JSON")
    e.set_defaults(run=_run_engine)


def _run_engine(args: argparse.Namespace) -> int:
    from megainfer.bench.engine_bench import EngineBenchSpec, run_engine_bench

    spec = EngineBenchSpec(model=args.model, num_prompts=args.num_prompts, input_len=args.input_len,
                           output_len=args.output_len, seed=args.workload_seed, vs_hf=args.vs_hf,
                           hf_batch_size=args.hf_batch_size)
    return run_engine_bench(spec, engine_config(args), json_path=args.json)
