"""The simulator's default expert popularity, fitted to measured expert coverage.

The layered-prefill paper ("From Tokens to Layers", arXiv 2510.08055) measured, for
Qwen3-30B-A3B (128 experts, top-8) serving ShareGPT, the share of a layer's experts that a
decode batch of b tokens touches (`MEASURED_COVERAGE`; at b >= 512 it reports only ">= 98%").
Uniform routing touches far more at small batches (b = 8: 40% against 29% measured).

`ExpertActivation` models skewed routing as popularity ~ (rank + rank_offset)^-skew with
each token's top-8 drawn by weighted sampling without replacement. The fit is least squares
on coverage = expected distinct experts / num_experts against b (`ExpertActivation.expected`),
the b = 512 point a one-sided bound (a residual only below 98%), with scipy's
`least_squares`. Both parameters are needed: a plain Zipf law (rank_offset 0) fits at best
skew 1.25 with errors up to 6 percentage points (too few experts at b = 4..16, too many at
b = 64..128), and one-parameter log-normal or exponential popularity miss by 3 to 4 points;
with the offset every point lies within 2.2 points (`python -m megainfer.tools.simulator.routing_skew`
prints the table).
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.popularity_fit import FITTED_RANK_OFFSET, FITTED_SKEW

# numpy and the simulator load inside the functions: the CLI reads the constants at parse time.

NUM_EXPERTS, TOP_K = 128, 8  # Qwen3-30B-A3B's routing

# Decode batch size (tokens) -> share of a layer's experts touched, ShareGPT, Qwen3-30B-A3B
# (the layered-prefill paper, arXiv 2510.08055). The 512 point is a lower bound.
MEASURED_COVERAGE = {1: 0.0625, 2: 0.117, 4: 0.213, 8: 0.290, 16: 0.445, 32: 0.547, 64: 0.694,
                     128: 0.863, 256: 0.934, 512: 0.98}
LOWER_BOUND_TOKENS = frozenset({512})

# The fit (`fit_popularity()`, rounded) is kept by the planner, which prices it too:
# popularity ~ (rank + FITTED_RANK_OFFSET)^-FITTED_SKEW (planner/popularity_fit.py).
FIT_TOLERANCE = 0.025  # the largest |fitted - measured| coverage over the points is below this


@dataclass(frozen=True)
class PopularityFit:
    skew: float
    rank_offset: float
    coverage: dict[int, float]  # tokens -> fitted share of experts touched

    def residuals(self) -> dict[int, float]:
        """fitted - measured per point; 0 where a lower bound is met."""
        out = {}
        for tokens, measured in MEASURED_COVERAGE.items():
            diff = self.coverage[tokens] - measured
            out[tokens] = min(diff, 0.0) if tokens in LOWER_BOUND_TOKENS else diff
        return out


def coverage(skew: float, rank_offset: float, num_experts: int = NUM_EXPERTS, top_k: int = TOP_K) -> dict[int, float]:
    """Expected share of experts touched at each measured batch size."""
    from megainfer.tools.simulator.expert_load import ExpertActivation

    act = ExpertActivation(num_experts, top_k, skew=skew, rank_offset=rank_offset)
    return {tokens: act.expected(tokens) / num_experts for tokens in MEASURED_COVERAGE}


def fit_popularity(start: tuple[float, float] = (3.0, 32.0)) -> PopularityFit:
    """Least-squares skew and rank_offset for `MEASURED_COVERAGE` (takes about a second)."""
    import numpy as np
    from scipy.optimize import least_squares  # only the fit needs scipy

    def residuals(x: np.ndarray) -> np.ndarray:
        return np.array(list(PopularityFit(x[0], x[1], coverage(x[0], x[1])).residuals().values()))

    result = least_squares(residuals, np.array(start), bounds=([0.0, 0.0], [20.0, 1000.0]), x_scale=[1.0, 10.0])
    skew, offset = (float(v) for v in result.x)
    return PopularityFit(skew, offset, coverage(skew, offset))


def fitted() -> PopularityFit:
    """The committed constants' curve."""
    return PopularityFit(FITTED_SKEW, FITTED_RANK_OFFSET, coverage(FITTED_SKEW, FITTED_RANK_OFFSET))


def format_fit(fit: PopularityFit) -> str:
    """Measured against fitted coverage, one row per batch size."""
    lines = [f"popularity ~ (rank + {fit.rank_offset:.1f})^-{fit.skew:.2f}; {NUM_EXPERTS} experts, top-{TOP_K}",
             "  tokens    measured    fitted  diff (pp)"]
    for tokens, measured in MEASURED_COVERAGE.items():
        bound = ">=" if tokens in LOWER_BOUND_TOKENS else "  "
        lines.append(f"  {tokens:6d}  {bound}{measured * 100:6.2f}%  {fit.coverage[tokens] * 100:6.2f}%  "
                     f"{(fit.coverage[tokens] - measured) * 100:+5.1f}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(format_fit(fit_popularity()))
