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

    megainfer simulate --validate [--json PATH] [--requests 300]
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np

from megainfer.presets import PRESETS
from megainfer.tools.simulator.curve_fit import FITTED, FitParameter, from_vector, to_vector
from megainfer.tools.simulator.experiment import SimulationSpec
from megainfer.tools.simulator.published_rows import ROWS, PublishedRow
from planner.catalog import Catalog
from planner.efficiency_curves import EfficiencyCurves
from planner.step_cost_model import ColocatedStepModel

BAR_LEFT_OUT = 0.35  # issue 37: every row within 35% when left out
BAR_MEAN = 0.20  # and the mean absolute error at most 20%
BAR_FITTED = 0.25  # every row within 25% when fitted
BAR_SATURATION = 0.05  # the simulated served rate within 5% of the offered rate
QUEUE_GROWTH = 3.0  # late requests' mean TTFT over early ones' beyond which a queue is growing
RIDGE = 0.05  # pulls each log-parameter toward the committed curves (identifies what the rows do not)
STEP = 0.15  # finite-difference step in each log-parameter
# curve_fit's parameters and the expert GEMMs' width, which only several models pin down.
PARAMETERS = FITTED + (FitParameter("moe_width_half", 1.0, 16384.0),)
WIDTH_START = 512.0  # where the width term starts (tokens of expert width at half efficiency)


def with_width(curves: EfficiencyCurves, reference_width: float = 384.0) -> EfficiencyCurves:
    """`curves` with the width term at WIDTH_START where it has none, the expert FLOP peak raised
    so that an expert of `reference_width` (Qwen3-30B-A3B at TP 2, what the curves were fitted on)
    is priced as before."""
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
    served_rate: float  # requests per second completed, the drain left out (SimResult.served_rate)
    queue_growth: float = 1.0  # late requests' mean TTFT over early ones' (SimResult.queue_growth)

    def saturated(self, row: PublishedRow) -> bool:
        """The simulated instance fell behind the offered rate: its served rate more than 5% short,
        or its queue growing over the run (late requests waiting over twice as long as early ones:
        with 300 requests of arXiv's ~10 s a rate alone is too noisy to tell at 5%)."""
        return self.served_rate < (1 - BAR_SATURATION) * row.rate or self.queue_growth > QUEUE_GROWTH

    def errors(self, row: PublishedRow) -> tuple[float, float]:
        """(TTFT, TBT) relative errors: predicted / measured - 1."""
        return self.ttft_mean_s / row.ttft_mean_s - 1, self.tbt_mean_s / row.tbt_mean_s - 1


def predict(row: PublishedRow, curves: EfficiencyCurves, num_requests: int = 300, seed: int = 0) -> Prediction:
    """`row` as `megainfer simulate` runs it with `curves` (the command's defaults otherwise)."""
    model = PRESETS[row.model]
    gpu = Catalog.load()[row.gpu]
    step_model = ColocatedStepModel(model, gpu, row.gpus, curves=curves,
                                    expert_bytes_per_param=row.expert_bytes_per_param)
    spec = SimulationSpec(model=model, step_model=step_model, workload=row.workload, rate=row.rate,
                          num_requests=num_requests, policies=(row.policy,), chunk_size=row.chunk_size,
                          group_tokens=row.group_tokens, num_layer_groups=row.num_layer_groups, seed=seed)
    s = spec.run(spec.requests())[row.policy]
    return Prediction(s["ttft_mean_s"], s["tbt_mean_s"], s["served_rate"], s["queue_growth"])


def residuals(predictions: list[Prediction], rows=ROWS) -> np.ndarray:
    """Log errors, TTFT then TBT per row: what the fit minimises."""
    return np.array([v for p, r in zip(predictions, rows)
                     for v in (math.log(p.ttft_mean_s / r.ttft_mean_s), math.log(p.tbt_mean_s / r.tbt_mean_s))])


