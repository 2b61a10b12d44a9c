"""`megainfer plan`: search deployments and write plan.yaml. Torch-free."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from megainfer.cli.options import positive_int
from megainfer.errors import PlanError


def register(sub: argparse._SubParsersAction) -> None:
    from planner.popularity_fit import FITTED_RANK_OFFSET

    p = sub.add_parser(
        "plan", help="search disaggregated deployments for throughput per cost under a TBT SLO",
        description="Search attention/expert deployments (GPU types, TP sizes, replicas, micro-batches, batch) "
                    "with MegaScale-Infer's performance model; print a ranked table and the colocated baseline.")
    p.add_argument("--model", required=True, help="preset name, checkpoint directory or config.json")
    p.add_argument("--gpus", help="comma-separated GPU types to consider (default: the whole catalog)")
    p.add_argument("--tbt-slo-ms", type=float, default=150.0, help="time-between-tokens SLO, ms")
    p.add_argument("--seq-len", type=positive_int, default=730, help="mean context length of decoding sequences")
    p.add_argument("--max-micro-batches", type=positive_int, default=4, help="N_m: micro-batch counts 1..N_m")
    p.add_argument("--objective", choices=["cost", "power", "gpu"], default="cost",
                   help="rank by tokens/s per cost (default), per watt, or per GPU")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--top", type=positive_int, default=10, help="rows of the ranked table")
    p.add_argument("--catalog", help="GPU catalog YAML (default: the built-in one)")
    p.add_argument("--calibration", help="measured k1..k4 and network utilisation (YAML)")
    p.add_argument("--profile", action="append", default=[], metavar="PATH",
                   help="operator profile from `megainfer profile` (repeatable, one per GPU type and TP size): "
                        "prices that GPU and TP size from measurements; the rest from efficiency curves")
    p.add_argument("--host-profile", metavar="PATH",
                   help="the host's CPU time per M2N round, a `megainfer bench host PLAN --json PATH` result: charged "
                        "per round, and plans whose rounds the host cannot post within T_a or T_e are refused "
                        "(default: not charged)")
    p.add_argument("--curves", metavar="PATH", help="efficiency curves YAML (default: planner/efficiency_curves.yaml)")
    p.add_argument("--price", action="append", default=[], metavar="GPU=PRICE",
                   help="your own price per GPU-hour, repeatable (e.g. --price H100=2.99)")
    p.add_argument("--expert-skew", type=float, metavar="S",
                   help="price skewed expert popularity, (rank + offset)^-S (3.61: the fit to measured Qwen3 "
                        "routing): every micro-batch waits for the hottest expert node (default: uniform routing)")
    p.add_argument("--expert-rank-offset", type=float, default=FITTED_RANK_OFFSET, metavar="OFFSET",
                   help="with --expert-skew: the popularity law's rank offset (default: the fitted %(default)g)")
    p.add_argument("--expert-load", metavar="PATH",
                   help="price the expert popularity a server measured instead of the fitted law: the JSON of "
                        "`GET /admin/experts/load` (each layer's pairs per expert over its window; the same model)")
    p.add_argument("--expert-load-phase", choices=("decode", "prefill", "all"), default="decode",
                   help="with --expert-load: which steps' pairs to price (default: %(default)s, the steady load "
                        "MegaScale-Infer places for)")
    p.add_argument("--redundant-experts", type=int, default=0, metavar="R",
                   help="with --expert-skew or --expert-load: also search 1..R spare expert slots per node, filled "
                        "by the redundancy plan (MegaScale-Infer's hot-expert replicas); the plan gets experts.rebalance")
    p.add_argument("-o", "--output", help="write the best plan to this plan.yaml")
    p.add_argument("--json", metavar="PATH", help="write every candidate and the baseline as JSON")
    p.add_argument("--explain", action="store_true",
                   help="describe the best plan's ping-pong timeline and where each operator's time came from")
    p.add_argument("--plot", metavar="PATH", help="draw the best plan's timeline as a Gantt chart (PNG)")
    p.set_defaults(run=run)


def _model(spec: str):
    from megainfer.hf_config import from_hf_dict
    from megainfer.model_resolution import resolve_model

    path = Path(spec)
    if path.suffix == ".json" and path.is_file():
        try:
            return from_hf_dict(json.loads(path.read_text()), name=str(path))
        except json.JSONDecodeError as exc:
            raise PlanError(f"{path}: not valid JSON ({exc})") from None
    return resolve_model(spec)[0]


def _prices(items: list[str]) -> dict[str, float]:
    prices = {}
    for item in items:
        name, sep, value = item.partition("=")
        try:
            prices[name] = float(value)
        except ValueError:
            sep = ""
        if not sep or not name:
            raise PlanError(f"--price {item!r}: write GPU=PRICE, e.g. --price H100=2.99")
    return prices


def explain_sources(perf, catalog, best, calibration) -> str:
    """Where the best plan's predicted times came from, operator by operator."""
    lines = ["where the predicted times come from:"]
    for role, gpu, tp in (("attention", best.attention_gpu, best.tp_a), ("experts", best.expert_gpu, best.tp_e)):
        table = perf.calibration.attention if role == "attention" else perf.calibration.experts
        if calibration is not None and (gpu, tp) in table:
            lines.append(f"  {role} ({gpu} tp{tp}): the calibration file's measured k coefficients")
            continue
        sources = perf.phases.sources(gpu, tp)
        operators = ("dense", "attention_decode", "allreduce", "lm_head", "sampling", "step_overhead") \
            if role == "attention" else ("moe", "allreduce")
        lines.append(f"  {role} ({gpu} tp{tp}):")
        for op in operators:
            if op in sources:
                lines.append(f"    {op:18s} {sources[op]}")
        if any("curves" in sources.get(op, "") for op in operators):
            lines.append(f"    curves: {perf.phases.curves(catalog[gpu]).source}")
    return "\n".join(lines)


