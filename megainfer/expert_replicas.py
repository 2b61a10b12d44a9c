"""Where each expert's replicas live on the expert nodes, layer by layer, and the share of its
tokens each replica takes: the serving side of MegaScale-Infer's redundancy plan (§6, "Load
balance"; the plan itself is computed by `planner/expert_placement.py`).

A *slot* is one replica of one expert on one node. Every node has room for `slots_per_node`
(S) of them, the same in every layer and across re-placements, and slot ids are fixed by
that room: node j's i-th expert is slot j·S + i. So the attention side's slot-to-node map and
the expert side's weights keep their shapes (and CUDA graphs their buffers) when experts move. Attention ranks send
each (token, choice) pair to a slot of its expert, picked by the token's row (a `slot_table`
row of kernels.REPLICA_BUCKETS entries, filled so that every run of rows follows the shares); expert
nodes find their slots in the records by slot id. Without replicas and with each node holding
a contiguous run of experts, slot ids are the expert ids and no table is needed.

Sent from the deployment to every attention and expert node (a re-placement) and so declared
here, in the core, once.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from megainfer.errors import ConfigError

SHARE_TOLERANCE = 1e-6


@dataclass(frozen=True)
class LayerReplicas:
    """One layer: node j holds one slot per expert in `node_experts[j]`, and each slot takes
    `node_shares[j][i]` of that expert's tokens."""

    node_experts: tuple[tuple[int, ...], ...]
    node_shares: tuple[tuple[float, ...], ...]
    slots_per_node: int  # S: each node's room, used or not

    @property
    def num_nodes(self) -> int:
        return len(self.node_experts)

    @property
    def num_slots(self) -> int:
        """Slot ids run over [0, N·S)."""
        return self.num_nodes * self.slots_per_node

    def slot_node(self) -> list[int]:
        """The node of every slot id, used or not."""
        return [j for j in range(self.num_nodes) for _ in range(self.slots_per_node)]

    def node_slots(self, node: int) -> list[int]:
        """Node `node`'s slot ids, in the order of its experts."""
        first = node * self.slots_per_node
        return list(range(first, first + len(self.node_experts[node])))

    def is_identity(self, num_experts: int) -> bool:
        """Is slot i expert i (each expert once, every node full, in order)? Then no table is needed."""
        return self.num_slots == num_experts and [e for experts in self.node_experts for e in experts] == list(
            range(num_experts))

    def expert_replicas(self, num_experts: int) -> list[list[tuple[int, float]]]:
        """For every expert, its (slot, share) pairs."""
        out: list[list[tuple[int, float]]] = [[] for _ in range(num_experts)]
        for j, (experts, shares) in enumerate(zip(self.node_experts, self.node_shares)):
            for i, (e, share) in enumerate(zip(experts, shares)):
                out[e].append((j * self.slots_per_node + i, share))
        return out

    def slot_table(self, num_experts: int, buckets: int) -> np.ndarray:
        """[E, buckets] int32: the slot of expert e's pairs in rows whose index is b modulo
        `buckets`. Filled by smooth weighted round-robin, so every run of rows splits the
        expert's pairs close to the shares (not the first rows to one replica, the rest to
        another), and a decode micro-batch of a few rows is spread too. `buckets`: the gating
        kernel's table width (kernels.REPLICA_BUCKETS)."""
        table = np.empty((num_experts, buckets), dtype=np.int32)
        for e, replicas in enumerate(self.expert_replicas(num_experts)):
            slots = [s for s, _ in replicas]
            if len(slots) == 1:  # most experts: one replica takes every row
                table[e] = slots[0]
                continue
            weights = np.array([w for _, w in replicas], dtype=np.float64)
            credit = np.zeros(len(slots))
            for b in range(buckets):
                credit += weights
                pick = int(np.argmax(credit))
                credit[pick] -= 1.0
                table[e, b] = slots[pick]
        return table

    def share_matrix(self, num_experts: int) -> np.ndarray:
        """[E, nodes]: the share of each expert's tokens each node takes (a node holds an expert once)."""
        matrix = np.zeros((num_experts, self.num_nodes))
        for j, (experts, shares) in enumerate(zip(self.node_experts, self.node_shares)):
            matrix[list(experts), j] = shares
        return matrix

    def node_load(self, expert_tokens: np.ndarray) -> np.ndarray:
        """[nodes] tokens each node would take of `expert_tokens` ([E]) under this placement."""
        return np.asarray(expert_tokens, dtype=np.float64) @ self.share_matrix(len(expert_tokens))

    def check(self, num_experts: int) -> None:
        if len(self.node_shares) != len(self.node_experts) or any(
                len(s) != len(e) for s, e in zip(self.node_shares, self.node_experts)):
            raise ConfigError("expert replicas: one share per slot, one list per node")
        for j, experts in enumerate(self.node_experts):
            if len(experts) > self.slots_per_node:
                raise ConfigError(f"expert replicas: node {j} holds {len(experts)} experts, more than its "
                                  f"{self.slots_per_node} slots")
            if not experts:
                raise ConfigError(f"expert replicas: node {j} holds no expert; every node needs one")
            if len(set(experts)) != len(experts):
                raise ConfigError(f"expert replicas: node {j} holds an expert twice ({list(experts)})")
        for e, replicas in enumerate(self.expert_replicas(num_experts)):
            if not replicas:
                raise ConfigError(f"expert replicas: expert {e} is on no node")
            total = sum(w for _, w in replicas)
            if any(w < 0 for _, w in replicas) or abs(total - 1.0) > SHARE_TOLERANCE:
                raise ConfigError(f"expert replicas: expert {e}'s shares {[w for _, w in replicas]} "
                                  f"must be non-negative and sum to 1")
        if any(not 0 <= e < num_experts for experts in self.node_experts for e in experts):
            raise ConfigError(f"expert replicas: expert ids must lie in [0, {num_experts})")


