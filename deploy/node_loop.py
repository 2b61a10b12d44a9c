"""A node actor's step loop: the one `StepLoop` (megainfer/engine/step_loop.py), plus the node's
data-plane link: an interrupt reaches a step blocked on the link, a failure while the driver
re-wires is expected (no warning), and stopping closes the link."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from megainfer.engine.step_loop import SteppedNode, StepLoop

if TYPE_CHECKING:
    from deploy.link import SwitchableLink


class LinkedNode(SteppedNode, Protocol):
    # The link may be built after the loop (tensor-parallel ranks); an expert follower rank has none.
    link: SwitchableLink | None


class NodeLoop(StepLoop):
    node: LinkedNode

    def interrupt(self) -> None:
        """The driver is about to re-wire the data plane: stop stepping (and any wait on the link)."""
        super().interrupt()
        if self.node.link is not None:
            self.node.link.interrupt.set()

    def _quiet_failure(self) -> bool:
        return self.node.link is not None and self.node.link.interrupt.is_set()

    def stop(self) -> None:
        super().stop()
        if self.node.link is not None:
            self.node.link.close()
