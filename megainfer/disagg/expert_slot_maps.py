"""An attention rank's routing of (token, expert) pairs to expert-node slots, layer by layer
(megainfer/expert_replicas.py), and the re-placement it switches to at an agreed step.

Every rank of the deployment switches at the same step S (deploy/expert_rebalance.py picks it
ahead of every attention node and tells every rank): from S on, the records name the new
placement's slots, and the expert nodes serve S's rounds with its weights. A switch that
reaches a rank after S has begun is refused there, loudly, rather than routed by the old maps
into the new weights; the deployment then keeps the old placement (`cancel`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import REPLICA_BUCKETS
from megainfer.disagg.agreed_step import AgreedStep
from megainfer.errors import DataPlaneError
from megainfer.expert_replicas import ExpertReplicas, LayerReplicas
from megainfer.model.attention_layer import AttentionLayer


@dataclass
class LayerMaps:
    """One layer's slot -> node map and, with tables, expert -> slot by row bucket."""

    slot_node: torch.Tensor  # [N·S] int64
    slot_table: torch.Tensor | None  # [E, REPLICA_BUCKETS] int32


def layer_maps(layer: LayerReplicas, num_experts: int, tables: bool, device: torch.device) -> LayerMaps:
    table = torch.from_numpy(layer.slot_table(num_experts, REPLICA_BUCKETS)).to(device) if tables else None
    return LayerMaps(torch.tensor(layer.slot_node(), dtype=torch.int64, device=device), table)


class SlotMaps:
    def __init__(self, replicas: ExpertReplicas, num_experts: int, device: torch.device, movable: bool) -> None:
        """`movable`: the experts may move while serving (the plan's experts.rebalance or spare
        slots), so the tables exist from the start and are overwritten in place (captured graphs
        read them where they are); otherwise a placement of slot i = expert i needs none."""
        self.num_experts, self.device = num_experts, device
        self.tables = movable or replicas.needs_table(num_experts)
        self.current = replicas
        self.initial = self._maps(replicas)
        self._switch: AgreedStep[tuple[ExpertReplicas, list[LayerMaps]]] = AgreedStep()

    def _maps(self, replicas: ExpertReplicas) -> list[LayerMaps]:
        return [layer_maps(layer, self.num_experts, self.tables, self.device) for layer in replicas.layers]

    def install(self, layers: list[AttentionLayer], maps: list[LayerMaps] | None = None) -> None:
        """Every layer routes by `maps` (default: the placement it started with)."""
        for layer, m in zip(layers, maps or self.initial):
            layer.set_expert_nodes(m.slot_node, self.current.num_nodes, m.slot_table)

    def switch_at(self, step: int, replicas: ExpertReplicas) -> None:
        """Route by `replicas` from step `step` on; its maps are built here, off the step loop.
        Raises if `step` has already begun on this rank."""
        if not self.tables:
            raise DataPlaneError("this deployment started without slot tables (no experts.rebalance and no "
                                 "experts.redundant_per_node): its experts cannot move")
        replicas.check(self.num_experts, len(replicas.layers), self.current.num_nodes)
        self._switch.set(step, (replicas, self._maps(replicas)), f"expert placement {replicas.version}")

    def cancel(self, version: int) -> bool:
        """Drop a pending switch to `version` (another rank refused it); False if none was pending."""
        return self._switch.cancel(lambda change: change[0].version == version, f"expert placement {version}")

    def restore(self, replicas: ExpertReplicas, layers: list[AttentionLayer]) -> None:
        """Route by `replicas` at once: after a re-wire, before the deployment serves again (no
        step runs), every rank is given the placement the deployment had reached."""
        maps = self._maps(replicas)
        self._switch.clear()
        self.install(layers, maps)
        self.current = replicas

    def apply_due(self, step: int, layers: list[AttentionLayer]) -> None:
        """At the start of step `step`, before its first dispatch: switch if it is the agreed step."""
        change = self._switch.due(step)
        if change is not None:
            self.install(layers, change[1])
            self.current = change[0]
