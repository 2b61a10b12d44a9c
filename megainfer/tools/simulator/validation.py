"""How well the performance model predicts serving it was not fitted to: every published row
(published_rows.py) simulated as `megainfer simulate` runs it, the curves fitted on all rows at
once, and each row predicted by curves fitted without it (leave-one-out).

The fit moves the H100 curves' parameters that the rows identify (curve_fit.FITTED: the expert
GEMMs' bandwidth and FLOP curve, attention and dense FLOP rates, the step overheads) to minimise
the squared log errors of every row's mean TTFT and mean TBT. Each simulation takes seconds, so
the fit is Gauss-Newton on finite-difference sensitivities taken once around the committed
curves (one simulation of every row per parameter), with a small ridge toward them; a row left
out is refitted the same way from the same sensitivities without its residuals (approximate
leave-one-out: one linearised step, as in a jackknife), and then predicted by a real
simulation with its own refitted curves. Every number reported is a simulation's.

Each row runs as long as the paper's run (`PublishedRow.num_requests`: ten minutes of arrivals).
Near capacity its mean TTFT still swings by tens of percent with the random draw of arrivals and
lengths (Qwen3-30B-A3B chunked at 1.3 req/s, 780 requests: +19% and +93% for two seeds), so every
prediction is the mean of `seeds` simulations with different draws (the sensitivities, which
difference runs on the same draw, use the first seed alone). A prediction's draws offer exactly
the row's rate (workload.arrival_times, exact_rate): a free draw's arrivals stray from it by a few
percent, which near capacity moves the wait by a factor and, TTFT being convex in the load, biases
the mean of draws upward (seeds 0 and 2 of 1,560 arrivals at 2.6 req/s run 6-7% fast). The
paper's run is itself one free draw: the report prints beside each figure how far such a draw
strays, and the fit weighs each residual by the deviation it is expected to have
(residual_weights: the model's own ~10%, the paper's draw and the prediction's), so a
near-capacity TTFT that one draw moves by half does not bend the curves every other row uses.

    megainfer simulate --validate [--json PATH] [--requests N] [--seeds 2]
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from megainfer.presets import PRESETS
from megainfer.tools.simulator.curve_fit import FITTED, FitParameter, from_vector, to_vector
from megainfer.tools.simulator.experiment import SimulationSpec
from megainfer.tools.bench.workload import SimRequest
from megainfer.tools.simulator.published_rows import OFFLINE, ROWS, SERVING, SINGLE_PROMPT, PublishedRow
from planner.catalog import Catalog
from planner.efficiency_curves import EfficiencyCurves
from planner.step_cost_model import ColocatedStepModel

BAR_LEFT_OUT = 0.35  # issue 37: every row within 35% when left out
BAR_MEAN = 0.20  # and the mean absolute error at most 20%
BAR_FITTED = 0.25  # every row within 25% when fitted
BAR_SATURATION = 0.05  # the simulated served rate within 5% of the offered rate
SEEDS = 2  # draws of arrivals and lengths each prediction averages
RIDGE = 0.02  # pulls each log-parameter toward the committed curves (identifies what the rows do not)
STEP = 0.15  # finite-difference step in each log-parameter
HALVINGS = 2  # a step that raises the squared error is halved up to this many times
# The error a row's figure carries beside its draw noise: the model's own, about the spread of the
# steady rows' TBT. A residual's weight is MODEL_SIGMA over its whole expected deviation
# (residual_weights), so a figure that swings by a factor with the draw of arrivals pulls the fit
# no harder than its one realisation deserves.
MODEL_SIGMA = 0.10
# curve_fit's parameters and the terms only several models, TP degrees and policies pin down:
# the expert GEMMs' width, a TP all-reduce's latency (TP 2 and 8), the host's time to issue a
# layer (fitted with the rest, though every published row's layers take longer, so the ridge
# holds it at its start: it binds small decode steps the rows do not reach), the 4-bit
# experts' kernel, how far the expert GEMMs' weight streaming and MMAs overlap, decode attention's achieved
# bandwidth reading the paged KV cache (contexts from 2,000 to 20,000 tokens across the rows), and
# the 4-bit kernel's weight streaming against the bf16 one's (gpt-oss-120b at TP 2 and 8), and the
# request's way outside the engine that every client-measured TTFT carries (short prompts at low
# load show it: gpt-oss-120b on ShareGPT at 0.2 s), and each kernel's launch inside a step (16 per
# layer: across models of 24, 36, 48 and 94 layers it is no longer collinear with the fixed cost
# per step, as it was over Qwen3-30B's rows alone), and the expert GEMMs' weight streaming with
# tiles tuned for their shape (Qwen3-235B at TP 8, its chunked and layered rows) against the
# default tiles every other bf16 row ran.
PARAMETERS = FITTED + (
    FitParameter("moe_width_half", 1.0, 16384.0), FitParameter("allreduce_latency_s", 1e-6, 1e-4),
    FitParameter("layer_host_s", 1e-6, 1e-3), FitParameter("moe_quantized_flops_half", 0.01, 4096.0),
    FitParameter("moe_overlap", 1.0, 64.0), FitParameter("attention.bandwidth.peak", 0.01, 1.0),
    FitParameter("moe_quantized_bandwidth", 0.05, 1.5), FitParameter("request_latency_s", 1e-4, 0.5),
    FitParameter("launch_s", 1e-7, 2e-5), FitParameter("moe_tuned_bandwidth", 0.5, 2.0))
WIDTH_START = 512.0  # where the width term starts (tokens of expert width at half efficiency)
LAYER_HOST_START = 100e-6  # where the host's layer starts: a few graph replays and an eager attention call
OVERLAP_START = 4.0  # where the expert GEMMs' p-norm starts: within 19% of the max where both times are equal
REQUEST_LATENCY_START = 0.01  # where the request's way starts: an HTTP round trip and a tokenisation


def with_width(curves: EfficiencyCurves, reference_width: float = 384.0) -> EfficiencyCurves:
    """`curves` with the width term at WIDTH_START where it has none, the expert FLOP peak raised
    so that an expert of `reference_width` (Qwen3-30B-A3B at TP 2, what the curves were fitted on)
    is priced as before, the host's layer at LAYER_HOST_START where it has none (log space needs
    a start above 0), the 4-bit experts' kernel (FLOP curve and weight streaming) as the bf16 one,
    tuned expert tiles as the default ones and the request's way at REQUEST_LATENCY_START."""
    if not curves.layer_host_s:
        curves = curves.with_values(layer_host_s=LAYER_HOST_START)
    if not curves.moe_quantized_flops_half:  # the 4-bit kernel starts as the bf16 one
        curves = curves.with_values(moe_quantized_flops_half=curves.moe.flops.half)
    if not curves.moe_overlap:  # the expert GEMMs start near the roofline's max
        curves = curves.with_values(moe_overlap=OVERLAP_START)
    if not curves.moe_quantized_bandwidth:  # the 4-bit kernel streams weights as the bf16 one
        curves = curves.with_values(moe_quantized_bandwidth=1.0)
    if not curves.request_latency_s:
        curves = curves.with_values(request_latency_s=REQUEST_LATENCY_START)
    if not curves.moe_tuned_bandwidth:  # tuned tiles start as the default ones
        curves = curves.with_values(moe_tuned_bandwidth=1.0)
    if curves.moe_width_half:
        return curves
    moe = curves.moe
    peak = min(moe.flops.peak * (reference_width + WIDTH_START) / reference_width, 1.0)
    flops = type(moe.flops)(peak, moe.flops.half)
    return curves.with_values(moe=type(moe)(flops, moe.bandwidth), moe_width_half=WIDTH_START)