@dataclass
class RowResult:
    row: PublishedRow
    fitted: Prediction
    left_out: Prediction

    def as_dict(self) -> dict:
        fit, out = self.fitted.errors(self.row), self.left_out.errors(self.row)
        return {"label": self.row.label, "measured_ttft_s": self.row.ttft_mean_s, "measured_tbt_s": self.row.tbt_mean_s,
                "offered_rate": self.row.rate,
                "fitted": {"ttft_s": self.fitted.ttft_mean_s, "tbt_s": self.fitted.tbt_mean_s,
                           "ttft_error": fit[0], "tbt_error": fit[1], "served_rate": self.fitted.served_rate, "queue_growth": self.fitted.queue_growth},
                "left_out": {"ttft_s": self.left_out.ttft_mean_s, "tbt_s": self.left_out.tbt_mean_s,
                             "ttft_error": out[0], "tbt_error": out[1], "served_rate": self.left_out.served_rate, "queue_growth": self.left_out.queue_growth}}


@dataclass
class Validation:
    rows: list[RowResult]
    start_curves: EfficiencyCurves
    fitted_curves: EfficiencyCurves
    wall_s: float = 0.0
    notes: list[str] = field(default_factory=list)

    def mean_abs(self, which: str) -> dict[str, float]:
        errors = np.array([getattr(r, which).errors(r.row) for r in self.rows])
        return {"ttft": float(np.abs(errors[:, 0]).mean()), "tbt": float(np.abs(errors[:, 1]).mean()),
                "all": float(np.abs(errors).mean())}

    def directions(self, which: str) -> list[tuple[str, bool]]:
        """Every layered row against the chunked row of its configuration: whether the predicted
        mean TTFT ratio goes the measured way."""
        out = []
        by_config = {}
        for r in self.rows:
            by_config.setdefault(r.row.config, []).append(r)
        for group in by_config.values():
            chunked = [r for r in group if r.row.policy == "chunked" and r.row.chunk_size == 512]
            for layered in (r for r in group if r.row.policy == "layered"):
                for c in chunked:
                    measured = layered.row.ttft_mean_s < c.row.ttft_mean_s
                    predicted = getattr(layered, which).ttft_mean_s < getattr(c, which).ttft_mean_s
                    out.append((f"{layered.row.label} vs chunked", measured == predicted))
        return out

    def saturated(self, which: str) -> list[str]:
        """Rows whose simulated served rate falls short of the offered one (the real one kept up)."""
        return [r.row.label for r in self.rows if getattr(r, which).saturated(r.row)]

    def error_band(self) -> dict[str, float]:
        """What plan and simulate print beside a prediction: the mean absolute left-out error."""
        return self.mean_abs("left_out")

    def as_dict(self) -> dict:
        return {"rows": [r.as_dict() for r in self.rows], "mean_abs_error": {"fitted": self.mean_abs("fitted"),
                                                                             "left_out": self.mean_abs("left_out")},
                "directions": {w: [{"pair": p, "ok": ok} for p, ok in self.directions(w)] for w in ("fitted", "left_out")},
                "saturated": {w: self.saturated(w) for w in ("fitted", "left_out")},
                "bars": {"left_out_row": BAR_LEFT_OUT, "left_out_mean": BAR_MEAN, "fitted_row": BAR_FITTED},
                "wall_s": self.wall_s, "notes": self.notes}


def _evaluate(curves: EfficiencyCurves, rows, num_requests: int) -> list[Prediction]:
    return [predict(row, curves, num_requests) for row in rows]


def _solve(jacobian: np.ndarray, r: np.ndarray, keep: np.ndarray, offset: np.ndarray) -> np.ndarray:
    """The Gauss-Newton step on the residuals `keep` selects, from a point `offset` away from the
    committed curves, for the residuals plus a ridge toward the committed curves."""
    j, r = jacobian[keep], r[keep]
    ridge = RIDGE * len(r)
    return np.linalg.solve(j.T @ j + ridge * np.eye(jacobian.shape[1]), -j.T @ r - ridge * offset)


def _sensitivities(curves: EfficiencyCurves, x: np.ndarray, r: np.ndarray, rows, num_requests: int, say) -> np.ndarray:
    jacobian = np.zeros((len(r), len(PARAMETERS)))
    for k, param in enumerate(PARAMETERS):
        say(f"  sensitivity {k + 1}/{len(PARAMETERS)}: {param.name}")
        moved = x.copy()
        moved[k] += STEP
        jacobian[:, k] = (residuals(_evaluate(from_vector(curves, moved, PARAMETERS), rows, num_requests), rows) - r) / STEP
    return jacobian