def _skew(args: argparse.Namespace, model):
    """The skew pricing the options ask for (None: uniform routing)."""
    if args.expert_skew is not None and args.expert_load:
        raise PlanError("--expert-skew prices the fitted law and --expert-load a measured profile: give one of them")
    if args.expert_load:
        if args.redundant_experts < 0:
            raise PlanError(f"--redundant-experts must not be negative, got {args.redundant_experts}")
        return measured_pricing(args.expert_load, args.expert_load_phase, model)
    if args.expert_skew is None:
        if args.redundant_experts:
            raise PlanError("--redundant-experts prices spare slots against skew: give --expert-skew or "
                            "--expert-load too")
        return None
    from planner.expert_popularity import SkewPricing

    if args.expert_skew < 0 or args.expert_rank_offset < 0:
        raise PlanError(f"--expert-skew ({args.expert_skew}) and --expert-rank-offset ({args.expert_rank_offset}) "
                        "must not be negative")
    if args.redundant_experts < 0:
        raise PlanError(f"--redundant-experts must not be negative, got {args.redundant_experts}")
    return SkewPricing(model.num_experts, model.top_k, args.expert_skew, args.expert_rank_offset)


def measured_pricing(path: str, phase: str, model):
    """`MeasuredPricing` of the profile at `path` (`megainfer plan`, `megainfer simulate --plan`)."""
    from megainfer.expert_load_profile import ExpertLoadProfile
    from planner.expert_popularity import MeasuredPricing

    profile = ExpertLoadProfile.load(path)
    profile.check_model(model.num_layers, model.num_experts, model.name, phase)
    return MeasuredPricing(profile.counts(phase), model.num_moe_layers,
                           f"measured on {profile.model}: {phase} pairs of {profile.steps(phase)} steps, {path}")


def print_skew(candidates, args: argparse.Namespace, no_spare, skew) -> None:
    """Per plan: spare slots, the hottest expert node's imbalance and T_e with them and without."""
    from megainfer.tools.bench.report import format_table

    if args.expert_load:
        print(f"\nexpert load {skew.source}; T_e is the hottest expert node's (each layer's, averaged):")
    else:
        print(f"\nexpert skew {args.expert_skew:g} (popularity ~ (rank + {args.expert_rank_offset:g})^-"
              f"{args.expert_skew:g}); T_e is the hottest expert node's:")
    print(format_table(["#", "experts", "spare/node", "imbalance without", "imbalance with", "T_e ms without",
                        "T_e ms with"],
                       [[rank, f"{c.expert_gpu} tp{c.tp_e} x{c.expert_nodes} ({c.experts_per_node}/node)",
                         c.redundant_per_node, f"{c.expert_imbalance_no_redundancy:.2f}", f"{c.expert_imbalance:.2f}",
                         f"{c.t_e_no_redundancy * 1e3:.3f}", f"{c.t_e * 1e3:.3f}"]
                        for rank, c in enumerate(candidates, 1)]))
    if no_spare is not None and no_spare.candidates:
        best, plain = candidates[0], no_spare.candidates[0]
        print(f"best plan with skew and no spare slot: {plain.per_gpu:,.0f} tokens/s per GPU "
              f"({plain.tokens_per_s:,.0f} tokens/s, imbalance {plain.expert_imbalance:.2f}); with up to "
              f"{args.redundant_experts} spare slots: {best.per_gpu:,.0f} per GPU ({best.tokens_per_s:,.0f} tokens/s, "
              f"{best.redundant_per_node} spare/node, imbalance {best.expert_imbalance:.2f}): "
              f"{best.per_gpu / plain.per_gpu:.2f}x")


