"""A node's step time as a function of the step's work, calibrated online from the steps the
node measured (the predictive router's performance model). The planner's
`planner.step_cost_model` prices steps from the hardware roofline instead, before any ran.

    seconds = c0 + c_tok * tokens + c_seq * seqs + c_kv * kv_tokens + c_pair * score_pairs
                 + p_tok * peak_tokens + p_kv * peak_kv_tokens + p_pair * peak_score_pairs

c0 is the fixed cost of a step (weights read once, launches, the expert round trip), c_tok the
per-token GEMM cost, c_kv attention's cache reads, c_pair its score FLOPs. The peak terms are
for nodes in lockstep (a disaggregated replica's attention nodes): the expert nodes compute
every node's tokens, so that work adds up, but the attention nodes compute their halves side by
side, so the step waits on the busiest of them. A lockstep step's features are its nodes' work
summed and the largest of each node's share (`StepSample.lockstep`); for a node alone the peak
is its own work, and only the sum of the two coefficients matters (`alone`). The fit tells them
apart from steps where several nodes worked.

The fit is least squares over the last `window` samples with a ridge toward the prior worth
`prior_weight` samples, so a node with few measurements predicts near the prior and one with
many from its own steps; no coefficient goes negative (the most negative feature is dropped and
the rest refit, until none is). Steps the fit misses by far more than it misses the typical one
(a process descheduled, a page fault storm: noise, not work) are left out of a second fit.
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

import numpy as np

from megainfer.messages import StepSample

FEATURES = ("fixed", "tokens", "seqs", "kv_tokens", "score_pairs", "peak_tokens", "peak_kv_tokens",
            "peak_score_pairs")
NODE_FEATURES = 5  # the first five: a step's work summed over its nodes
OUTLIER_MISSES = 8.0  # a step the fit misses by this many typical misses is noise


class Coefficients(NamedTuple):
    """Seconds per unit of each of `FEATURES` (`fixed`: per step)."""

    fixed: float
    tokens: float
    seqs: float
    kv_tokens: float
    score_pairs: float
    peak_tokens: float
    peak_kv_tokens: float
    peak_score_pairs: float


class AloneCoefficients(NamedTuple):
    """A node stepping by itself: its work is also the peak, so each peak coefficient adds to
    the summed one it bounds."""

    fixed: float
    tokens: float
    seqs: float
    kv_tokens: float
    score_pairs: float


def features(s: StepSample) -> tuple[float, ...]:
    peak = s.peak if s.peak is not None else (s.tokens, s.kv_tokens, s.score_pairs)
    return (1.0, float(s.tokens), float(s.seqs), float(s.kv_tokens), float(s.score_pairs), *map(float, peak))


class OnlineStepModel:
    def __init__(self, prior: tuple[float, ...] = (0.02, 1e-4, 0.0, 0.0, 0.0), *, window: int = 512,
                 prior_weight: float = 0.5, refit_every: int = 16) -> None:
        if len(prior) == NODE_FEATURES:  # a node's own step model: no peak terms assumed
            prior = (*prior, 0.0, 0.0, 0.0)
        if len(prior) != len(FEATURES):
            raise ValueError(f"prior needs {NODE_FEATURES} or {len(FEATURES)} coefficients ({', '.join(FEATURES)})")
        self.prior = np.asarray(prior, dtype=np.float64)
        self.coef = self.prior.copy()
        self._set(self.coef)
        self.window = window
        self.prior_weight = prior_weight
        self.refit_every = refit_every
        self._x: deque[tuple[float, ...]] = deque(maxlen=window)
        self._y: deque[float] = deque(maxlen=window)
        self._since_fit = 0
        self.num_samples = 0

    def _set(self, coef: np.ndarray) -> None:
        self.coef = coef
        # Plain floats and small arrays: predictions run on the routing path.
        self.coefficients = cost = Coefficients(*map(float, coef))
        self._alone = AloneCoefficients(cost.fixed, cost.tokens + cost.peak_tokens, cost.seqs,
                                        cost.kv_tokens + cost.peak_kv_tokens, cost.score_pairs + cost.peak_score_pairs)
        # On (tokens, seqs, kv_tokens, score_pairs) summed over nodes, and on the largest node's
        # (tokens, kv_tokens, score_pairs).
        self.sum_coef = np.asarray((cost.tokens, cost.seqs, cost.kv_tokens, cost.score_pairs))
        self.peak_coef = np.asarray((cost.peak_tokens, cost.peak_kv_tokens, cost.peak_score_pairs))

    @property
    def alone(self) -> AloneCoefficients:
        """The coefficients of a node stepping by itself, where its work is also the peak."""
        return self._alone

    def predict(self, s: StepSample) -> float:
        cost = self.coefficients
        if s.peak is None:
            return self.seconds(s.tokens, s.seqs, s.kv_tokens, s.score_pairs)
        peak_tokens, peak_kv_tokens, peak_score_pairs = s.peak
        return (cost.fixed + cost.tokens * s.tokens + cost.seqs * s.seqs + cost.kv_tokens * s.kv_tokens
                + cost.score_pairs * s.score_pairs + cost.peak_tokens * peak_tokens
                + cost.peak_kv_tokens * peak_kv_tokens + cost.peak_score_pairs * peak_score_pairs)

    def seconds(self, tokens: float, seqs: float, kv_tokens: float, score_pairs: float) -> float:
        """A step of one node alone."""
        cost = self._alone
        return (cost.fixed + cost.tokens * tokens + cost.seqs * seqs + cost.kv_tokens * kv_tokens
                + cost.score_pairs * score_pairs)

    def price(self, summed: np.ndarray, peak: np.ndarray) -> np.ndarray:
        """Steps of lockstep nodes: rows of (tokens, seqs, kv_tokens, score_pairs) summed over the
        nodes and rows of the largest node's (tokens, kv_tokens, score_pairs)."""
        return self.coefficients.fixed + summed @ self.sum_coef + peak @ self.peak_coef

    def lockstep_seconds(self, rows) -> float:
        """One step of lockstep nodes, each node's work a row of (tokens, seqs, kv_tokens,
        score_pairs): `price` for a single step, without numpy's overhead."""
        cost = self.coefficients
        tokens = seqs = kv = pairs = peak_tokens = peak_kv = peak_pairs = 0.0
        for node_tokens, node_seqs, node_kv, node_pairs in rows:
            tokens += node_tokens
            seqs += node_seqs
            kv += node_kv
            pairs += node_pairs
            peak_tokens = max(peak_tokens, node_tokens)
            peak_kv = max(peak_kv, node_kv)
            peak_pairs = max(peak_pairs, node_pairs)
        return (cost.fixed + cost.tokens * tokens + cost.seqs * seqs + cost.kv_tokens * kv + cost.score_pairs * pairs
                + cost.peak_tokens * peak_tokens + cost.peak_kv_tokens * peak_kv + cost.peak_score_pairs * peak_pairs)

    def marginal(self, tokens: int, kv_tokens: float, score_pairs: float) -> float:
        """Seconds one more sequence adds to a step it joins, on a node alone."""
        cost = self._alone
        return cost.tokens * tokens + cost.seqs + cost.kv_tokens * kv_tokens + cost.score_pairs * score_pairs

    def observe(self, samples) -> None:
        for s in samples:
            if s.seconds > 0:
                self._x.append(features(s))
                self._y.append(s.seconds)
                self._since_fit += 1
                self.num_samples += 1
        if self._since_fit >= self.refit_every or (self._since_fit and len(self._y) < self.refit_every):
            self.fit()

    def fit(self) -> None:
        self._since_fit = 0
        if not self._y:
            return
        x = np.asarray(self._x, dtype=np.float64)
        y = np.asarray(self._y, dtype=np.float64)
        # Scale columns and seconds so the ridge weighs every feature alike whatever its units,
        # and the prior counts as `prior_weight` samples' worth.
        scale = np.maximum(np.abs(x).max(axis=0), 1e-12)
        y_scale = max(float(np.abs(y).mean()), 1e-12)
        xs = x / scale
        y = y / y_scale
        prior_s = self.prior * scale / y_scale
        coef = self._solve(xs, y, prior_s)
        if len(y) >= 4 * len(FEATURES):
            miss = np.abs(xs @ coef - y)
            keep = miss <= OUTLIER_MISSES * max(float(np.median(miss)), 1e-3)
            if not keep.all():
                coef = self._solve(xs[keep], y[keep], prior_s)
        self._set(coef / scale * y_scale)

    def _solve(self, xs: np.ndarray, y: np.ndarray, prior_s: np.ndarray) -> np.ndarray:
        """Non-negative ridge least squares in scaled units."""
        active = list(range(len(FEATURES)))
        while True:
            columns = xs[:, active]
            ridge = self.prior_weight * np.eye(len(active))
            rhs = columns.T @ y + self.prior_weight * prior_s[active]
            solution = np.linalg.solve(columns.T @ columns + ridge, rhs)
            if (solution >= 0).all() or len(active) == 1:
                break
            del active[int(np.argmin(solution))]  # one at a time: collinear features trade sign
        coef = np.zeros(len(FEATURES))
        coef[active] = np.maximum(solution, 0.0)
        return coef

    def describe(self) -> dict[str, float]:
        return dict(zip(FEATURES, map(float, self.coef)))


