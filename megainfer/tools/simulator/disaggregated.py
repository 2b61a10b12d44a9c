"""`megainfer simulate --plan PLAN.yaml`: a disaggregated plan's decode steps simulated layer by
layer and micro-batch by micro-batch, with the expert loads drawn rather than averaged, and the
experts placed and re-placed by the deployment's own code.

Each step, every (layer, micro-batch) routes its B/m tokens' top-k pairs to experts: counts
drawn from a multinomial over the experts' pair shares (planner/expert_popularity.py: the
popularity law, ranks laid over expert ids as the planner lays them). The pairs land on expert
nodes by the placement serving then (megainfer/expert_replicas.py: each replica's share), and
that (layer, micro-batch) costs the planner's T_e at its *hottest* node's tokens. The steps' routed
counts fill a window of the plan's `experts.rebalance.window_steps`; once full, the experts are
re-placed from it with `planner.expert_placement.re_place` (the redundancy plan per layer, rows
kept), as the deployment does, where the plan has spare slots.

A step's time follows the planner's pipeline (`PerfModel.iteration_time`) with each (layer,
micro-batch) at its own T_e: the first round trip, then per later layer the longer of the m
micro-batches' compute and a round trip, then the last layer's remaining micro-batches, plus the
step's own cost. With every T_e equal this is the planner's formula, so the simulated TBT and the
planner's prediction differ only by the draws' spread around the mean load.

Only MoE layers exchange with the expert nodes: DeepSeek's dense first layers run whole on
the attention node, priced (as the planner prices them) in the part of the step outside the
rounds, so the draws and the placement cover the `num_moe_layers` MoE layers.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from megainfer.config import ModelConfig
from megainfer.expert_replicas import ExpertReplicas, imbalance, placed_load
from megainfer.plan import Plan
from planner.catalog import Catalog
from planner.expert_placement import re_place
from planner.expert_popularity import SkewPricing
from planner.perf_model import PerfModel
from planner.search import evaluate_plan

DEFAULT_WINDOW_STEPS = 64


@dataclass
class PlanSimulation:
    """What a simulated run of a plan's decode steps measured."""

    steps: int
    tbt_s: np.ndarray  # every step's time
    replaced_at: int | None  # the step after which the experts were re-placed (None: never)
    imbalance_before: float  # hottest expert node over the mean, pairs of the steps before the re-placement
    imbalance_after: float  # the same after it (equal to before without one)
    predicted_tbt_s: float  # the planner's TBT for the plan (evaluate_plan, same skew and spare slots)

    @property
    def settled_tbt_s(self) -> float:
        """Mean TBT over the steps after the re-placement (all of them without one)."""
        start = 0 if self.replaced_at is None else self.replaced_at
        return float(self.tbt_s[start:].mean())

    @property
    def tbt_over_prediction(self) -> float:
        return self.settled_tbt_s / self.predicted_tbt_s


class PlanSimulator:
    def __init__(self, plan: Plan, model: ModelConfig, perf: PerfModel, catalog: Catalog, seed: int = 0) -> None:
        if plan.attention.gpu == "cpu":
            raise ValueError("simulate --plan prices GPU plans with the planner's model; this plan runs on CPUs")
        self.plan, self.model, self.perf = plan, model, perf
        self.rng = np.random.default_rng(seed)
        e = plan.experts.experts_per_node or model.num_experts // plan.experts.nodes
        self.experts_per_node, self.redundant = e, plan.experts.redundant_per_node
        skew = perf.skew or SkewPricing(model.num_experts, model.top_k, 0.0, 0.0)
        # Per expert id, as the planner lays the ranks over the ids: one row (the fitted law, every
        # layer alike), or one per MoE layer as a measured profile has them.
        layers = skew.layer_shares
        self.shares = layers[0] if len(layers) == 1 else layers[:, None, :]
        self.first_replicas = _moe_layers(plan.expert_replicas(model), model)
        self.replicas = self.first_replicas
        self.node_shares = self.replicas.share_matrices(model.num_experts)  # [L, E, nodes], as placed now
        spec = plan.experts.rebalance
        self.window_steps = spec.window_steps if spec is not None else DEFAULT_WINDOW_STEPS
        self.floor = spec.floor_tokens if spec is not None else 0.0
        self.candidate = evaluate_plan(
            model, perf, catalog, attention_gpu=plan.attention.gpu, tp_a=plan.attention.tp, n_a=plan.attention.nodes,
            expert_gpu=plan.experts.gpu, tp_e=plan.experts.tp, experts_per_node=e, m=plan.pipeline.micro_batches,
            batch=plan.pipeline.global_batch, redundant_per_node=self.redundant)
        held = np.array([e + self.redundant], dtype=np.float64)
        self.expert_side = perf.sides([(catalog[plan.experts.gpu], plan.experts.tp)], "experts", held)
        self.held = held

    def run(self, steps: int) -> PlanSimulation:
        m, layers = self.plan.pipeline.micro_batches, self.model.num_moe_layers
        pairs_per_round = int(round(self.plan.pipeline.global_batch / m)) * self.model.top_k
        window: deque[np.ndarray] = deque(maxlen=self.window_steps)
        tbt, loads_before, loads_after, replaced_at = [], [], [], None
        for step in range(steps):
            counts = self.rng.multinomial(pairs_per_round, self.shares, size=(layers, m))  # [L, m, E]
            tbt.append(self._step_time(counts))
            per_layer = counts.sum(axis=1)
            (loads_after if replaced_at is not None else loads_before).append(per_layer)
            window.append(per_layer)
            if replaced_at is None and self.redundant and len(window) == self.window_steps:
                self.replicas = self.replicas.replaced(re_place(np.sum(window, axis=0), self.replicas.held(),
                                                                self.redundant, self.floor))
                self.node_shares = self.replicas.share_matrices(self.model.num_experts)
                replaced_at = step + 1
        before = imbalance(placed_load(self.first_replicas, np.sum(loads_before, axis=0))[0])
        after = imbalance(placed_load(self.replicas, np.sum(loads_after, axis=0))[0]) if loads_after else before
        return PlanSimulation(steps, np.array(tbt), replaced_at, before, after, self.candidate.tbt)

    def _step_time(self, counts: np.ndarray) -> float:
        """One step: each (MoE layer, micro-batch) at its hottest expert node's T_e."""
        c, perf = self.candidate, self.perf
        hottest = np.einsum("lme,len->lmn", counts, self.node_shares).max(axis=2)  # [L, m] pairs
        t_e = perf.expert_time(self.expert_side, hottest / self.held[0], self.held)  # tokens per held expert
        t_f = np.maximum(c.t_a, t_e)
        trip = c.t_a + t_e + 2 * c.t_c
        periods = np.maximum(t_f.sum(axis=1), trip.max(axis=1))
        # The step's own cost and its dense layers' (no rounds), as predicted.
        step_s = c.tbt - float(perf.iteration_time(c.t_a, c.t_e, c.t_c, c.m))
        return float(trip[0, 0] + periods[1:].sum() + t_f[-1, 1:].sum() + step_s)


def _moe_layers(replicas: ExpertReplicas, model: ModelConfig) -> ExpertReplicas:
    """The placement's MoE layers (the last `num_moe_layers`): those the rounds reach."""
    return ExpertReplicas(replicas.version, replicas.layers[len(replicas.layers) - model.num_moe_layers:])
