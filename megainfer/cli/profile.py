"""`megainfer profile`: time a model's operators on this machine and write an operator profile
(planner/operator_profile.py) that `megainfer plan --profile` prices steps with."""

from __future__ import annotations

import argparse
from pathlib import Path

from megainfer.cli.options import positive_int
from megainfer.errors import ConfigError


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be positive")
    return value


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("profile", help="time a model's operators on this machine and write an operator profile "
                                       "(JSON) for the planner")
    p.add_argument("--model", default="megainfer-demo",
                   help="checkpoint directory, Hugging Face repo id in the local cache, megainfer-demo (default), "
                        "or a preset name (random weights)")
    p.add_argument("--device", default="auto", help="auto (default: cuda if torch sees a GPU, else cpu), cpu, "
                                                    "cuda or cuda:N")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto (default): the checkpoint's torch_dtype, float32 for presets")
    p.add_argument("--tp", type=positive_int, default=1,
                   help="tensor parallelism: operators at one rank's sharded shapes, plus the all-reduce across "
                        "tp processes (GPUs cuda:N.. on CUDA, gloo on the CPU)")
    p.add_argument("--threads", type=positive_int, default=None, help="CPU threads for torch (default: torch's)")
    p.add_argument("--max-model-len", type=positive_int, default=None,
                   help="bounds the context axes (default: the model's max_position_embeddings)")
    p.add_argument("--output", "-o", metavar="PATH",
                   help="the profile file, or a directory for the default name "
                        "<device>-<model>-tp<T>-<dtype>.json (default: the current directory)")
    p.add_argument("--quick", action="store_true", help="a small grid: for tests and a first look")
    p.add_argument("--min-time-ms", type=positive_float, default=None,
                   help="time spent per grid point, at least (default 100 on a CPU, 50 on a GPU, 5 with --quick)")
    p.add_argument("--seed", type=int, default=0, help="random weights (presets) and inputs")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from megainfer.tools.profiler.profile_run import ProfileRequest, default_output_name, run_profile, summary_table

    request = ProfileRequest(model=args.model, device=args.device, dtype=args.dtype, tp=args.tp,
                             threads=args.threads, max_model_len=args.max_model_len, quick=args.quick,
                             min_time_ms=args.min_time_ms, seed=args.seed)
    result = run_profile(request)
    path = Path(args.output or ".")
    if path.is_dir():
        path = path / default_output_name(result.profile)
    try:
        result.profile.save(path)
    except OSError as exc:
        raise ConfigError(f"--output {args.output}: cannot write the profile ({exc.strerror})") from None
    print(summary_table(result))
    print(f"\nwrote {path}")
    return 0
