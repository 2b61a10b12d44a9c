"""The life of a node actor's step loop, shared by attention, shard and expert nodes: run
one step after another while wired, stop stepping when the data plane fails (and say why),
wait to be re-wired, stop for good on request."""

from __future__ import annotations

import gc
import logging
import os
import threading
from typing import TYPE_CHECKING, Callable

from deploy.link import SwitchableLink
from deploy.node_process import resident_bytes
from deploy.placement import rank_placement
from megainfer.messages import NodeHealth, NodeResources, NodeRole, NodeStatus, RankPlacement

if TYPE_CHECKING:
    from kernels.startup import KernelReport

logger = logging.getLogger(__name__)


class NodeLoop:
    def __init__(self, name: str, link_of: Callable[[], SwitchableLink | None], step: Callable[[], None],
                 on_failure: Callable[[Exception], None] = lambda exc: None) -> None:
        self.name = name
        # The link may be built after the loop (tensor-parallel ranks); an expert follower rank has none.
        self._link_of = link_of
        self._step = step
        self._on_failure = on_failure
        self.wired = threading.Event()
        self.stopping = threading.Event()
        self.state = NodeStatus.WIRING
        self.error: str | None = None
        self.thread: threading.Thread | None = None

    def serve(self) -> None:
        self.state, self.error = NodeStatus.SERVING, None
        self.wired.set()
        if self.thread is None:
            # Everything built so far (weights, caches, the engine) lives as long as the node:
            # moved out of the collector's view, so a full collection mid-step (measured: a
            # 150 ms stall of one layer) walks only what steps create (as vLLM and SGLang do).
            gc.collect()
            gc.freeze()
            self.thread = threading.Thread(target=self._run, name=f"{self.name}-steps", daemon=True)
            self.thread.start()

    def interrupt(self) -> None:
        """Stop stepping: the driver is about to re-wire the data plane. New requests are refused
        from now on (the frontend holds them until the node serves again), not accepted into a
        step that is about to be abandoned."""
        self.wired.clear()
        if self.state is NodeStatus.SERVING:
            self.state = NodeStatus.WIRING
        link = self._link_of()
        if link is not None:
            link.interrupt.set()

    def broken(self, error: str, exc: BaseException | None = None) -> None:
        link = self._link_of()
        if self.state is NodeStatus.SERVING and not (link is not None and link.interrupt.is_set()):
            # The traceback goes to the actor's log: a peer's death reads the same as a bug here.
            logger.warning("%s: data plane failed (%s); waiting to be re-wired", self.name, error, exc_info=exc)
        self.state, self.error = NodeStatus.BROKEN, error
        self.wired.clear()

    def stop(self) -> None:
        self.stopping.set()
        self.wired.set()
        if self.thread is not None:
            self.thread.join(5)
        link = self._link_of()
        if link is not None:
            link.close()

    def _run(self) -> None:
        while not self.stopping.is_set():
            if not self.wired.wait(0.1):
                continue
            try:
                self._step()
            except Exception as exc:
                if self.stopping.is_set():
                    return
                self._on_failure(exc)
                self.broken(str(exc), exc)


class LoopActor:
    """The lifecycle calls a node actor answers through its loop (mixed into the actors)."""

    name: str
    role: NodeRole
    rank: int = 0  # within the node's tensor-parallel group
    loop: NodeLoop

    def ready(self) -> str:
        return self.name

    def placement(self) -> RankPlacement:
        link = getattr(self, "link", None)  # tensor-parallel followers have none
        return rank_placement(self.name, link.backends() if link is not None else {}, self.kernel_report())

    def kernel_report(self) -> KernelReport | None:
        """Which implementation each of this rank's operators runs (None before it is built)."""
        return None

    def serve(self) -> None:
        self.loop.serve()

    def interrupt(self) -> None:
        self.loop.interrupt()

    def health(self) -> NodeHealth:
        return NodeHealth(self.name, self.role, self.loop.state, self.rank, self.loop.error)

    def resources(self) -> NodeResources:
        return rank_resources(self.name, self.role, self.rank, getattr(self, "link", None))

    def drop_connections(self) -> None:
        drop_connections_of(getattr(self, "link", None))

    def stop(self) -> None:
        self.loop.stop()


def rank_resources(name: str, role: NodeRole, rank: int, link: SwitchableLink | None, **counts: int) -> NodeResources:
    """A rank's process memory and M2N slots in use, plus `counts` (KV blocks, requests)."""
    held, unreleased = link.slot_usage() if link is not None else (0, 0)
    return NodeResources(name, role, rank, os.getpid(), resident_bytes(), slots_held=held, slots_unreleased=unreleased,
                         **counts)


def drop_connections_of(link: SwitchableLink | None) -> None:
    """Fault injection (`megainfer bench soak --chaos`): this rank's M2N connections drop."""
    if link is None:
        raise ValueError("this rank has no M2N link to drop (a tensor-parallel follower talks only to its leader)")
    link.drop_connections()
