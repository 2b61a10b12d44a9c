"""`megainfer simulate-routing`: routing policies compared on a simulated fleet of replicas."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

from megainfer.cli.options import positive_int
from megainfer.cli.step_model_options import add_step_model_options


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "simulate-routing", help="compare routers on a simulated fleet: P99 TTFT and capacity against request rate",
        description="Simulate N replicas (each the real scheduler priced by the planner's step model) behind each "
                    "router over a generated workload at each rate; print P99 TTFT per rate, each router's capacity "
                    "(the highest rate with P99 TTFT under the SLO) and the predictive router's prediction error.")
    p.add_argument("--model", default="qwen3-30b-a3b", help="preset name or checkpoint directory")
    add_step_model_options(p, default_tp=1, gpu_help="GPU type from the catalog; a comma-separated list makes a "
                                                      "mixed fleet (replicas take them in turn, e.g. H100,A100)")
    p.add_argument("--replicas", type=positive_int, default=12)
    p.add_argument("--routers", default="round_robin,least_loaded,predictive",
                   help="comma-separated: round_robin, random, least_loaded, predictive, prefix_affinity")
    p.add_argument("--workload", default="sharegpt", choices=["sharegpt", "arxiv"])
    p.add_argument("--shared-prefixes", type=int, default=0, metavar="N",
                   help="each prompt starts with one of N shared prefixes (a system prompt, few-shot examples): "
                        "the replicas' prefix caches and the routers' view of them are simulated")
    p.add_argument("--prefix-len", type=positive_int, default=1024, help="tokens of each shared prefix")
    p.add_argument("--requests", type=positive_int, default=3000, help="requests per rate")
    p.add_argument("--sweep-rates", metavar="A:B:STEP", default="26:40:2", help="request rates, req/s")
    p.add_argument("--chunk-size", type=positive_int, default=512, help="token budget of a step")
    p.add_argument("--ttft-slo-s", type=float, default=3.0)
    p.add_argument("--snapshot-s", type=float, default=0.25, help="how often replicas report their state")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--plot", metavar="PATH", help="P99 TTFT against rate, one line per router (PNG)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from megainfer.errors import ConfigError
    from megainfer.model_resolution import resolve_model
    from megainfer.routing.policies import ROUTERS
    from megainfer.tools.simulator import routing_experiment as rx
    from megainfer.tools.simulator.experiment import rate_range
    from megainfer.cli.step_model_options import build_step_models
    from planner.step_prior import step_prior
    from planner.step_cost_model import device_label

    routers = tuple(r.strip() for r in args.routers.split(",") if r.strip())
    bad = [r for r in routers if r not in ROUTERS]
    if bad or not routers:
        raise ConfigError(f"--routers {args.routers!r}: choose from {', '.join(ROUTERS)}")
    if args.ttft_slo_s <= 0 or args.snapshot_s <= 0:
        raise ConfigError("--ttft-slo-s and --snapshot-s must be positive")
    if args.shared_prefixes < 0:
        raise ConfigError(f"--shared-prefixes must be 0 (none) or a positive number of prefixes, got "
                          f"{args.shared_prefixes}")
    model, _ = resolve_model(args.model)
    step_models = build_step_models(args, model, default_tp=1)
    # The predictive router starts every replica from the first step model's prices.
    spec = rx.RoutingSpec(model=model, step_models=step_models, step_prior=step_prior(step_models[0]),
                          replicas=args.replicas, routers=routers, workload=args.workload,
                          num_requests=args.requests, chunk_size=args.chunk_size, ttft_slo_s=args.ttft_slo_s,
                          snapshot_s=args.snapshot_s, seed=args.seed, shared_prefixes=args.shared_prefixes,
                          prefix_len=args.prefix_len if args.shared_prefixes else 0)
    rates = rate_range(args.sweep_rates)
    fleet = ", ".join(dict.fromkeys(device_label(m) for m in step_models))
    shared = f" behind {args.shared_prefixes} shared {args.prefix_len}-token prefixes" if args.shared_prefixes else ""
    print(f"{args.replicas} replicas of {model.name} on {fleet}; {args.workload}{shared}, Poisson arrivals, "
          f"{args.requests} requests per rate; chunk {args.chunk_size} tokens; state every {args.snapshot_s:g} s")
    started = time.perf_counter()

    def progress(rate, router, r):
        print(f"  rate {rate:g} req/s {router}: P99 TTFT {r['ttft_p99_s']:.2f} s ({r['wall_s']:.0f} s)",
              file=sys.stderr, flush=True)

    rows = rx.sweep(spec, rates, progress)
    print()
    print(rx.format_sweep(rows, spec))
    print()
    print(rx.format_capacity(rows, spec))
    if args.plot:
        rx.plot(rows, spec, args.plot)
        print(f"plot: {args.plot}")
    print(f"simulated in {time.perf_counter() - started:.0f} s")
    if args.json:
        config = {k: v for k, v in dataclasses.asdict(spec).items() if k not in ("model", "step_models")}
        config.update(model=model.name, gpu=args.gpu, tp=args.tp)
        caps = {r: rx.capacity(rows, r, spec.ttft_slo_s) for r in routers}
        with open(args.json, "w") as f:
            json.dump({"config": config, "capacity": caps, "sweep": rows}, f, indent=2)
        print(f"json: {args.json}")
    return 0
