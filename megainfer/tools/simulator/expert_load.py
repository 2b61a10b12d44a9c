"""How many distinct experts a layer's tokens activate in one step.

Each token routes to `top_k` distinct experts out of `num_experts`; a layer reads the weights
of every expert at least one of its tokens chose. The simulator draws that count for each
layer of each step from its exact distribution for the step's token count, so expert-weight
bytes follow from the batches the scheduler forms, at no per-token cost:

- uniform routing: the count of distinct experts after t tokens is a Markov chain (a token
  adds a hypergeometric number of new experts), so the distribution for t tokens is the
  start state times the transition matrix to the t-th power;
- skewed routing (MegaScale-Infer §8 observes a few hot experts per layer): expert e's
  popularity falls as (rank + rank_offset)^-skew (rank 1 the hottest; rank_offset 0 is a
  plain Zipf law, a larger offset flattens the head), a token picks its top_k by weighted
  sampling without replacement, and the count for t tokens is the Poisson-binomial of each
  expert's chance to be picked at least once, 1 - (1 - q_e)^t, with q_e from
  `inclusion_probability`. `routing_skew` fits skew and rank_offset to measured coverage.

Distributions are cached per token count until every expert is active with certainty (to
1e-12); beyond that the count is num_experts.
"""

from __future__ import annotations

import math

import numpy as np

from megainfer.errors import ConfigError
from planner.expert_popularity import inclusion_probability, popularity_weights

_SATURATED = 1.0 - 1e-12
_POOL = 4096  # draws per token count generated at once


class ExpertActivation:
    def __init__(self, num_experts: int, top_k: int, *, skew: float = 0.0, rank_offset: float = 0.0,
                 seed: int = 0) -> None:
        if not 1 <= top_k <= num_experts:
            raise ConfigError(f"top_k {top_k} must lie in 1..num_experts ({num_experts})")
        if skew < 0 or not math.isfinite(skew):
            raise ConfigError(f"--expert-skew must be a finite number >= 0 (0 = uniform), got {skew}")
        if rank_offset < 0 or not math.isfinite(rank_offset):
            raise ConfigError(f"expert rank offset must be a finite number >= 0 (popularity ~ (rank + offset)^-skew), "
                              f"got {rank_offset}")
        self.num_experts, self.top_k, self.skew, self.rank_offset = num_experts, top_k, skew, rank_offset
        self.rng = np.random.default_rng(seed)
        self._cdfs: dict[int, np.ndarray] = {}  # tokens -> CDF of the count
        self._pools: dict[int, tuple[np.ndarray, int]] = {}  # tokens -> (drawn counts, next unused)
        self._saturated_at: int | None = None
        e, k = num_experts, top_k
        if skew == 0:
            # transition[c, c + j]: a token brings j new experts when c are already active.
            self._transition = np.zeros((e + 1, e + 1))
            total = math.comb(e, k)
            for c in range(e + 1):
                for j in range(max(0, k - c), min(k, e - c) + 1):
                    self._transition[c, c + j] = math.comb(e - c, j) * math.comb(c, k - j) / total
            self._dist = np.zeros(e + 1)
            self._dist[0] = 1.0
            self._chain_tokens = 0
        else:
            self.pick_probability = np.minimum(inclusion_probability(popularity_weights(e, skew, rank_offset), k), 1.0)
            self._roots = np.exp(2j * np.pi * np.arange(e + 1) / (e + 1))
        self._cdfs[0] = np.ones(e + 1)  # zero tokens: count 0

    def _cdf(self, tokens: int) -> np.ndarray | None:
        """CDF of the count for `tokens` tokens, or None once every expert is surely active."""
        if self._saturated_at is not None and tokens >= self._saturated_at:
            return None
        cdf = self._cdfs.get(tokens)
        if cdf is not None:
            return cdf
        if self.skew == 0:
            while self._chain_tokens < tokens:  # the chain's state advances one token at a time
                self._dist = self._dist @ self._transition
                self._chain_tokens += 1
                if self._dist[-1] >= _SATURATED:
                    self._saturated_at = self._chain_tokens
                    return None
                self._cdfs[self._chain_tokens] = np.cumsum(self._dist)
            return self._cdfs[tokens]
        p = -np.expm1(tokens * np.log1p(-self.pick_probability))  # expert e picked at least once
        # The Poisson-binomial from its generating function at the num_experts + 1 roots of
        # unity (an inverse DFT): exact to rounding, one vectorised product per token count.
        generating = np.prod(1.0 - p + p * self._roots[:, None], axis=1)
        dist = np.maximum(np.fft.fft(generating).real / (self.num_experts + 1), 0.0)
        if dist[-1] >= _SATURATED:
            self._saturated_at = tokens if self._saturated_at is None else min(self._saturated_at, tokens)
            return None
        self._cdfs[tokens] = cdf = np.cumsum(dist)
        return cdf

    def draw(self, tokens: int, layers: int) -> np.ndarray | int:
        """Distinct experts activated in each of `layers` layers that `tokens` tokens pass: an
        array, or one int when every layer's count is certain (no tokens, or all experts)."""
        if tokens <= 0:
            return 0
        cdf = self._cdf(tokens)
        if cdf is None:
            return self.num_experts
        # Draws come from a pool per token count, refilled in bulk: the same independent
        # samples, without paying numpy's per-call overhead every layer class of every step.
        pool, pos = self._pools.get(tokens, (None, 0))
        if pool is None or pos + layers > len(pool):
            size = max(_POOL, layers)
            pool = np.minimum(np.searchsorted(cdf, self.rng.random(size), side="right"), self.num_experts)
            pos = 0
        self._pools[tokens] = (pool, pos + layers)
        return pool[pos:pos + layers]

    def expected(self, tokens: int) -> float:
        """Mean distinct experts for `tokens` tokens (tests, docs)."""
        cdf = self._cdf(tokens)
        if cdf is None:
            return float(self.num_experts)
        dist = np.diff(np.concatenate([[0.0], cdf]))
        return float(dist @ np.arange(self.num_experts + 1))