@dataclass
class Prediction:
    ttft_mean_s: float
    tbt_mean_s: float
    served_rate: float  # requests per second the instance keeps up with (SimResult.served_rate)
    queue_growth: float = 1.0  # late requests' mean TTFT over early ones' (SimResult.queue_growth)
    offered_rate: float = 0.0  # this run's arrivals per second (SimResult.offered_rate)
    throughput_tok_s: float = 0.0  # output tokens per second over the run

    def values(self) -> dict[str, float]:
        return {"ttft": self.ttft_mean_s, "tbt": self.tbt_mean_s, "throughput": self.throughput_tok_s}

    def saturated(self, row: PublishedRow) -> bool:
        """A serving row's simulated instance fell behind the offered rate: its served rate (the
        offered rate over 1 + the wait's growth, SimResult.served_rate) more than 5% short of the
        run's own arrivals."""
        return row.kind == SERVING and self.served_rate < (1 - BAR_SATURATION) * (self.offered_rate or row.rate)

    @classmethod
    def mean(cls, draws: list["Prediction"]) -> "Prediction":
        """The mean of the same row's simulations under different random draws."""
        return cls(*(float(np.mean([getattr(p, f.name) for p in draws])) for f in dataclasses.fields(cls)))

    def errors(self, row: PublishedRow) -> dict[str, float]:
        """Relative error of each metric the row measured: predicted / measured - 1."""
        values = self.values()
        return {name: values[name] / measured - 1 for name, measured in row.measured.items()}


