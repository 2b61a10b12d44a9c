"""What every node actor of a deployment answers (`NodeActor`, the one base class of
AttentionNode, AttentionShard, ExpertNode and ExpertShard): its lifecycle through its step loop
(`NodeLoop`), its placement and resources, fault injection, and its timeline (switched on and read
back by the driver: deploy/timeline_calls.py). Each actor adds its role's calls and its step."""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

from deploy.link import SwitchableLink
from deploy.node_loop import NodeLoop
from deploy.node_process import resident_bytes
from deploy.placement import rank_placement
from megainfer.messages import NodeHealth, NodeResources, NodeRole, NodeTimeline, RankPlacement

if TYPE_CHECKING:
    from kernels.startup import KernelReport
    from megainfer.disagg.node_timeline import Timeline


class NodeActor:
    name: str
    role: NodeRole
    rank: int = 0  # within the node's tensor-parallel group
    link: SwitchableLink | None = None  # its data plane (a tensor-parallel expert follower has none)
    loop: NodeLoop

    # -- what the actor provides ---------------------------------------------------------------
    def step(self) -> None:
        """One step of its loop."""
        raise NotImplementedError

    def step_failed(self, exc: Exception) -> None:
        """After a step raised: end what no step will now serve (nothing, unless it holds requests)."""

    def kernel_report(self) -> KernelReport | None:
        """Which implementation each of this rank's operators runs (None before it is built)."""
        return None

    def _timeline(self) -> Timeline | None:
        """The recorder of this actor's runner or worker; None before it is built."""
        return None

    # -- lifecycle (called by the driver) ----------------------------------------------------------
    def ready(self) -> str:
        return self.name

    def placement(self) -> RankPlacement:
        link = self.link
        return rank_placement(self.name, link.backends() if link is not None else {}, self.kernel_report())

    def serve(self) -> None:
        self.loop.serve()

    def interrupt(self) -> None:
        self.loop.interrupt()

    def health(self) -> NodeHealth:
        return NodeHealth(self.name, self.role, self.loop.state, self.rank, self.loop.error)

    def resources(self) -> NodeResources:
        return rank_resources(self.name, self.role, self.rank, self.link)

    def drop_connections(self) -> None:
        """Fault injection (`megainfer bench soak --chaos`): this rank's M2N connections drop."""
        if self.link is None:
            raise ValueError("this rank has no M2N link to drop (a tensor-parallel follower talks only to its leader)")
        self.link.drop_connections()

    def stop(self) -> None:
        self.loop.stop()

    # -- its timeline ------------------------------------------------------------------------------
    def trace(self, on: bool) -> bool:
        """Start (clearing the old one) or stop recording; False while the node is still being built."""
        timeline = self._timeline()
        if timeline is None:
            return False
        timeline.switch(on)
        return True

    def timeline(self) -> NodeTimeline | None:
        timeline = self._timeline()
        return timeline.read() if timeline is not None else None

    def clock(self) -> float:
        return time.perf_counter()


def rank_resources(name: str, role: NodeRole, rank: int, link: SwitchableLink | None, **counts: int) -> NodeResources:
    """A rank's process memory and M2N slots in use, plus `counts` (KV blocks, requests)."""
    held, unreleased = link.slot_usage() if link is not None else (0, 0)
    return NodeResources(name, role, rank, os.getpid(), resident_bytes(), slots_held=held, slots_unreleased=unreleased,
                         **counts)
