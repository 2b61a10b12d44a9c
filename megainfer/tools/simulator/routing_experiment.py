"""`megainfer simulate-routing`: routers compared on a simulated fleet (Block's experiment):
P99 TTFT against request rate for each router, and each router's capacity, the highest rate
whose P99 TTFT stays under the SLO."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from megainfer.config import ModelConfig
from megainfer.engine_config import EngineConfig
from megainfer.routing.policies import make_router
from megainfer.tools.simulator.cluster import ClusterSimulator
from megainfer.tools.bench.workload import generate, with_shared_prefixes
from planner.step_cost_model import ColocatedStepModel


@dataclass
class RoutingSpec:
    model: ModelConfig
    step_models: list[ColocatedStepModel]  # replica k runs on step_models[k % len]
    replicas: int = 12
    routers: tuple[str, ...] = ("round_robin", "least_loaded", "predictive")
    workload: str = "sharegpt"
    num_requests: int = 3000
    chunk_size: int = 512
    max_num_seqs: int = 256
    ttft_slo_s: float = 3.0
    snapshot_s: float = 0.25
    seed: int = 0
    step_prior: tuple[float, ...] | None = None  # the predictive router's prior (planner.step_prior)
    shared_prefixes: int = 0  # prompts start with one of this many shared prefixes (0: none shared)
    prefix_len: int = 0  # tokens of each shared prefix

    def requests(self, rate: float) -> list:
        requests = generate(self.workload, num_requests=self.num_requests, rate=rate,
                            max_model_len=self.model.max_position_embeddings, seed=self.seed)
        if self.shared_prefixes:
            requests = with_shared_prefixes(requests, num_prefixes=self.shared_prefixes, prefix_len=self.prefix_len,
                                            max_model_len=self.model.max_position_embeddings, seed=self.seed)
        return requests

    def run(self, router: str, rate: float, requests: list) -> dict:
        config = EngineConfig(max_num_batched_tokens=self.chunk_size, max_num_seqs=self.max_num_seqs)
        sim = ClusterSimulator(self.model, self.step_models, config, self.replicas, self._router(router),
                               snapshot_s=self.snapshot_s, seed=self.seed)
        return sim.run(requests, rate).summary()

    def _router(self, name: str):
        if name == "predictive" and self.step_prior is not None:
            return make_router(name, seed=self.seed, step_prior=self.step_prior)
        return make_router(name, seed=self.seed)


def sweep(spec: RoutingSpec, rates: list[float], progress=None) -> list[dict]:
    rows = []
    for rate in rates:
        row = {"rate": rate}
        requests = spec.requests(rate)  # one workload per rate, every router on it
        for router in spec.routers:
            row[router] = spec.run(router, rate, requests)
            if progress is not None:
                progress(rate, router, row[router])
        rows.append(row)
    return rows


def capacity(rows: list[dict], router: str, slo_s: float) -> float:
    """The highest rate under the SLO before the first rate over it, refined by interpolating
    P99 TTFT linearly between that pair of rates (the rates swept bound the answer)."""
    last_ok = None
    for row in rows:
        p99 = row[router]["ttft_p99_s"]
        if p99 <= slo_s:
            last_ok = row
            continue
        if last_ok is None:
            return 0.0
        lo, hi = last_ok[router]["ttft_p99_s"], p99
        frac = (slo_s - lo) / (hi - lo) if hi > lo else 0.0
        return last_ok["rate"] + frac * (row["rate"] - last_ok["rate"])
    return rows[-1]["rate"] if last_ok is not None else 0.0


def format_sweep(rows: list[dict], spec: RoutingSpec) -> str:
    """P99 TTFT per rate and router; with shared prefixes, each router's mean TTFT and prefix-cache
    hit rate (cached prompt tokens over prompt tokens looked up) too."""
    cells = [("p99 TTFT s", "ttft_p99_s", "{:.2f}")]
    if spec.shared_prefixes:
        cells += [("mean TTFT s", "ttft_mean_s", "{:.2f}"), ("hit rate", "prefix_hit_rate", "{:.1%}")]
    head = f"{'rate req/s':>10s}  " + "  ".join(f"{r + ' ' + name:>26s}" for r in spec.routers for name, _, _ in cells)
    out = [head, "-" * len(head)]
    for row in rows:
        out.append(f"{row['rate']:10.2f}  " + "  ".join(f"{form.format(row[r][key] or 0.0):>26s}"
                                                         for r in spec.routers for _, key, form in cells))
    return "\n".join(out)


def format_capacity(rows: list[dict], spec: RoutingSpec) -> str:
    capacities = {router: capacity(rows, router, spec.ttft_slo_s) for router in spec.routers}
    base = capacities.get("round_robin")
    lines = [f"capacity (highest rate with P99 TTFT <= {spec.ttft_slo_s:g} s):"]
    top = rows[-1]["rate"]
    for router, rate in capacities.items():
        vs = f"  ({rate / base - 1:+.1%} vs round_robin)" if base and router != "round_robin" else ""
        more = "  (met at every rate swept: raise the rates)" if all(row[router]["ttft_p99_s"] <= spec.ttft_slo_s
                                                                      for row in rows) else ""
        lines.append(f"  {router:13s} {rate:7.2f} req/s{vs}{more}" if rate < top or not more
                     else f"  {router:13s} >= {top:g} req/s{more}")
    if "predictive" in capacities and "least_loaded" in capacities and capacities["least_loaded"]:
        lines.append(f"  predictive vs least_loaded: {capacities['predictive'] / capacities['least_loaded'] - 1:+.1%}")
    if "predictive" in spec.routers:
        mae = [row["predictive"]["prediction_mae_s"] for row in rows]
        decision_ms = [row["predictive"]["decision_p99_ms"] for row in rows]
        lines.append(f"predictive: TTFT prediction MAE {min(mae) * 1e3:.0f} to {max(mae) * 1e3:.0f} ms over the sweep "
                     f"(mean {np.mean(mae) * 1e3:.0f} ms); decision p99 {max(decision_ms):.2f} ms with {spec.replicas} "
                     "candidates")
    return "\n".join(lines)


def plot(rows: list[dict], spec: RoutingSpec, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4))
    rates = [r["rate"] for r in rows]
    for router, style in zip(spec.routers, ("o-", "s-", "^-", "d-")):
        ax.plot(rates, [r[router]["ttft_p99_s"] for r in rows], style,
                label=f"{router} ({capacity(rows, router, spec.ttft_slo_s):.1f} req/s)")
    ax.axhline(spec.ttft_slo_s, color="grey", lw=0.8, ls="--")
    ax.set_yscale("log")
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("P99 TTFT (s)")
    ax.set_title(f"{spec.replicas} x {spec.model.name} on {spec.step_models[0].tp} x "
                 f"{'/'.join(m.gpu.name for m in spec.step_models)}, {spec.workload}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