def row_requests(row: PublishedRow, spec: SimulationSpec) -> list[SimRequest]:
    """What `row`'s run sent, in the row's model's tokens (`PublishedRow.length_scale`)."""
    if row.kind == SINGLE_PROMPT:
        return [SimRequest(0.0, row.prompt_tokens, 1)]
    requests = spec.requests()
    if row.length_scale != 1.0:  # the quoted lengths in the model's own tokens
        s = row.length_scale
        requests = [dataclasses.replace(q, input_len=max(1, round(q.input_len * s)),
                                        output_len=max(1, round(q.output_len * s))) for q in requests]
    if row.kind == OFFLINE:  # every request at once: the instance's peak throughput
        requests = [dataclasses.replace(q, arrival_s=0.0) for q in requests]
    return requests


def predict(row: PublishedRow, curves: EfficiencyCurves, num_requests: int | None = None, seed: int = 0,
            exact_rate: bool = True) -> Prediction:
    """`row` as `megainfer simulate --exact-rate` runs it with `curves`, as long as the paper's
    run (`row.num_requests`) unless `num_requests` says otherwise. `exact_rate` False: the draw's
    arrivals as drawn, their rate off the row's by the draw's own error, as the paper's run was."""
    spec = row_spec(row, curves, num_requests, seed, exact_rate)
    s = spec.run(row_requests(row, spec))[row.policy]
    return Prediction(s["ttft_mean_s"], s["tbt_mean_s"], s["served_rate"], s["queue_growth"], s["offered_rate"],
                      s["output_throughput"])


def row_spec(row: PublishedRow, curves: EfficiencyCurves, num_requests: int | None = None, seed: int = 0,
             exact_rate: bool = True) -> SimulationSpec:
    """The simulation of `row` (`predict`)."""
    model = PRESETS[row.model]
    if not row.windowed_attention and model.window_layers:
        model = dataclasses.replace(model, window_layers=())
    gpu = Catalog.load()[row.gpu]
    step_model = ColocatedStepModel(model, gpu, row.gpus, curves=curves,
                                    expert_bytes_per_param=row.expert_bytes_per_param,
                                    tuned_expert_tiles=row.tuned_expert_tiles)
    spec = SimulationSpec(model=model, step_model=step_model, workload=row.workload, rate=row.rate or 1.0,
                          num_requests=num_requests or row.num_requests, policies=(row.policy,),
                          chunk_size=row.chunk_size, max_layer_groups=row.max_layer_groups,
                          group_table=row.group_table, fill_cohorts=True,
                          max_num_seqs=row.max_num_seqs, seed=seed, exact_rate=exact_rate)
    return spec


def residuals(predictions: list[Prediction], rows=ROWS, weights: np.ndarray | None = None) -> np.ndarray:
    """Log errors, two slots per row (TTFT then TBT; a row that measured one figure, its log
    error and 0), each times its weight (residual_weights; none: 1): what the fit minimises."""
    out = []
    for p, r in zip(predictions, rows):
        logs = [math.log1p(e) for e in p.errors(r).values()]
        out += (logs + [0.0])[:2]
    return np.array(out) * (1.0 if weights is None else weights)