def validate(curves: EfficiencyCurves, rows=ROWS, num_requests: int = 300, progress=None,
             iterations: int = 1) -> Validation:
    """`iterations` Gauss-Newton steps for the fit on all rows (sensitivities taken afresh at each
    point); the rows left out take one more step from the last point without their residuals."""
    started = time.perf_counter()
    say = progress or (lambda text: None)
    curves = with_width(curves)
    x0 = to_vector(curves, PARAMETERS)
    x = x0.copy()
    everything = np.ones(2 * len(rows), dtype=bool)
    say(f"simulating {len(rows)} rows with the committed curves ...")
    r = residuals(_evaluate(curves, rows, num_requests), rows)
    for it in range(iterations):
        say(f"step {it + 1}/{iterations}")
        jacobian = _sensitivities(curves, x, r, rows, num_requests, say)
        last_x, last_r, last_j = x, r, jacobian
        x = x + _solve(jacobian, r, everything, x - x0)
        fitted = _evaluate(from_vector(curves, x, PARAMETERS), rows, num_requests)
        r = residuals(fitted, rows)
    fitted_curves = from_vector(curves, x, PARAMETERS)
    results = []
    for i, row in enumerate(rows):
        keep = everything.copy()
        keep[2 * i:2 * i + 2] = False
        say(f"left out {i + 1}/{len(rows)}: {row.label}")
        refit = last_x + _solve(last_j, last_r, keep, last_x - x0)
        results.append(RowResult(row, fitted[i], predict(row, from_vector(curves, refit, PARAMETERS), num_requests)))
    return Validation(results, curves, fitted_curves, time.perf_counter() - started)


def format_report(v: Validation) -> str:
    head = (f"{'row':46s} {'TTFT s':>7s} {'fit':>7s} {'err':>6s} {'left out':>8s} {'err':>6s}   "
            f"{'TBT ms':>6s} {'fit':>6s} {'err':>6s} {'left out':>8s} {'err':>6s}")
    lines = [head, "-" * len(head)]
    for r in v.rows:
        fe, le = r.fitted.errors(r.row), r.left_out.errors(r.row)
        lines.append(f"{r.row.label:46s} {r.row.ttft_mean_s:7.3f} {r.fitted.ttft_mean_s:7.3f} {fe[0]:+6.0%} "
                     f"{r.left_out.ttft_mean_s:8.3f} {le[0]:+6.0%}   {r.row.tbt_mean_s * 1e3:6.1f} "
                     f"{r.fitted.tbt_mean_s * 1e3:6.1f} {fe[1]:+6.0%} {r.left_out.tbt_mean_s * 1e3:8.1f} {le[1]:+6.0%}")
    fit, out = v.mean_abs("fitted"), v.mean_abs("left_out")
    lines.append("")
    lines.append(f"mean absolute error, fitted:   TTFT {fit['ttft']:.0%}, TBT {fit['tbt']:.0%}, all {fit['all']:.0%}")
    lines.append(f"mean absolute error, left out: TTFT {out['ttft']:.0%}, TBT {out['tbt']:.0%}, all {out['all']:.0%} "
                 f"(bar: each row within {BAR_LEFT_OUT:.0%}, mean within {BAR_MEAN:.0%})")
    for which in ("fitted", "left_out"):
        wrong = [p for p, ok in v.directions(which) if not ok]
        lines.append(f"layered vs chunked, {which.replace('_', ' ')}: {len(v.directions(which)) - len(wrong)} of "
                     f"{len(v.directions(which))} in the measured direction" + (f" (not: {'; '.join(wrong)})" if wrong else ""))
        saturated = v.saturated(which)
        lines.append(f"saturated where the real system kept up, {which.replace('_', ' ')}: "
                     + (", ".join(saturated) if saturated else "none"))
    lines.append(f"validated in {v.wall_s:.0f} s")
    return "\n".join(lines)
