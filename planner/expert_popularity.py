"""What skewed expert popularity costs a disaggregated deployment, and what redundancy wins
back (MegaScale-Infer §6 "Load balance", §8 "Expert balance").

Expert e's popularity falls as (rank + rank_offset)^-skew (rank 1 the hottest; the fitted law in
planner/popularity_fit.py); a token picks its top_k by weighted sampling without replacement, so
expert e takes the share q_e / top_k of the (token, expert) pairs, q_e its inclusion probability
(`inclusion_probability`). Which experts are hot has nothing to do with their ids: the ranks are
laid over the ids by a seeded random permutation.

Every micro-batch waits for its slowest expert node, so an expert node's T_e is charged at the
hottest node's load: the mean pairs per node times the imbalance f = max_j load_j / mean_j load_j.
Without redundancy each node holds a contiguous run of experts; with R spare slots per node the
redundancy plan (planner/expert_placement.py, the same code the deployment re-places with) splits
the hot experts' pairs, and a node holds e + R experts (their weights, and the per-expert floor of
the time model). `SkewPricing.hot_factor` is what the search multiplies the uniform b_e by.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np


def popularity_weights(num_experts: int, skew: float, rank_offset: float) -> np.ndarray:
    """Each rank's popularity, hottest first: (rank + rank_offset)^-skew (skew 0: uniform)."""
    return (np.arange(1, num_experts + 1, dtype=np.float64) + rank_offset) ** -skew


def pair_shares(num_experts: int, top_k: int, skew: float, rank_offset: float) -> np.ndarray:
    """Each rank's share of the (token, expert) pairs (sums to 1)."""
    if skew == 0:
        return np.full(num_experts, 1.0 / num_experts)
    q = np.minimum(inclusion_probability(popularity_weights(num_experts, skew, rank_offset), top_k), 1.0)
    return q / q.sum()


class PopularityPricing:
    """The hottest expert node's load over the mean, per (experts per node, spare slots), from
    each MoE layer's share of its (token, expert) pairs by expert id (`layer_shares`, [layers,
    experts]). Without spare slots a node holds a contiguous run of ids; with them, the
    redundancy plan's placement of each layer's loads. Every layer waits for its own hottest
    node and a step sums its layers, so the imbalance charged is the mean of the layers'."""

    def __init__(self, layer_shares: np.ndarray, even: bool = False) -> None:
        self.layer_shares = layer_shares
        self.num_experts = layer_shares.shape[1]
        self.even = even  # every expert alike: 1.0 at once, without a placement
        self._imbalance = lru_cache(maxsize=None)(self._compute)

    def imbalance(self, experts_per_node: int, redundant: int) -> float:
        return self._imbalance(int(experts_per_node), int(redundant))

    def _compute(self, experts_per_node: int, redundant: int) -> float:
        from planner.expert_placement import place_layer  # scipy: only when skew is priced

        nodes = self.num_experts // experts_per_node
        if nodes == 1 or self.even:
            return 1.0
        if redundant == 0:
            load = self.layer_shares.reshape(len(self.layer_shares), nodes, experts_per_node).sum(axis=2)
            return float((load.max(axis=1) / load.mean(axis=1)).mean())
        return float(np.mean([place_layer(layer, nodes, redundant).imbalance for layer in self.layer_shares]))

    def hot_factor(self, experts_per_node: int, redundant: int) -> float:
        """The hottest node's tokens per held expert over the uniform b_e: f · e / (e + R), so that
        (e + R) experts of that many tokens each make the hottest node's pairs."""
        return self.imbalance(experts_per_node, redundant) * experts_per_node / (experts_per_node + redundant)


class SkewPricing(PopularityPricing):
    """The fitted popularity law's pricing: the same shares in every layer."""

    def __init__(self, num_experts: int, top_k: int, skew: float, rank_offset: float, seed: int = 0) -> None:
        if skew < 0 or not math.isfinite(skew):
            raise ValueError(f"expert skew must be a finite number >= 0 (0 = uniform), got {skew}")
        self.skew = skew
        ranked = pair_shares(num_experts, top_k, skew, rank_offset)
        # Expert id -> its share: the ranks laid over the ids at random (seeded).
        super().__init__(ranked[np.random.default_rng(seed).permutation(num_experts)][None, :], even=skew == 0)

    @property
    def shares(self) -> np.ndarray:
        """Each expert id's share, every layer's."""
        return self.layer_shares[0]


class MeasuredPricing(PopularityPricing):
    """The pricing of a measured profile (`ExpertLoadProfile`): each MoE layer's pairs as the
    experts took them (a layer that saw none counts as even)."""

    def __init__(self, counts: np.ndarray, num_moe_layers: int, source: str) -> None:
        loads = np.asarray(counts, dtype=np.float64)[-num_moe_layers:]  # the MoE layers are the last ones
        totals = loads.sum(axis=1, keepdims=True)
        self.source = source  # for what the planner prints: where the profile came from
        super().__init__(np.where(totals > 0, loads / np.maximum(totals, 1.0), 1.0 / loads.shape[1]))


def inclusion_probability(weights: np.ndarray, top_k: int, nodes: int = 512) -> np.ndarray:
    """q_e, the chance that a token's top_k contains expert e when it picks top_k experts by
    weighted sampling without replacement (each pick in proportion to `weights` among those
    left), exact up to quadrature; the q_e sum to top_k.

    That sampling is the top_k of the keys log w_j + Gumbel noise. Write u = exp(-key_e): u is
    exponential with rate w_e, and another expert j's key beats key_e with chance
    1 - exp(-w_j u), independently of the rest. So q_e is the integral over u of the chance
    that fewer than top_k of the others beat it (a Poisson-binomial, built from prefix and
    suffix counts so each expert is left out once); the integral runs over log u, where the
    integrand decays doubly exponentially at both ends and the trapezoid rule converges fast.
    """
    w = np.asarray(weights, dtype=np.float64)
    w = w / w.sum()
    e, k = len(w), top_k
    u_low = 1e-9 / w.max()  # below: every key beats nobody, P(fewer than k) = 1 to 1e-9
    log_u = np.linspace(math.log(u_low), math.log(60.0 / w.min()), nodes)
    u = np.exp(log_u)
    beats = -np.expm1(-np.outer(u, w))  # [node, j]: expert j's key beats the threshold
    # prefix[j][node, c]: chance exactly c of experts 0..j-1 beat it (c < k; more never matter).
    prefix = np.zeros((e + 1, nodes, k))
    prefix[0, :, 0] = 1.0
    suffix = np.zeros((e + 1, nodes, k))  # suffix[j]: the same for experts j..e-1
    suffix[e, :, 0] = 1.0
    for j in range(e):
        p = beats[:, j:j + 1]
        prefix[j + 1] = prefix[j] * (1 - p)
        prefix[j + 1, :, 1:] += prefix[j, :, :-1] * p
        i = e - 1 - j
        p = beats[:, i:i + 1]
        suffix[i] = suffix[i + 1] * (1 - p)
        suffix[i, :, 1:] += suffix[i + 1, :, :-1] * p
    at_most = np.cumsum(suffix[1:], axis=2)[:, :, ::-1]  # [e, node, a]: others after e number <= k-1-a
    fewer = np.einsum("enc,enc->en", prefix[:e], at_most)  # fewer than k others beat expert e
    density = w[:, None] * u * np.exp(-np.outer(w, u))  # of u_e, per unit log u
    return np.trapezoid(density * fewer, log_u, axis=1) - np.expm1(-w * u_low)
