"""MegaScale-Infer's redundancy plan (§6, "Load balance"): where each expert's replicas live and
what share of its tokens each takes, so that the slowest expert node is as fast as it can be.

One layer at a time, M experts on N expert nodes of `s` slots each, s = ceil(M / N) + R (R: the
redundant slots per node). Expert i costs c_i = max(a_i, K): a_i is the cost of its active
tokens over the traffic window (in token units: its token count), K the floor cost of an expert
that is held at all (its weights are read whatever its tokens). With x_ij the share of expert
i's tokens that node j serves (x_ij > 0 only where j holds a replica of i; Σ_j x_ij = 1; a node
holds at most s replicas and at most one of each expert), node j costs C_j = Σ_i x_ij · c_i, and
the plan minimises max_j C_j.

The greedy, as the paper approximates it:

1. **How many replicas.** Every expert gets one; each spare slot (N·s − M of them) goes to the
   expert whose replicas carry the most, c_i / r_i (an expert has at most N replicas).
2. **Where.** Replicas in decreasing c_i / r_i, each on the least-loaded node that has a free
   slot and no replica of that expert yet (longest-processing-time first).
3. **How much.** For that placement, the shares that minimise the slowest node: a linear
   program (min t: Σ_i c_i x_ij ≤ t for every node, Σ_j x_ij = 1 for every expert), which is at
   least as good as equal shares.

Against brute force (every placement, the same linear program for its shares) on small
instances, the greedy is within `GREEDY_BOUND` (4/3, the longest-processing-time bound) of the
optimum: `tests/planner/test_expert_placement.py` holds it on every instance it enumerates.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy.optimize import linprog

from megainfer.errors import ConfigError

GREEDY_BOUND = 4 / 3


@dataclass(frozen=True)
class LayerPlacement:
    """One layer's plan: for every expert the nodes that hold a replica and the share of its
    tokens each takes (in the same order), and what each node then carries."""

    replicas: tuple[tuple[int, ...], ...]
    shares: tuple[tuple[float, ...], ...]
    node_cost: tuple[float, ...]

    @property
    def imbalance(self) -> float:
        """The slowest node over the mean node (1.0: perfectly balanced)."""
        mean = sum(self.node_cost) / len(self.node_cost)
        return max(self.node_cost) / mean if mean > 0 else 1.0

    def experts_on(self, node: int) -> list[int]:
        return [i for i, nodes in enumerate(self.replicas) if node in nodes]


def slots_per_node(num_experts: int, num_nodes: int, redundant_per_node: int) -> int:
    return math.ceil(num_experts / num_nodes) + redundant_per_node


def expert_costs(loads: np.ndarray, floor_cost: float) -> np.ndarray:
    """c_i = max(a_i, K)."""
    return np.maximum(np.asarray(loads, dtype=np.float64), float(floor_cost))


def replica_counts(costs: np.ndarray, num_nodes: int, slots: int) -> list[int]:
    """Step 1: every spare slot to the expert whose replicas carry the most."""
    counts = [1] * len(costs)
    for _ in range(num_nodes * slots - len(costs)):
        candidates = [i for i in range(len(costs)) if counts[i] < num_nodes]
        if not candidates:
            break
        hottest = max(candidates, key=lambda i: (costs[i] / counts[i], -i))
        counts[hottest] += 1
    return counts


def assign_replicas(costs: np.ndarray, counts: list[int], num_nodes: int, slots: int) -> list[list[int]]:
    """Step 2: each expert's nodes, replicas placed heaviest first on the least-loaded node that
    can take them."""
    order = sorted(((costs[i] / counts[i], i) for i in range(len(costs)) for _ in range(counts[i])),
                   key=lambda item: (-item[0], item[1]))
    load, used = [0.0] * num_nodes, [0] * num_nodes
    nodes: list[list[int]] = [[] for _ in costs]
    for share, i in order:
        free = [j for j in range(num_nodes) if used[j] < slots and j not in nodes[i]]
        if not free:  # every node with room holds it already: fold this replica into the others
            continue
        j = min(free, key=lambda n: (load[n], n))
        nodes[i].append(j)
        load[j] += share
        used[j] += 1
    return [sorted(n) for n in nodes]


def optimal_shares(costs: np.ndarray, replicas: list[list[int]], num_nodes: int
                   ) -> tuple[list[list[float]], list[float]]:
    """Step 3: the shares that minimise the slowest node for this placement (a linear program),
    and the nodes' costs under them."""
    pairs = [(i, j) for i, nodes in enumerate(replicas) for j in nodes]
    n_vars = len(pairs) + 1  # every (expert, node) share, then t
    objective = np.zeros(n_vars)
    objective[-1] = 1.0
    a_ub = np.zeros((num_nodes, n_vars))
    for k, (i, j) in enumerate(pairs):
        a_ub[j, k] = costs[i]
    a_ub[:, -1] = -1.0
    a_eq = np.zeros((len(replicas), n_vars))
    for k, (i, _) in enumerate(pairs):
        a_eq[i, k] = 1.0
    result = linprog(objective, A_ub=a_ub, b_ub=np.zeros(num_nodes), A_eq=a_eq, b_eq=np.ones(len(replicas)),
                     bounds=[(0.0, 1.0)] * len(pairs) + [(0.0, None)], method="highs")
    if not result.success:
        raise ValueError(f"the shares' linear program failed: {result.message}")
    x = result.x
    shares = [[0.0] * len(nodes) for nodes in replicas]
    node_cost = [0.0] * num_nodes
    for k, (i, j) in enumerate(pairs):
        shares[i][replicas[i].index(j)] = float(x[k])
        node_cost[j] += float(x[k]) * costs[i]
    return shares, node_cost