def draw_spread(draws: list[Prediction], row: PublishedRow) -> dict[str, float]:
    """How far one draw of arrivals and lengths strays, by measured metric: the standard
    deviation of the log of the figure across `draws` (0 with one draw). The paper's run is one
    such draw, so a figure is only as reproducible as this."""
    return {name: float(np.std([math.log(p.values()[name]) for p in draws], ddof=1)) if len(draws) > 1 else 0.0
            for name in row.measured}


def draw_spreads(draws: list[list[Prediction]], rows) -> list[dict[str, float]]:
    """draw_spread of every row's draws."""
    return [draw_spread(d, row) for d, row in zip(draws, rows)]


def residual_weights(run_spreads: list[dict[str, float]], prediction_spreads: list[dict[str, float]],
                     seeds: int) -> np.ndarray:
    """Each residual's weight, in the slots of `residuals`: MODEL_SIGMA over the deviation the
    figure is expected to have, in quadrature the model's own, the measured run's draw noise (one
    free draw: `run_spreads`) and the prediction's (the mean of `seeds` draws at the exact rate:
    `prediction_spreads`)."""
    out = []
    for run, prediction in zip(run_spreads, prediction_spreads):
        w = [MODEL_SIGMA / math.sqrt(MODEL_SIGMA ** 2 + run[name] ** 2 + prediction[name] ** 2 / seeds)
             for name in run]
        out += (w + [1.0])[:2]
    return np.array(out)


@dataclass
class RowResult:
    row: PublishedRow
    fitted: Prediction
    left_out: Prediction
    spread: dict[str, float] = field(default_factory=dict)  # draw_spread of free draws at the fitted curves

    def as_dict(self) -> dict:
        def side(p: Prediction) -> dict:
            return {**{name: p.values()[name] for name in self.row.measured}, "errors": p.errors(self.row),
                    "served_rate": p.served_rate, "offered_rate": p.offered_rate, "queue_growth": p.queue_growth}

        return {"label": self.row.label, "kind": self.row.kind, "rate": self.row.rate, "measured": self.row.measured,
                "fitted": side(self.fitted), "left_out": side(self.left_out), "draw_spread": self.spread}