def run(args: argparse.Namespace) -> int:
    from planner.catalog import Catalog
    from planner.colocated import best_colocated
    from planner.prediction_error import PredictionError
    from planner.search import search

    if args.tbt_slo_ms <= 0:
        raise PlanError(f"--tbt-slo-ms must be positive, got {args.tbt_slo_ms}")
    model = _model(args.model)
    catalog = Catalog.load(args.catalog).with_prices(_prices(args.price))
    gpus = [g.strip() for g in args.gpus.split(",") if g.strip()] if args.gpus else catalog.names()
    gpus = [catalog[g].name for g in gpus]  # unknown names fail here, listing the known ones
    perf, calibration = _perf_model(args, model)
    band = PredictionError.load()
    # Plans are searched to the SLO less the model's usual TBT error: one predicted at the SLO
    # itself would miss it whenever the model is optimistic.
    slo = band.headroom_slo_s(args.tbt_slo_ms / 1e3)
    start = time.perf_counter()
    result = search(model, catalog, gpus, gpus, tbt_slo_s=slo, perf=perf,
                    max_micro_batches=args.max_micro_batches, objective=args.objective)
    no_spare = None
    if perf.skew is not None and args.redundant_experts:  # the same skew, no spare slot: what redundancy wins
        no_spare = search(model, catalog, gpus, gpus, tbt_slo_s=slo, perf=perf.without_redundancy(),
                          max_micro_batches=args.max_micro_batches, objective=args.objective)
    baseline = best_colocated(model, catalog, gpus, tbt_slo_s=slo, perf=perf, objective=args.objective)
    elapsed = time.perf_counter() - start
    if not result.candidates:
        raise PlanError(_nothing_meets(args, model, gpus, result.fastest, perf.host))

    print(f"{model.name}: {args.dtype}, seq-len {args.seq_len}, TBT SLO {args.tbt_slo_ms:g} ms (planned to "
          f"{slo * 1e3:.1f} ms: the model's TBT error +/-{band.tbt:.0%} left as headroom), objective "
          f"{args.objective}, GPUs {','.join(gpus)}; {result.configurations:,} configurations searched in "
          f"{elapsed:.2f} s (prices: {catalog.price_unit or 'catalog units'})")
    print_candidates(result.candidates[:args.top])
    print(band.line())
    if perf.skew is not None:
        print_skew(result.candidates[:args.top], args, no_spare, perf.skew)
    ratios = print_baseline(result.candidates[0], baseline)
    _write_outputs(args, model, gpus, result, baseline, ratios, elapsed, perf, catalog, calibration)
    sys.stdout.flush()
    return 0


def _perf_model(args: argparse.Namespace, model):
    """The performance model the options describe, and the calibration it holds (for --explain)."""
    from megainfer.config import DTYPE_BYTES
    from planner.operator_profile import OperatorProfile
    from planner.perf_model import Calibration, PerfModel
    from planner.round_host_cost import HostCost

    calibration = Calibration.load(args.calibration) if args.calibration else None
    profiles = [OperatorProfile.load(path) for path in args.profile]
    host = HostCost.load(args.host_profile) if args.host_profile else None
    perf = PerfModel(model, args.seq_len, DTYPE_BYTES[args.dtype], calibration=calibration, curves_path=args.curves,
                     profiles=profiles, host=host, skew=_skew(args, model), redundant_experts=args.redundant_experts)
    return perf, calibration