def place_layer(loads, num_nodes: int, redundant_per_node: int = 0, floor_cost: float = 0.0) -> LayerPlacement:
    """One layer's redundancy plan from its experts' loads over a window (token counts)."""
    costs = expert_costs(loads, floor_cost)
    if num_nodes < 1 or redundant_per_node < 0 or len(costs) < num_nodes:
        raise ConfigError(f"a redundancy plan needs at least one expert per node and R >= 0: {len(costs)} experts, "
                          f"{num_nodes} nodes, {redundant_per_node} redundant slots per node")
    slots = slots_per_node(len(costs), num_nodes, redundant_per_node)
    replicas = assign_replicas(costs, replica_counts(costs, num_nodes, slots), num_nodes, slots)
    shares, node_cost = optimal_shares(costs, replicas, num_nodes)
    return LayerPlacement(tuple(map(tuple, replicas)), tuple(map(tuple, shares)), tuple(node_cost))


def place(loads, num_nodes: int, redundant_per_node: int = 0, floor_cost: float = 0.0) -> list[LayerPlacement]:
    """Every layer's plan from `loads` [layers, experts] (tokens per expert over the window)."""
    return [place_layer(row, num_nodes, redundant_per_node, floor_cost) for row in np.asarray(loads)]


def contiguous_placement(loads, num_nodes: int, floor_cost: float = 0.0) -> LayerPlacement:
    """Today's placement (no redundancy: experts_per_node contiguous experts on each node),
    costed the same way, to compare a plan against."""
    costs = expert_costs(loads, floor_cost)
    per_node = math.ceil(len(costs) / num_nodes)
    replicas = [(i // per_node,) for i in range(len(costs))]
    node_cost = [0.0] * num_nodes
    for i, (j,) in enumerate(replicas):
        node_cost[j] += float(costs[i])
    return LayerPlacement(tuple(replicas), tuple((1.0,) for _ in replicas), tuple(node_cost))


NodeLayout = tuple[tuple[tuple[int, ...], ...], tuple[tuple[float, ...], ...]]  # per node: experts, their shares


def aligned(new: list[int], held: list[int]) -> list[int]:
    """`new`'s experts ordered so that those already in `held` keep their rows (position i is
    slot i on an expert node): only the rest must be loaded. A row freed in the middle takes the
    last expert (rows stay 0..n-1)."""
    wanted, had = set(new), set(held)
    rows: list[int | None] = [e if e in wanted else None for e in held]
    incoming = [e for e in new if e not in had]
    for i, e in enumerate(rows):
        if e is None and incoming:
            rows[i] = incoming.pop(0)
    rows += incoming
    while rows and rows[-1] is None:
        rows.pop()
    while None in rows:
        rows[rows.index(None)] = rows.pop()
        while rows and rows[-1] is None:
            rows.pop()
    return [e for e in rows if e is not None]


def node_layout(plan: LayerPlacement, held: list[list[int]]) -> NodeLayout:
    """The plan as each node's experts (rows aligned with what it holds now) and their shares."""
    experts = [aligned(plan.experts_on(j), list(held[j])) for j in range(len(held))]
    share = {(e, j): s for e, (nodes, shares) in enumerate(zip(plan.replicas, plan.shares))
             for j, s in zip(nodes, shares)}
    return tuple(map(tuple, experts)), tuple(tuple(share[e, j] for e in experts[j]) for j in range(len(held)))


def re_place(loads, held: list[list[list[int]]], redundant_per_node: int, floor_cost: float = 0.0) -> list[NodeLayout]:
    """Every layer's redundancy plan from its window `loads` [layers, experts], laid out on the
    nodes as they hold experts now (`held`: per layer, per node, the experts in row order). What
    the deployment re-places with (deploy/expert_rebalance.py) and `megainfer simulate --plan` too."""
    return [node_layout(place_layer(row, len(nodes), redundant_per_node, floor_cost), nodes)
            for row, nodes in zip(np.asarray(loads), held)]