@dataclass
class Validation:
    rows: list[RowResult]
    start_curves: EfficiencyCurves
    fitted_curves: EfficiencyCurves
    wall_s: float = 0.0
    notes: list[str] = field(default_factory=list)
    seeds: int = SEEDS  # draws each prediction averages

    def mean_abs(self, which: str) -> dict[str, float]:
        """Mean absolute relative error by metric (over the rows that measured it) and of all."""
        by_metric: dict[str, list[float]] = {}
        for r in self.rows:
            for name, e in getattr(r, which).errors(r.row).items():
                by_metric.setdefault(name, []).append(abs(e))
        out = {name: float(np.mean(v)) for name, v in by_metric.items()}
        out["all"] = float(np.mean([e for v in by_metric.values() for e in v]))
        return out

    def within(self, which: str, bar: float = BAR_LEFT_OUT) -> tuple[int, int]:
        """(errors within `bar`, errors) over every row's every metric."""
        errors = [abs(e) for r in self.rows for e in getattr(r, which).errors(r.row).values()]
        return sum(e <= bar for e in errors), len(errors)

    def directions(self, which: str) -> list[tuple[str, bool]]:
        """Every layered row against the chunked row (chunk 512) of its configuration: whether the
        predicted mean TTFT (offline: throughput) goes the measured way."""
        out = []
        by_config = {}
        for r in self.rows:
            by_config.setdefault(r.row.config, []).append(r)
        for group in by_config.values():
            chunked = [r for r in group if r.row.policy == "chunked" and r.row.chunk_size == 512]
            for layered in (r for r in group if r.row.policy == "layered"):
                for c in chunked:
                    metric = "throughput" if layered.row.kind == OFFLINE else "ttft"
                    measured = layered.row.measured[metric] < c.row.measured[metric]
                    predicted = getattr(layered, which).values()[metric] < getattr(c, which).values()[metric]
                    out.append((f"{layered.row.label} vs chunked", measured == predicted))
        return out

    def saturated(self, which: str) -> list[str]:
        """Serving rows whose simulated served rate falls short of the offered one (the real one kept up)."""
        return [r.row.label for r in self.rows if getattr(r, which).saturated(r.row)]

    def swung_by_the_draw(self, bar: float = BAR_LEFT_OUT) -> list[tuple[str, str]]:
        """(row, metric) of every figure that one draw of arrivals and lengths moves by more than
        `bar` (its draw spread, as a ratio): the paper's one run of it could miss any model by
        that much."""
        return [(r.row.label, name) for r in self.rows for name, s in r.spread.items() if math.expm1(s) > bar]

    def error_band(self) -> dict[str, float]:
        """What plan and simulate print beside a prediction: the mean absolute left-out error."""
        return self.mean_abs("left_out")

    def as_dict(self) -> dict:
        return {"rows": [r.as_dict() for r in self.rows], "mean_abs_error": {"fitted": self.mean_abs("fitted"),
                                                                             "left_out": self.mean_abs("left_out")},
                "within_bar": {w: dict(zip(("within", "of"), self.within(w, bar)), bar=bar)
                               for w, bar in (("fitted", BAR_FITTED), ("left_out", BAR_LEFT_OUT))},
                "directions": {w: [{"pair": p, "ok": ok} for p, ok in self.directions(w)] for w in ("fitted", "left_out")},
                "saturated": {w: self.saturated(w) for w in ("fitted", "left_out")},
                "swung_by_the_draw": [{"row": label, "metric": name} for label, name in self.swung_by_the_draw()],
                "bars": {"left_out_row": BAR_LEFT_OUT, "left_out_mean": BAR_MEAN, "fitted_row": BAR_FITTED},
                "fitted_curves": {p.name: p.get(self.fitted_curves) for p in PARAMETERS},
                "seeds": self.seeds, "wall_s": self.wall_s, "notes": self.notes}


def _predict_job(job: tuple) -> Prediction:
    return predict(*job)


class _Simulations:
    """The validation's simulations, spread over `workers` processes (the cores): each is one
    row under one set of curves and one random draw, independent of the others."""

    def __init__(self, rows, num_requests: int | None, workers: int, seeds: int) -> None:
        self.rows, self.num_requests, self.seeds = rows, num_requests, seeds
        self.pool = ProcessPoolExecutor(workers) if workers > 1 else None

    def _draws(self, row: PublishedRow, seeds: int) -> range:
        return range(1 if row.kind == SINGLE_PROMPT else seeds)  # one prompt alone: no arrivals to draw

    def run(self, jobs: list[tuple[PublishedRow, EfficiencyCurves]], seeds: int | None = None,
            exact_rate: bool = True) -> list[list[Prediction]]:
        """Each job's simulations, one per draw (`seeds`, default the validation's); `exact_rate`
        False: free draws, as the paper's runs were (draw_spread)."""
        seeds = self.seeds if seeds is None else seeds
        flat = [(row, curves, self.num_requests, seed, exact_rate)
                for row, curves in jobs for seed in self._draws(row, seeds)]
        done = iter([_predict_job(job) for job in flat] if self.pool is None else self.pool.map(_predict_job, flat))
        return [[next(done) for _ in self._draws(row, seeds)] for row, _ in jobs]

    def each_row(self, *curves_sets: EfficiencyCurves, seeds: int | None = None,
                 exact_rate: bool = True) -> list[list[list[Prediction]]]:
        """Every row under each set of curves, all at once: per set, per row, the draws."""
        flat = self.run([(row, curves) for curves in curves_sets for row in self.rows], seeds, exact_rate)
        n = len(self.rows)
        return [flat[i * n:(i + 1) * n] for i in range(len(curves_sets))]

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown()


def _solve(jacobian: np.ndarray, r: np.ndarray, keep: np.ndarray, offset: np.ndarray) -> np.ndarray:
    """The Gauss-Newton step on the residuals `keep` selects, from a point `offset` away from the
    committed curves, for the residuals plus a ridge toward the committed curves."""
    j, r = jacobian[keep], r[keep]
    ridge = RIDGE * len(r)
    return np.linalg.solve(j.T @ j + ridge * np.eye(jacobian.shape[1]), -j.T @ r - ridge * offset)


