"""`megainfer simulate`: chunked against layered prefill at a workload's scale, with the real
scheduler priced by the planner's step model. Torch-free and fast."""

from __future__ import annotations

import argparse
import json
import sys
import time

from megainfer.cli.options import FILL_COHORTS_HELP, GROUP_TABLE_HELP, MAX_LAYER_GROUPS_HELP, group_table, positive_int
from megainfer.cli.step_model_options import add_step_model_options

DEFAULT_REQUESTS = 300  # a plain simulation's; --validate runs each row as long as the paper did


def register(sub: argparse._SubParsersAction) -> None:
    from megainfer.tools.simulator.routing_skew import FITTED_RANK_OFFSET, FITTED_SKEW

    p = sub.add_parser(
        "simulate", help="simulate the scheduler on a GPU instance: chunked vs layered prefill",
        description="Drive the real scheduler with the planner's performance model in place of the model, over a "
                    "generated workload (ShareGPT or arXiv lengths, Poisson or bursty arrivals) or a JSONL trace; "
                    "print TTFT, TBT, SLO attainment, throughput, expert-weight bytes and an energy estimate.")
    p.add_argument("--model", default="qwen3-30b-a3b", help="preset name or checkpoint directory")
    add_step_model_options(p, default_tp=2, gpu_help="GPU type from the catalog")
    p.add_argument("--workload", default="arxiv",
                   help="sharegpt, arxiv, or a JSONL trace of {arrival, input_len, output_len} lines")
    p.add_argument("--rate", type=float, default=1.0, help="requests per second")
    p.add_argument("--arrival", choices=["poisson", "bursty"], default="poisson")
    p.add_argument("--cv", type=float, default=2.0, help="bursty: coefficient of variation of inter-arrival times")
    p.add_argument("--exact-rate", action="store_true",
                   help="scale the drawn arrivals so that the run offers exactly --rate (a draw of 1,000 Poisson "
                        "arrivals strays from it by about 3%%, which near capacity moves the mean TTFT by tens of "
                        "percent); --validate always does")
    p.add_argument("--requests", type=positive_int, default=None,
                   help=f"requests to simulate (default {DEFAULT_REQUESTS}; with --validate, each row's as long as "
                        "the paper's run)")
    p.add_argument("--policy", choices=["chunked", "layered", "both"], default="both")
    p.add_argument("--chunk-size", type=positive_int, default=512, help="token budget of a step (chunked prefill)")
    p.add_argument("--group-tokens", type=positive_int, default=512, help="layered: prompt tokens per layer group")
    p.add_argument("--num-layer-groups", type=positive_int, default=None, help="layered: a fixed G")
    p.add_argument("--max-layer-groups", type=positive_int, default=None, help=MAX_LAYER_GROUPS_HELP)
    p.add_argument("--layered-group-table", type=group_table, default=None, help=GROUP_TABLE_HELP)
    p.add_argument("--layered-fill-cohorts", action="store_true", help=FILL_COHORTS_HELP)
    p.add_argument("--max-num-seqs", type=positive_int, default=256)
    p.add_argument("--expert-skew", type=float, default=FITTED_SKEW,
                   help=f"expert popularity ~ (rank + {FITTED_RANK_OFFSET:g})^-S per layer, each token's top-k drawn "
                        f"by it; the default {FITTED_SKEW:g} is fitted to Qwen3-30B-A3B's measured expert coverage "
                        f"on ShareGPT (megainfer/tools/simulator/routing_skew.py); 0: uniform routing")
    p.add_argument("--tbt-slo-ms", type=float, default=125.0)
    p.add_argument("--ttft-slo-s", type=float, default=10.0)
    p.add_argument("--sweep-rates", metavar="A:B:STEP", help="SLO attainment against request rate, both policies")
    p.add_argument("--plan", metavar="PLAN.yaml",
                   help="simulate this disaggregated GPU plan's decode steps instead: each (layer, micro-batch) at its "
                        "hottest expert node, the experts placed and re-placed by the deployment's code; compares "
                        "the TBT with the planner's prediction for the plan (--expert-skew, --steps)")
    p.add_argument("--steps", type=positive_int, default=400, help="with --plan: decode steps to simulate")
    p.add_argument("--expert-load", metavar="PATH",
                   help="with --plan: draw each layer's expert pairs from a measured profile (the JSON of `GET "
                        "/admin/experts/load`, the plan's model) instead of --expert-skew's law")
    p.add_argument("--expert-load-phase", choices=("decode", "prefill", "all"), default="decode",
                   help="with --expert-load: which steps' pairs (default: %(default)s)")
    p.add_argument("--validate", action="store_true",
                   help="the model against every published row (megainfer/tools/simulator/published_rows.py): "
                        "fitted on all at once and each left out; per-row and mean absolute error of mean TTFT and "
                        "mean TBT, the layered-vs-chunked directions, saturation (each row as long as the paper's run, "
                        "--requests N to shorten; --json)")
    p.add_argument("--fit-steps", type=positive_int, default=2,
                   help="with --validate: Gauss-Newton steps of the fit on all rows (each simulates every row "
                        "once per fitted parameter)")
    p.add_argument("--seeds", type=positive_int, default=None,
                   help="with --validate: each prediction the mean of this many draws of arrivals and lengths "
                        "(default 2: near capacity one draw's mean TTFT swings by tens of percent)")
    p.add_argument("--write-curves", metavar="PATH", default=None,
                   help="with --validate: write a curves file (the default one with its H100 entry replaced by the "
                        "fit on every published row) for plan/simulate --curves PATH")
    p.add_argument("--write-error", action="store_true",
                   help="with --validate: store the left-out mean absolute errors as the error band plan and "
                        "simulate print (planner/prediction_error.yaml)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="write configuration, workload statistics and results as JSON")
    p.add_argument("--plot", metavar="PATH", help="with --sweep-rates: draw SLO attainment against rate (PNG)")
    p.set_defaults(run=run)


def _plan_popularity(args: argparse.Namespace, model):
    """`--plan`'s expert popularity: a measured profile (`--expert-load`), else the fitted law."""
    if args.expert_load:
        from megainfer.cli.plan import measured_pricing

        return measured_pricing(args.expert_load, args.expert_load_phase, model)
    from planner.expert_popularity import SkewPricing
    from planner.popularity_fit import FITTED_RANK_OFFSET

    return SkewPricing(model.num_experts, model.top_k, args.expert_skew, FITTED_RANK_OFFSET, args.seed)


def run_plan(args: argparse.Namespace) -> int:
    """`--plan`: the plan's decode steps against the planner's prediction."""
    from megainfer.tools.bench.report import format_table, write_json
    from megainfer.config import DTYPE_BYTES
    from megainfer.model_resolution import resolve_model
    from megainfer.plan import Plan
    from megainfer.tools.simulator.disaggregated import PlanSimulator
    from planner.catalog import Catalog
    from planner.perf_model import PerfModel

    plan = Plan.load(args.plan)
    model, _ = resolve_model(plan.model)
    plan.check_model(model)
    seq_len = plan.predicted.seq_len if plan.predicted is not None and plan.predicted.seq_len else 730
    skew = _plan_popularity(args, model)
    perf = PerfModel(model, seq_len, DTYPE_BYTES[plan.dtype], skew=skew)
    sim = PlanSimulator(plan, model, perf, Catalog.load(args.catalog), seed=args.seed).run(args.steps)
    print(f"{args.plan}: {model.name}, B={plan.pipeline.global_batch}, m={plan.pipeline.micro_batches}, "
          f"{plan.experts.nodes} expert nodes with {plan.experts.redundant_per_node} spare slots each, expert "
          f"{'load ' + skew.source if args.expert_load else f'skew {args.expert_skew:g}'}, seq-len {seq_len}; "
          f"{args.steps} decode steps")
    replaced = "never" if sim.replaced_at is None else f"after step {sim.replaced_at}"
    print(format_table(["", "value"], [
        ["imbalance before re-placement", f"{sim.imbalance_before:.2f}"],
        ["imbalance after", f"{sim.imbalance_after:.2f}"],
        ["re-placed", replaced],
        ["simulated TBT ms (after)", f"{sim.settled_tbt_s * 1e3:.2f}"],
        ["planner's TBT ms", f"{sim.predicted_tbt_s * 1e3:.2f}"],
        ["simulated / planner", f"{sim.tbt_over_prediction:.3f}"]]))
    if args.json:
        write_json(args.json, {"plan": args.plan, "model": model.name,
                               "expert_skew": None if args.expert_load else args.expert_skew,
                               "expert_load": args.expert_load,
                               "steps": args.steps, "replaced_at": sim.replaced_at,
                               "imbalance_before": sim.imbalance_before, "imbalance_after": sim.imbalance_after,
                               "simulated_tbt_ms": sim.settled_tbt_s * 1e3, "planner_tbt_ms": sim.predicted_tbt_s * 1e3,
                               "tbt_over_prediction": sim.tbt_over_prediction})
        print(f"json: {args.json}")
    return 0


def run(args: argparse.Namespace) -> int:
    from megainfer.errors import ConfigError

    if args.validate:
        return run_validate(args)
    if args.write_error:
        raise ConfigError("--write-error stores what --validate measured; add --validate")
    if args.write_curves:
        raise ConfigError("--write-curves stores what --validate fitted; add --validate")
    return run_plan(args) if args.plan else run_experiment(args)


def run_experiment(args: argparse.Namespace) -> int:
    """The two prefill policies on one workload (or a rate sweep), on the step model."""
    from megainfer.errors import ConfigError
    from megainfer.model_resolution import resolve_model
    from megainfer.tools.simulator import experiment as ex
    from megainfer.cli.step_model_options import build_step_models, describe_sources

    if args.tbt_slo_ms <= 0 or args.ttft_slo_s <= 0:
        raise ConfigError("--tbt-slo-ms and --ttft-slo-s must be positive")
    if args.plot and not args.sweep_rates:
        raise ConfigError("--plot draws the rate sweep; add --sweep-rates A:B:STEP")
    model, _ = resolve_model(args.model)
    step_model, = build_step_models(args, model, default_tp=2)
    policies = ("chunked", "layered") if args.policy == "both" or args.sweep_rates else (args.policy,)
    spec = ex.SimulationSpec(
        model=model, step_model=step_model, workload=args.workload, rate=args.rate,
        num_requests=args.requests or DEFAULT_REQUESTS,
        policies=policies, arrival=args.arrival, cv=args.cv, exact_rate=args.exact_rate,
        chunk_size=args.chunk_size,
        group_tokens=args.group_tokens, num_layer_groups=args.num_layer_groups,
        max_layer_groups=args.max_layer_groups, group_table=args.layered_group_table,
        fill_cohorts=args.layered_fill_cohorts, max_num_seqs=args.max_num_seqs,
        expert_skew=args.expert_skew, tbt_slo_s=args.tbt_slo_ms / 1e3, ttft_slo_s=args.ttft_slo_s, seed=args.seed)
    rates = ex.rate_range(args.sweep_rates) if args.sweep_rates else None
    started = time.perf_counter()
    requests = spec.requests()
    print(ex.format_header(spec, requests, rates))
    results = rows = None
    if rates is None:
        results = spec.run(requests)
        print()
        print(ex.format_results(results, spec))
    else:
        def progress(rate, res):
            print(f"  rate {rate:g} req/s: " + ", ".join(f"{p} {r['slo_attainment']:.1%}" for p, r in res.items()),
                  file=sys.stderr, flush=True)

        rows = ex.sweep(spec, rates, progress)
        print()
        print(ex.format_sweep(rows, spec.policies))
        if args.plot:
            ex.plot_sweep(rows, spec, args.plot)
            print(f"plot: {args.plot}")
    print(describe_sources(step_model))
    from planner.prediction_error import PredictionError

    print(PredictionError.load().line())
    print(f"simulated in {time.perf_counter() - started:.1f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(ex.to_json(spec, requests, results, rows), f, indent=2)
        print(f"json: {args.json}")
    return 0


def run_validate(args: argparse.Namespace) -> int:
    """`megainfer simulate --validate`: every published row, fitted and left out."""
    from megainfer.tools.simulator.validation import SEEDS, format_report, validate
    from planner.efficiency_curves import EfficiencyCurves
    from planner.prediction_error import PredictionError

    report = validate(EfficiencyCurves.load("H100", args.curves), num_requests=args.requests,
                      progress=lambda text: print(text, file=sys.stderr, flush=True), iterations=args.fit_steps,
                      seeds=args.seeds or SEEDS)
    print(format_report(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report.as_dict(), f, indent=2)
        print(f"json: {args.json}")
    if args.write_curves:
        write_fitted_curves(report, args)
    if args.write_error:
        band = report.error_band()
        PredictionError(band["ttft"], band["tbt"], len(report.rows),
                        f"megainfer simulate --validate --fit-steps {args.fit_steps} --seeds {report.seeds}: the {len(report.rows)} H100 rows "
                        "of the layered-prefill paper, the curves refitted without each (docs/performance-model.md, "
                        "'Generalisation')").write()
        print("error band written: planner/prediction_error.yaml")
    return 0


def write_fitted_curves(report, args: argparse.Namespace) -> None:
    """The curves file `plan --curves` and `simulate --curves` take: the one validated against
    (`--curves`, or the default), its H100 entry replaced by the fit on every published row."""
    from pathlib import Path

    from megainfer.tools.simulator.curves_entry import entry_text, write_entry
    from megainfer.tools.simulator.validation import PARAMETERS
    from planner.efficiency_curves import DEFAULT_CURVES

    path = Path(args.write_curves)
    path.write_text(Path(args.curves or DEFAULT_CURVES).read_text())
    out = report.mean_abs("left_out")
    text = entry_text("H100", report.fitted_curves, {p.name for p in PARAMETERS},
                      f"{len(report.rows)} rows, left out: TTFT {out['ttft']:.0%}, TBT {out['tbt']:.0%}",
                      command=f"megainfer simulate --validate --fit-steps {args.fit_steps} --seeds {report.seeds} "
                              "--write-curves PATH",
                      source="fitted to the layered-prefill paper's published H100 rows, four models, TP 2 and 8 "
                             "(issue 37; docs/performance-model.md, 'Generalisation')")
    write_entry(path, "H100", text)
    print(f"curves written: {path} (pass --curves {path} to plan or simulate)")