def _nothing_meets(args: argparse.Namespace, model, gpus: list[str], fastest, host) -> str:
    f = fastest
    where = (f"{f.attention_gpu}x{f.tp_a} x{f.n_a} attention, {f.expert_gpu}x{f.tp_e} x{f.expert_nodes} experts, "
             f"m={f.m}, one sequence per micro-batch" if f else "none fits in memory")
    best_tbt = f"{f.tbt * 1e3:.1f} ms" if f else "n/a"
    return (f"no plan meets a TBT SLO of {args.tbt_slo_ms:g} ms for {model.name} at seq-len "
            f"{args.seq_len} on {', '.join(gpus)}; the best achievable TBT is {best_tbt} ({where}). "
            "Raise --tbt-slo-ms, shorten --seq-len, or add faster GPUs"
            + (f"; the host profile {host.source} also refuses plans whose M2N rounds the host cannot "
               "post within the micro-batch's compute" if host else ""))


def print_candidates(candidates) -> None:
    from megainfer.tools.bench.report import format_table

    rows = []
    for rank, c in enumerate(candidates, 1):
        rows.append([rank, f"{c.attention_gpu} tp{c.tp_a} x{c.n_a}",
                     f"{c.expert_gpu} tp{c.tp_e} x{c.expert_nodes} ({c.experts_per_node}/node)", c.m, c.batch,
                     f"{c.t_a * 1e3:.3f}", f"{c.t_e * 1e3:.3f}", f"{c.t_c * 1e3:.3f}", f"{c.tbt * 1e3:.1f}",
                     f"{c.tokens_per_s:,.0f}", f"{c.per_gpu:,.0f}", f"{c.per_cost:,.0f}", f"{c.per_watt * 1e3:,.0f}",
                     f"{c.balance:.2f}", "yes" if c.network_hidden else "NO", "yes" if c.pipeline_full else "no"])
    print(format_table(["#", "attention", "experts", "m", "B", "T_a ms", "T_e ms", "T_c ms", "TBT ms", "tokens/s",
                        "/GPU", "/cost", "/kW", "(1) Ta/Te", "(2) Tc<Tf", "(3) mTf>=2(Tf+Tc)"], rows))


def print_baseline(best, baseline) -> dict | None:
    """The colocated baseline and the best plan's gains over it (None where none meets the SLO)."""
    if baseline is None:
        print("colocated baseline: no colocated deployment on these GPUs meets the SLO")
        return None
    ratios = {k: best_v / base_v for k, best_v, base_v in (
        ("per_gpu", best.per_gpu, baseline.per_gpu), ("per_cost", best.per_cost, baseline.per_cost),
        ("per_watt", best.per_watt, baseline.per_watt))}
    print(f"colocated baseline: {baseline.gpu} x{baseline.gpus} (attention TP {baseline.attention_tp}, "
          f"experts EP {baseline.gpus}), B={baseline.batch}, TBT {baseline.tbt * 1e3:.1f} ms, "
          f"{baseline.tokens_per_s:,.0f} tokens/s, {baseline.per_gpu:,.0f}/GPU, {baseline.per_cost:,.0f}/cost")
    print(f"disaggregation gains over it: {ratios['per_cost']:.2f}x per cost, {ratios['per_gpu']:.2f}x per GPU, "
          f"{ratios['per_watt']:.2f}x per watt")
    return ratios


def _write_outputs(args: argparse.Namespace, model, gpus: list[str], result, baseline, ratios, elapsed: float, perf,
                   catalog, calibration) -> None:
    """--explain, --plot, -o and --json."""
    from megainfer.tools.bench.report import write_json
    from planner.timeline import explain, plot_predicted_gantt

    best = result.candidates[0]
    if args.explain:
        print()
        print(explain(best, model.num_moe_layers, perf.host.source if perf.host else None, model.first_k_dense))
        print()
        print(explain_sources(perf, catalog, best, calibration))
    if args.plot:
        plot_predicted_gantt(best, args.plot)
        print(f"timeline chart: {args.plot}")
    if args.output:
        plan = best.to_plan(args.model, args.dtype, args.tbt_slo_ms, args.seq_len)
        plan.check_model(model)  # the checks `megainfer deploy` makes (tp against heads and intermediate size)
        plan.save(args.output)
        print(f"best plan written to {args.output}")
    if args.json:
        write_json(args.json, {
            "model": model.name, "dtype": args.dtype, "seq_len": args.seq_len, "tbt_slo_ms": args.tbt_slo_ms,
            "objective": args.objective, "gpus": gpus, "configurations": result.configurations,
            "search_seconds": elapsed, "candidates": [c.as_dict() for c in result.candidates],
            "colocated": baseline.as_dict() if baseline else None, "ratios": ratios})