def _sensitivities(sims: _Simulations, curves: EfficiencyCurves, x: np.ndarray, first_draw: list[Prediction],
                   weights: np.ndarray, say) -> np.ndarray:
    """d weighted residuals / d log-parameter, each from the first draw moved against the same
    draw at `x`."""
    say(f"  sensitivities to {len(PARAMETERS)} parameters: {len(PARAMETERS) * len(sims.rows)} simulations")
    moved = []
    for k in range(len(PARAMETERS)):
        xk = x.copy()
        xk[k] += STEP
        moved.append(from_vector(curves, xk, PARAMETERS))
    r = residuals(first_draw, sims.rows, weights)
    columns = [(residuals([d[0] for d in p], sims.rows, weights) - r) / STEP
               for p in sims.each_row(*moved, seeds=1)]
    return np.stack(columns, axis=1)


class _Point:
    """The rows simulated at one set of curves: every draw, their means and spreads, and the
    weighted residuals."""

    def __init__(self, draws: list[list[Prediction]], rows, weights: np.ndarray | None = None) -> None:
        self.first_draw = [d[0] for d in draws]
        self.predictions = [Prediction.mean(d) for d in draws]
        self.spreads = draw_spreads(draws, rows)
        self.r = residuals(self.predictions, rows, weights)


def validate(curves: EfficiencyCurves, rows=ROWS, num_requests: int | None = None, progress=None,
             iterations: int = 1, workers: int | None = None, seeds: int = SEEDS) -> Validation:
    """`iterations` Gauss-Newton steps for the fit on all rows (sensitivities taken afresh at each
    point, a step that raises the error halved); the rows left out take one more step from the
    last linearisation point without their residuals. Every prediction is the mean of `seeds`
    draws. `workers` processes (default: the cores)."""
    started = time.perf_counter()
    say = progress or (lambda text: None)
    sims = _Simulations(rows, num_requests, workers or os.cpu_count() or 1, seeds)
    try:
        curves = with_width(curves)
        x0 = to_vector(curves, PARAMETERS)
        x = x0.copy()
        everything = np.ones(2 * len(rows), dtype=bool)
        say(f"simulating {len(rows)} rows with the committed curves, {seeds} draws each at the rows' rates "
            "and as many free ones ...")
        start, free = sims.each_row(curves)[0], sims.each_row(curves, exact_rate=False)[0]
        # Weights from the draws at the committed curves, fixed for the whole fit so that every
        # point's error is measured alike.
        weights = residual_weights(draw_spreads(free, rows), _Point(start, rows).spreads, seeds)
        point = _Point(start, rows, weights)
        last_x, last_point, last_j = x, point, None
        for it in range(iterations):
            say(f"step {it + 1}/{iterations} (squared log error {float(point.r @ point.r):.3f})")
            jacobian = _sensitivities(sims, curves, x, point.first_draw, weights, say)
            last_x, last_point, last_j = x, point, jacobian
            step = _solve(jacobian, point.r, everything, x - x0)
            before = float(last_point.r @ last_point.r)
            for _ in range(HALVINGS + 1):  # the simulated responses are far from linear near capacity
                point = _Point(sims.each_row(from_vector(curves, last_x + step, PARAMETERS))[0], rows, weights)
                if float(point.r @ point.r) <= before:
                    x = last_x + step
                    break
                say(f"  the step raised the error ({float(point.r @ point.r):.3f} > {before:.3f}): halved")
                step = step / 2
            else:  # no step helped: the fit has converged as far as these sensitivities see
                point = last_point
                say("  no step lowered the error: kept the point")
        say(f"fitted (squared log error {float(point.r @ point.r):.3f}); {len(rows)} rows left out, each refitted "
            "and simulated")
        refits = []
        for i in range(len(rows)):
            keep = everything.copy()
            keep[2 * i:2 * i + 2] = False
            refit = x if last_j is None else last_x + _solve(last_j, last_point.r, keep, last_x - x0)
            refits.append(from_vector(curves, refit, PARAMETERS))
        left_out = [Prediction.mean(d) for d in sims.run(list(zip(rows, refits)))]
        say("free draws at the fitted curves: how far the paper's one run of each row may stray")
        spreads = draw_spreads(sims.each_row(from_vector(curves, x, PARAMETERS), exact_rate=False)[0], rows)
    finally:
        sims.close()
    results = [RowResult(row, f, o, spread) for row, f, o, spread in zip(rows, point.predictions, left_out, spreads)]
    return Validation(results, curves, from_vector(curves, x, PARAMETERS), time.perf_counter() - started,
                      seeds=seeds)


