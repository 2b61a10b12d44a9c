"""`megainfer bench routing PLAN.yaml --routers round_robin,predictive`: the same online load
(`bench serve`'s generator) against one deployment of the plan under each router in turn.

One deployment serves every router (the router is swapped between runs), so placement, warm
processes and caches are the same for all of them; the routers take turns over `rounds`
rounds, each round a fresh workload (its own seed) sent to every router, in alternating order
(A B, B A, ...) so that a machine getting slower or faster over the run does not favour one.
Latencies are pooled over the rounds; each round's P99 TTFT is shown as well. The load
generator runs in a process of its own, as `vllm bench serve` runs beside a server, so its
threads do not share an interpreter lock with the deployment's router and delta pumps."""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import platform
from concurrent.futures import ProcessPoolExecutor

import numpy as np

from deploy.deployment import Deployment
from megainfer.tools.bench.report import format_table, write_json
from megainfer.tools.bench.routing_load import (GENERATED_DATASETS, ServeBenchSpec, format_summary, run_serve_bench,
                                         summarize, workload)
from megainfer.errors import PlanError
from megainfer.plan import Plan
from megainfer.routing.policies import ROUTERS, make_router
from megainfer.server.service import Server


@dataclasses.dataclass
class RouterRuns:
    """One router's requests over every round."""

    results: list = dataclasses.field(default_factory=list)
    duration_s: float = 0.0
    peak: int = 0
    round_p99_ttft_ms: list[float] = dataclasses.field(default_factory=list)
    error_sum_s: float = 0.0  # |predicted - measured| TTFT, predictive only
    error_count: int = 0
    prefix_queries: int = 0  # prompt tokens the attention nodes looked up in their prefix caches
    prefix_hits: int = 0  # of those, found cached


def measure(deployment: Deployment, server: Server, routers: list[str], spec: ServeBenchSpec, rounds: int,
            show_progress: bool) -> dict[str, dict]:
    instances = {name: make_router(name, seed=spec.seed) for name in routers}
    runs = {name: RouterRuns() for name in routers}
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as load_generator:
        for k in range(rounds):
            round_spec = dataclasses.replace(spec, server=server.address, seed=spec.seed + k)
            for name in routers if k % 2 == 0 else routers[::-1]:
                deployment.use_router(instances[name])
                deployment.reset_prefix_cache()  # no router starts from the prefixes another's run cached
                before, cache_before = deployment.router_error.snapshot(), deployment.metrics_snapshot()
                results, duration, peak = load_generator.submit(run_serve_bench, round_spec, show_progress).result()
                after, cache_after = deployment.router_error.snapshot(), deployment.metrics_snapshot()
                run = runs[name]
                run.prefix_queries += cache_after.prefix_cache_queries - cache_before.prefix_cache_queries
                run.prefix_hits += cache_after.prefix_cache_hits - cache_before.prefix_cache_hits
                run.results += results
                run.duration_s += duration
                run.peak = max(run.peak, peak)
                ttft = [r.ttft_s for r in results if not r.error]
                run.round_p99_ttft_ms.append(float(np.percentile(ttft, 99)) * 1e3 if ttft else float("nan"))
                run.error_sum_s += after.sum - before.sum
                run.error_count += sum(after.buckets) - sum(before.buckets)
                print(f"round {k + 1}/{rounds} {name}: P99 TTFT {run.round_p99_ttft_ms[-1]:.0f} ms", flush=True)
    summaries = {}
    for name, run in runs.items():
        s = summarize(spec, run.results, run.duration_s, run.peak)
        s["rounds"] = rounds
        s["round_p99_ttft_ms"] = run.round_p99_ttft_ms
        s["prefix_hit_rate"] = run.prefix_hits / run.prefix_queries if run.prefix_queries else None
        if name == "predictive":
            s["prediction_mae_ms"] = 1e3 * run.error_sum_s / run.error_count if run.error_count else None
            s["decision_p99_ms"] = 1e3 * instances[name].decision_p99_s()
        summaries[name] = s
    return summaries


def run(plan_path: str, routers: list[str], spec: ServeBenchSpec, json_path: str | None, rounds: int = 3,
        show_progress: bool = True) -> int:
    bad = [r for r in routers if r not in ROUTERS]
    if bad or not routers:
        raise PlanError(f"--routers: {', '.join(bad) or 'none given'}; choose from {', '.join(ROUTERS)}")
    if len(set(routers)) != len(routers):
        raise PlanError(f"--routers names a router twice: {', '.join(routers)}")
    if rounds < 1:
        raise PlanError(f"--rounds must be at least 1, got {rounds}")
    plan = Plan.load(plan_path)
    if plan.attention.nodes < 2:
        raise PlanError(f"{plan_path}: routing needs at least 2 attention nodes (attention.nodes is "
                        f"{plan.attention.nodes})")
    plan = dataclasses.replace(plan, serve=dataclasses.replace(plan.serve, router=routers[0]), autoscale=None)
    requests = workload(spec)  # a bad dataset fails here, before anything is deployed
    pace = f"at {spec.request_rate:g} req/s" if spec.dataset in GENERATED_DATASETS else f"replaying {spec.dataset}"
    print(f"deploying {plan.attention.nodes} attention x {plan.experts.nodes} expert node(s); {rounds} round(s) of "
          f"{len(requests)} requests {pace} per router ...", flush=True)
    deployment = Deployment(plan, show_progress=False).start()  # starts (and at close, stops) Ray if needed
    try:
        server = Server(deployment, port=0).start()
        try:
            rows = measure(deployment, server, routers, spec, rounds, show_progress)
        finally:
            server.stop(0)
    finally:
        deployment.close()
    for router, summary in rows.items():
        print(f"{router}:")
        print(format_summary(summary), flush=True)
    base = rows[routers[0]]
    table = []
    for router, r in rows.items():
        ratio = r["p99_ttft_ms"] / base["p99_ttft_ms"] if base["p99_ttft_ms"] else float("nan")
        hits = r["prefix_hit_rate"]
        hit_ratio = hits / base["prefix_hit_rate"] if hits is not None and base["prefix_hit_rate"] else None
        table.append([router, r["mean_ttft_ms"], r["p99_ttft_ms"], " ".join(f"{x:.0f}" for x in r["round_p99_ttft_ms"]),
                      r["p99_e2el_ms"], r["request_throughput"], f"{ratio:.2f}x",
                      "-" if hits is None else f"{hits:.1%}", "-" if hit_ratio is None else f"{hit_ratio:.2f}x"])
    print(format_table(["router", "TTFT mean ms", "TTFT p99 ms", "p99 per round", "E2E p99 ms", "req/s",
                        f"p99 TTFT vs {routers[0]}", "prefix hit rate", f"hits vs {routers[0]}"], table))
    if json_path:
        write_json(json_path, {"benchmark": "routing", "plan": plan_path, "spec": dataclasses.asdict(spec),
                               "rounds": rounds, "machine": platform.machine(), "cpus": os.cpu_count(),
                               "results": rows})
    return 0
