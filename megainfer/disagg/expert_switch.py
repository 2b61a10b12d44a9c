"""An expert rank's side of a re-placement (megainfer/expert_replicas.py): the new placement's
experts loaded beside the serving ones (`stage`, off the step loop, only the rows whose expert
changes), then served from the agreed step on (`apply_due` on the node's leader, when the step's
first round arrives; `follow` on a tensor-parallel follower, when the leader's header names the
new version). A failed or cancelled stage leaves the old placement serving.
"""

from __future__ import annotations

import threading
import time

from megainfer.disagg.agreed_step import AgreedStep
from megainfer.errors import DataPlaneError
from megainfer.expert_replicas import ExpertReplicas
from megainfer.messages import StagedPlacement
from megainfer.model.expert_layer import ExpertLayer, NodeSlots, StagedExperts
from megainfer.model.weights import WeightSource


def node_slots(replicas: ExpertReplicas, node: int) -> list[tuple[list[int], NodeSlots]]:
    """Node `node`'s experts and slots, layer by layer."""
    room, num_ids = replicas.slots_per_node, replicas.num_nodes * replicas.slots_per_node
    return [(list(layer.node_experts[node]), NodeSlots(layer.node_slots(node), num_ids, room))
            for layer in replicas.layers]


def _stage_layers(layers: list[ExpertLayer], replicas: ExpertReplicas, node: int,
                  weights: WeightSource) -> list[StagedExperts]:
    """Every layer's experts of `replicas` on node `node`, loaded beside the serving ones."""
    return [layer.stage(experts, slots.ids, weights) if layer.cfg.is_moe_layer(layer.layer) else layer.stage([], [], weights)
            for layer, (experts, slots) in zip(layers, node_slots(replicas, node))]


class ExpertSwitch:
    def __init__(self, version: int) -> None:
        self.version = version  # the placement serving now
        self._staged: dict[int, list[StagedExperts]] = {}
        self._switch: AgreedStep[int] = AgreedStep()  # the version to serve from the agreed step
        self._lock = threading.Lock()  # the staged placements

    def stage(self, layers: list[ExpertLayer], replicas: ExpertReplicas, node: int,
              weights: WeightSource) -> StagedPlacement:
        """Load `replicas`' experts of node `node` beside the serving ones."""
        start = time.perf_counter()
        staged = _stage_layers(layers, replicas, node, weights)
        with self._lock:
            self._staged[replicas.version] = staged
        return StagedPlacement(replicas.version, sum(s.nbytes for s in staged), sum(len(s.changed) for s in staged),
                               time.perf_counter() - start)

    def switch_at(self, step: int, version: int) -> None:
        with self._lock:
            if version not in self._staged:
                raise DataPlaneError(f"expert placement {version} was not staged here")
        self._switch.set(step, version, f"expert placement {version}")

    def cancel(self, version: int) -> None:
        """Forget `version` (staged or pending): the old placement keeps serving."""
        self._switch.cancel(lambda pending: pending == version, f"expert placement {version}")
        with self._lock:
            self._staged.pop(version, None)

    def apply_due(self, step: int, layers: list[ExpertLayer]) -> None:
        """The leader, as step `step`'s first round arrives: switch if it is the agreed step."""
        version = self._switch.due(step)
        if version is not None:
            with self._lock:
                staged = self._staged.pop(version)
            self._commit(layers, staged, version)

    def follow(self, version: int, layers: list[ExpertLayer]) -> None:
        """A follower rank: serve `version`, the one its leader's header names."""
        if version == self.version:
            return
        with self._lock:
            staged = self._staged.pop(version, None)
        if staged is None:
            raise DataPlaneError(f"the leader serves expert placement {version}, which this rank never staged")
        self._commit(layers, staged, version)

    def restore(self, layers: list[ExpertLayer], replicas: ExpertReplicas, node: int, weights: WeightSource) -> None:
        """Serve `replicas` at once: after a re-wire, before the deployment serves again."""
        staged = _stage_layers(layers, replicas, node, weights)
        self._switch.clear()
        with self._lock:
            self._staged = {}
        self._commit(layers, staged, replicas.version)

    def _commit(self, layers: list[ExpertLayer], staged: list[StagedExperts], version: int) -> None:
        for layer, s in zip(layers, staged):
            layer.commit(s)
        self.version = version
