"""`megainfer bench routing PLAN.yaml --routers round_robin,predictive`: the same online load
(`bench serve`'s generator, same seed, same arrivals) against the plan deployed under each
router in turn, one Ray session, and the routers' latencies side by side with the ratio."""

from __future__ import annotations

import dataclasses
import os
import platform

import ray

from deploy.launcher import Deployment, bundles
from megainfer.bench.report import format_table, write_json
from megainfer.bench.serve_bench import ServeBenchSpec, format_summary, run_serve_bench, summarize
from megainfer.errors import PlanError
from megainfer.plan import Plan
from megainfer.routing.policies import ROUTERS
from megainfer.server.service import Server


def measure(plan: Plan, spec: ServeBenchSpec, show_progress: bool) -> dict:
    deployment = Deployment(plan, show_progress=False).start()
    server = Server(deployment, port=0).start()
    try:
        results, duration, peak = run_serve_bench(dataclasses.replace(spec, server=server.address), show_progress)
        summary = summarize(spec, results, duration, peak)
        if plan.serve.router == "predictive":
            snap = deployment.router_error.snapshot()
            count = sum(snap["buckets"])
            summary["prediction_mae_ms"] = 1e3 * snap["sum"] / count if count else None
            summary["decision_p99_ms"] = 1e3 * deployment.router.decision_p99_s()
        return summary
    finally:
        server.stop(0)
        deployment.close()


def run(plan_path: str, routers: list[str], spec: ServeBenchSpec, json_path: str | None,
        show_progress: bool = True) -> int:
    bad = [r for r in routers if r not in ROUTERS]
    if bad or not routers:
        raise PlanError(f"--routers: {', '.join(bad) or 'none given'}; choose from {', '.join(ROUTERS)}")
    plan = Plan.load(plan_path)
    if plan.attention.nodes < 2:
        raise PlanError(f"{plan_path}: routing needs at least 2 attention nodes (attention.nodes is "
                        f"{plan.attention.nodes})")
    started = not ray.is_initialized()
    if started:
        need = int(sum(b.get("CPU", 0) for b in bundles(plan)))
        ray.init(num_cpus=max(os.cpu_count() or 1, need), include_dashboard=False, log_to_driver=False)
    rows = {}
    try:
        for router in routers:
            variant = dataclasses.replace(plan, serve=dataclasses.replace(plan.serve, router=router),
                                          autoscale=None)
            print(f"{router}: deploying {plan.attention.nodes} attention x {plan.experts.nodes} expert node(s) and "
                  f"sending {spec.num_prompts} requests at {spec.request_rate:g} req/s ...", flush=True)
            rows[router] = measure(variant, spec, show_progress)
            print(format_summary(rows[router]), flush=True)
    finally:
        if started:
            ray.shutdown()
    base = rows[routers[0]]
    table = []
    for router, r in rows.items():
        ratio = r["p99_ttft_ms"] / base["p99_ttft_ms"] if base["p99_ttft_ms"] else float("nan")
        table.append([router, r["mean_ttft_ms"], r["p99_ttft_ms"], r["p99_e2el_ms"], r["request_throughput"],
                      f"{ratio:.2f}x"])
    print(format_table(["router", "TTFT mean ms", "TTFT p99 ms", "E2E p99 ms", "req/s",
                        f"p99 TTFT vs {routers[0]}"], table))
    if json_path:
        write_json(json_path, {"benchmark": "routing", "plan": plan_path, "spec": dataclasses.asdict(spec),
                               "machine": platform.machine(), "cpus": os.cpu_count(), "results": rows})
    return 0