class StepTimeBalancer:
    """Attention balancing (MegaScale-Infer §8): admit prompt tokens into a step only while its
    predicted time stays under `target_s`, so attention nodes that meet the experts every layer
    finish their halves together instead of all waiting on the one that took a long prompt.
    The node's own calibrated model predicts; the scheduler asks once the decodes are in."""

    def __init__(self, model: OnlineStepModel, target_s: float) -> None:
        if target_s <= 0:
            raise ValueError(f"target step time must be positive, got {target_s}")
        self.model = model
        self.target_s = target_s

    def prefill_tokens(self, tokens: int, seqs: int, kv_tokens: float) -> int:
        cost = self.model.alone
        # The decodes (pairs = cached tokens read) plus one more sequence's fixed share.
        base = (cost.fixed + cost.tokens * tokens + cost.seqs * (seqs + 1) + cost.kv_tokens * kv_tokens
                + cost.score_pairs * kv_tokens)
        room = self.target_s - base
        if room <= 0:
            return 0
        # x prompt tokens from a fresh prefix cost quadratic * x^2 + linear * x: the linear
        # terms plus x(x+1)/2 score pairs.
        quadratic, linear = cost.score_pairs / 2, cost.tokens + cost.kv_tokens + cost.score_pairs / 2
        if quadratic > 0:
            x = (-linear + (linear * linear + 4 * quadratic * room) ** 0.5) / (2 * quadratic)
        else:
            x = room / linear if linear > 0 else float("inf")
        return int(min(x, 1 << 30))