def from_assignment(assignment: list[list[int]], slots_per_node: int | None = None) -> LayerReplicas:
    """One slot per listed expert, each the whole of its expert (no replicas); room for
    `slots_per_node` (default: the longest list)."""
    room = max(len(ids) for ids in assignment) if slots_per_node is None else slots_per_node
    return LayerReplicas(tuple(tuple(ids) for ids in assignment), tuple((1.0,) * len(ids) for ids in assignment),
                         room)


@dataclass(frozen=True)
class ExpertReplicas:
    """Every layer's slots; `version` counts re-placements (0: the deployment's first)."""

    version: int
    layers: tuple[LayerReplicas, ...]

    @classmethod
    def uniform(cls, layer: LayerReplicas, num_layers: int, version: int = 0) -> "ExpertReplicas":
        return cls(version, (layer,) * num_layers)

    @classmethod
    def of_assignment(cls, assignment: list[list[int]], num_layers: int) -> "ExpertReplicas":
        """Every layer as `assignment` lists each node's experts, one slot each, no spare room."""
        return cls.uniform(from_assignment(assignment), num_layers)

    @property
    def num_nodes(self) -> int:
        return self.layers[0].num_nodes

    def check(self, num_experts: int, num_layers: int, num_nodes: int) -> None:
        if len(self.layers) != num_layers:
            raise ConfigError(f"expert replicas: {len(self.layers)} layers given, the model has {num_layers}")
        for i, layer in enumerate(self.layers):
            if layer.num_nodes != num_nodes:
                raise ConfigError(f"expert replicas: layer {i} places experts on {layer.num_nodes} nodes, "
                                  f"the deployment has {num_nodes}")
            if layer.slots_per_node != self.slots_per_node:
                raise ConfigError(f"expert replicas: layer {i} gives nodes {layer.slots_per_node} slots, "
                                  f"layer 0 {self.slots_per_node}; every layer has the same room")
            layer.check(num_experts)

    def held(self) -> list[list[list[int]]]:
        """Per layer, per node, its experts in row order."""
        return [[list(experts) for experts in layer.node_experts] for layer in self.layers]

    def replaced(self, layouts: list[tuple[tuple[tuple[int, ...], ...], tuple[tuple[float, ...], ...]]]
                 ) -> "ExpertReplicas":
        """The next version: each layer's (node experts, node shares), in this placement's room."""
        return ExpertReplicas(self.version + 1, tuple(LayerReplicas(experts, shares, self.slots_per_node)
                                                      for experts, shares in layouts))

    def share_matrices(self, num_experts: int) -> np.ndarray:
        """[layers, E, nodes]: every layer's `share_matrix`."""
        return np.stack([layer.share_matrix(num_experts) for layer in self.layers])

    @property
    def slots_per_node(self) -> int:
        return self.layers[0].slots_per_node

    def needs_table(self, num_experts: int) -> bool:
        """Does any layer differ from slot i = expert i (so attention ranks need slot tables)?"""
        return not all(layer.is_identity(num_experts) for layer in self.layers)


def placed_load(replicas: ExpertReplicas | None, loads: np.ndarray) -> tuple[np.ndarray, list[float]]:
    """`loads` [layers, experts] ((token, expert) pairs) as the units that compute them carry
    them: ([units] pairs over every layer, per layer the busiest unit over the mean, 1.0 where
    a layer saw none). The units are the expert nodes of `replicas`, or the experts themselves
    where there is no placement (the colocated engine)."""
    loads = np.asarray(loads, dtype=np.float64)
    rows = loads if replicas is None else np.einsum("le,len->ln", loads, replicas.share_matrices(loads.shape[1]))
    return rows.sum(axis=0), [imbalance(r) for r in rows]


def imbalance(units: np.ndarray) -> float:
    """The busiest unit over the mean (1.0: even, or no load)."""
    return float(units.max() / units.mean()) if units.sum() else 1.0
