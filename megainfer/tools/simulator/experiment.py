"""A simulate run: one workload through each prefill policy (and, for a sweep, at each rate),
with the comparison table, the JSON record and the SLO-attainment plot."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from megainfer.config import ModelConfig
from megainfer.engine_config import EngineConfig
from megainfer.errors import ConfigError
from megainfer.tools.simulator.routing_skew import FITTED_RANK_OFFSET, FITTED_SKEW
from megainfer.tools.simulator.sim import Simulator
from megainfer.tools.bench.workload import WORKLOADS, SimRequest, describe, generate, load_trace
from planner.step_cost_model import ColocatedStepModel, device_label


@dataclass
class SimulationSpec:
    model: ModelConfig
    step_model: ColocatedStepModel
    workload: str  # a built-in workload name or a JSONL trace path
    rate: float
    num_requests: int
    policies: tuple[str, ...] = ("chunked", "layered")
    arrival: str = "poisson"
    cv: float = 1.0
    exact_rate: bool = False  # arrivals scaled to offer exactly the rate (workload.arrival_times)
    chunk_size: int = 512
    group_tokens: int = 512
    num_layer_groups: int | None = None
    max_layer_groups: int | None = None  # layered: a cap on the derived G (the paper's --num-stages)
    group_table: tuple[tuple[int, int], ...] | None = None  # layered: EngineConfig.layered_group_table
    fill_cohorts: bool = False  # layered: EngineConfig.layered_fill_cohorts
    max_num_seqs: int = 256
    expert_skew: float = FITTED_SKEW  # expert popularity ~ (rank + expert_rank_offset)^-expert_skew; 0: uniform
    expert_rank_offset: float = FITTED_RANK_OFFSET
    tbt_slo_s: float = 0.125
    ttft_slo_s: float = 10.0
    seed: int = 0
    from_trace: bool = field(init=False, default=False)

    def engine_config(self, policy: str) -> EngineConfig:
        return EngineConfig(prefill_policy=policy, max_num_batched_tokens=self.chunk_size,
                            group_tokens=self.group_tokens, num_layer_groups=self.num_layer_groups,
                            max_layer_groups=self.max_layer_groups, layered_group_table=self.group_table,
                            layered_fill_cohorts=self.fill_cohorts,
                            max_num_seqs=self.max_num_seqs)

    def requests(self, rate: float | None = None) -> list[SimRequest]:
        max_len = self.model.max_position_embeddings
        if self.workload not in WORKLOADS:
            self.from_trace = True
            if rate is not None and rate != self.rate:
                raise ConfigError("--sweep-rates needs a built-in workload; a trace file fixes its own arrivals")
            if self.exact_rate:
                raise ConfigError("--exact-rate scales a built-in workload's drawn arrivals; a trace file fixes "
                                  "its own arrivals (drop --exact-rate, or name a built-in workload)")
            return load_trace(self.workload, max_model_len=max_len, num_requests=self.num_requests)
        return generate(self.workload, num_requests=self.num_requests, rate=self.rate if rate is None else rate,
                        max_model_len=max_len, arrival=self.arrival, cv=self.cv, seed=self.seed,
                        exact_rate=self.exact_rate)

    def run(self, requests: list[SimRequest]) -> dict[str, dict]:
        """policy -> summary of one simulation of `requests` under it."""
        out = {}
        for policy in self.policies:
            sim = Simulator(self.model, self.step_model, self.engine_config(policy), expert_skew=self.expert_skew,
                            expert_rank_offset=self.expert_rank_offset, seed=self.seed)
            out[policy] = sim.run(requests).summary(self.ttft_slo_s, self.tbt_slo_s)
        return out


def rate_range(text: str) -> list[float]:
    """'A:B:STEP' -> [A, A+STEP, ..., <= B]."""
    try:
        lo, hi, step = (float(x) for x in text.split(":"))
    except ValueError:
        raise ConfigError(f"--sweep-rates {text!r}: write A:B:STEP in requests per second, e.g. 0.5:3:0.5") from None
    if not (0 < lo <= hi and step > 0):
        raise ConfigError(f"--sweep-rates {text!r}: need 0 < A <= B and STEP > 0")
    n = int((hi - lo) / step + 1e-9) + 1
    if n > 200:
        raise ConfigError(f"--sweep-rates {text!r} gives {n} rates; use at most 200")
    return [round(lo + i * step, 10) for i in range(n)]


def ratios(results: dict[str, dict]) -> dict[str, float]:
    """layered / chunked for the figures the paper compares (absent unless both ran)."""
    if not {"chunked", "layered"} <= set(results):
        return {}
    chunked, layered = results["chunked"], results["layered"]
    keys = ("expert_bytes", "ttft_mean_s", "ttft_p99_s", "tbt_p99_s", "energy_per_output_token_j")
    return {key: (layered[key] / chunked[key] if chunked[key] else float("nan")) for key in keys}


def format_header(spec: SimulationSpec, requests: list[SimRequest], rates: list[float] | None = None) -> str:
    stats = describe(requests)
    rate = f"{spec.rate:g} req/s" if rates is None else f"{rates[0]:g} to {rates[-1]:g} req/s"
    arrivals = "trace arrivals" if spec.from_trace else (
        f"Poisson {rate}" if spec.arrival == "poisson" else f"bursty {rate}, CV {spec.cv:g}") + \
        (", scaled to offer the rate exactly" if spec.exact_rate else "")
    step_model = spec.step_model
    routing = ("uniform routing" if spec.expert_skew == 0 else
               f"expert popularity ~ (rank + {spec.expert_rank_offset:g})^-{spec.expert_skew:g}")
    groups = f"group tokens {spec.group_tokens}"
    if spec.max_layer_groups:
        table = "" if spec.group_table is None else \
            ", by the table " + ",".join(f"{t}:{g}" for t, g in spec.group_table)
        groups += f" (at most {spec.max_layer_groups} groups{table})"
    if spec.fill_cohorts:
        groups += ", cohorts filled"
    lines = [
        f"{spec.model.name} on {device_label(step_model)} (TP {step_model.tp}); "
        f"chunk {spec.chunk_size} tokens, {groups}; {routing}",
        f"workload {spec.workload}: {len(requests)} requests, {arrivals}",
    ]
    for name in ("input", "output"):
        s = stats[name]
        lines.append(f"  {name:6s} tokens  mean {s['mean']:8,.0f}  median {s['median']:8,.0f}  "
                     f"p90 {s['p90']:8,.0f}  std {s['std']:8,.0f}")
    return "\n".join(lines)


_COLUMNS = (("policy", 8), ("req/s", 6), ("out tok/s", 9), ("TTFT mean s", 11), ("TTFT p99 s", 10),
            ("TBT mean ms", 11), ("TBT p99 ms", 10), ("SLO met", 7), ("expert TB", 9), ("J/out tok", 9),
            ("steps", 9))


def format_results(results: dict[str, dict], spec: SimulationSpec) -> str:
    rows = ["  ".join(f"{t:{'<' if i == 0 else '>'}{w}s}" for i, (t, w) in enumerate(_COLUMNS)),
            "  ".join("-" * w for _, w in _COLUMNS)]
    for policy, r in results.items():
        rows.append(f"{policy:8s}  {r['request_throughput']:6.2f}  {r['output_throughput']:9,.0f}  "
                    f"{r['ttft_mean_s']:11.3f}  {r['ttft_p99_s']:10.3f}  {r['tbt_mean_s'] * 1e3:11.1f}  "
                    f"{r['tbt_p99_s'] * 1e3:10.1f}  {r['slo_attainment']:7.1%}  {r['expert_bytes'] / 1e12:9.1f}  "
                    f"{r['energy_per_output_token_j']:9.3f}  {r['steps']:9,d}")
    rows.append(f"SLO: TTFT <= {spec.ttft_slo_s:g} s and every time between tokens <= {spec.tbt_slo_s * 1e3:g} ms; "
                "energy is the step model's estimate")
    layered_vs_chunked = ratios(results)
    if layered_vs_chunked:
        rows.append("layered vs chunked: " + ", ".join(
            f"{label} {layered_vs_chunked[key]:.2f}x ({layered_vs_chunked[key] - 1:+.0%})" for label, key in (
                ("expert bytes", "expert_bytes"), ("mean TTFT", "ttft_mean_s"), ("p99 TTFT", "ttft_p99_s"),
                ("p99 TBT", "tbt_p99_s"), ("energy/token", "energy_per_output_token_j"))))
    return "\n".join(rows)


def sweep(spec: SimulationSpec, rates: list[float], progress=None) -> list[dict]:
    """SLO attainment (and the rest of the summary) at each rate, for every policy."""
    rows = []
    for rate in rates:
        results = spec.run(spec.requests(rate))
        rows.append({"rate": rate, **{p: r for p, r in results.items()}})
        if progress is not None:
            progress(rate, results)
    return rows


def format_sweep(rows: list[dict], policies: tuple[str, ...]) -> str:
    head = f"{'rate req/s':>10s}  " + "  ".join(f"{p + ' SLO':>12s}  {p + ' TTFT s':>14s}" for p in policies)
    out = [head, "-" * len(head)]
    for row in rows:
        out.append(f"{row['rate']:10.2f}  " + "  ".join(
            f"{row[p]['slo_attainment']:12.1%}  {row[p]['ttft_mean_s']:14.3f}" for p in policies))
    return "\n".join(out)


def plot_sweep(rows: list[dict], spec: SimulationSpec, path: str) -> None:
    """SLO attainment against request rate, one line per policy (the paper's Figure 3 shape)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax_ttft) = plt.subplots(1, 2, figsize=(10, 3.8))
    rates = [r["rate"] for r in rows]
    for policy, style in zip(spec.policies, ("o-", "s-")):
        ax.plot(rates, [100 * r[policy]["slo_attainment"] for r in rows], style, label=policy)
        ax_ttft.plot(rates, [r[policy]["ttft_mean_s"] for r in rows], style, label=policy)
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("SLO attainment (%)")
    ax.set_ylim(0, 105)
    ax.axhline(90, color="grey", lw=0.8, ls="--")
    ax.set_title(f"{spec.workload}: TTFT <= {spec.ttft_slo_s:g} s, TBT <= {spec.tbt_slo_s * 1e3:g} ms")
    ax_ttft.set_xlabel("request rate (req/s)")
    ax_ttft.set_ylabel("mean TTFT (s)")
    ax_ttft.set_yscale("log")
    ax_ttft.set_title(f"{spec.model.name}, {device_label(spec.step_model)}")
    for a in (ax, ax_ttft):
        a.grid(alpha=0.3)
        a.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def to_json(spec: SimulationSpec, requests: list[SimRequest], results: dict | None, rows: list[dict] | None) -> dict:
    config = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)
              if f.name not in ("model", "step_model", "from_trace")}
    config.update(model=spec.model.name, device=spec.step_model.device_name, tp=spec.step_model.tp,
                  policies=list(spec.policies))
    return {"config": config, "workload_stats": describe(requests), "results": results,
            "layered_vs_chunked": ratios(results) if results else None, "sweep": rows}