UNITS = {"ttft": ("TTFT s", 1.0, "8.3f"), "tbt": ("TBT ms", 1e3, "8.1f"), "throughput": ("tok/s", 1.0, "8.1f")}


def format_report(v: Validation) -> str:
    head = (f"{'row':48s} {'metric':>7s} {'measured':>8s} {'fitted':>8s} {'err':>6s} {'left out':>8s} {'err':>6s} "
            f"{'draws':>6s}")
    lines = [head, "-" * len(head)]
    for r in v.rows:
        fe, le = r.fitted.errors(r.row), r.left_out.errors(r.row)
        for i, (name, measured) in enumerate(r.row.measured.items()):
            unit, scale, fmt = UNITS[name]
            lines.append(f"{r.row.label if i == 0 else '':48s} {unit:>7s} {measured * scale:{fmt}} "
                         f"{r.fitted.values()[name] * scale:{fmt}} {fe[name]:+6.0%} "
                         f"{r.left_out.values()[name] * scale:{fmt}} {le[name]:+6.0%} "
                         f"{math.expm1(r.spread.get(name, 0.0)):>6.0%}")
    fit, out = v.mean_abs("fitted"), v.mean_abs("left_out")

    def by_metric(errors: dict[str, float]) -> str:
        return ", ".join(f"{UNITS[n][0].split()[0]} {errors[n]:.0%}" for n in UNITS if n in errors) + \
            f", all {errors['all']:.0%}"

    lines.append("")
    lines.append(f"each prediction the mean of {v.seeds} simulations (draws of arrivals and lengths, the arrivals "
                 "scaled to the row's rate); draws: how far one free draw strays (its log's deviation across "
                 f"{v.seeds}), as the paper's one run may")
    lines.append(f"mean absolute error, fitted:   {by_metric(fit)}")
    lines.append(f"mean absolute error, left out: {by_metric(out)} (bar: each row within {BAR_LEFT_OUT:.0%}, "
                 f"mean within {BAR_MEAN:.0%})")
    ok, n = v.within("left_out")
    ok_fit, _ = v.within("fitted", BAR_FITTED)
    lines.append(f"within the bars: {ok} of {n} figures within {BAR_LEFT_OUT:.0%} left out, "
                 f"{ok_fit} of {n} within {BAR_FITTED:.0%} fitted")
    for which in ("fitted", "left_out"):
        wrong = [p for p, ok in v.directions(which) if not ok]
        lines.append(f"layered vs chunked, {which.replace('_', ' ')}: {len(v.directions(which)) - len(wrong)} of "
                     f"{len(v.directions(which))} in the measured direction" + (f" (not: {'; '.join(wrong)})" if wrong else ""))
        saturated = v.saturated(which)
        lines.append(f"saturated where the real system kept up, {which.replace('_', ' ')}: "
                     + (", ".join(saturated) if saturated else "none"))
    swung = v.swung_by_the_draw()
    lines.append(f"figures one draw moves by more than {BAR_LEFT_OUT:.0%} (the paper's one run may miss any model "
                 f"by that much): " + ("; ".join(f"{label} {UNITS[name][0].split()[0]}" for label, name in swung)
                                       if swung else "none"))
    lines.append("fitted curves: " + ", ".join(f"{p.name} {p.get(v.fitted_curves):.4g}" for p in PARAMETERS))
    lines.append(f"validated in {v.wall_s:.0f} s")
    return "\n".join(lines)
