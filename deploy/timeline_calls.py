"""Nodes' timelines (megainfer/disagg/node_timeline.py) switched on and read back onto the driver's
clock: the actor side (`TimelineCalls`, mixed into every node actor) and the driver side
(`trace`, `read_timelines`).

Every process of one host reads the same CLOCK_MONOTONIC, but a node on another host has its
own. So each node's offset to the driver's clock is estimated as NTP does with one server:
the driver asks for the node's clock several times, and the sample with the shortest round
trip brackets the node's reading most tightly; the node read its clock, on average, halfway
through that round trip. The error is at most half that round trip (~1 ms over Ray).
"""

from __future__ import annotations

import time

from deploy.ray_calls import get_all
from megainfer.disagg.node_timeline import Timeline
from megainfer.messages import NodeTimeline

CALL_TIMEOUT_S = 30.0
CLOCK_SAMPLES = 7


class TimelineCalls:
    """The calls a node actor answers about its timeline."""

    def _timeline(self) -> Timeline | None:
        """The recorder of this actor's runner or worker; None before it is built."""
        raise NotImplementedError

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


def trace(actors: list, on: bool) -> None:
    get_all([a.trace.remote(on) for a in actors], CALL_TIMEOUT_S)


def clock_offset(actor, samples: int = CLOCK_SAMPLES) -> float:
    """Seconds to add to `actor`'s clock readings to put them on this process's clock."""
    best_rtt, offset = float("inf"), 0.0
    for _ in range(samples):
        sent = time.perf_counter()
        remote = get_all([actor.clock.remote()], CALL_TIMEOUT_S)[0]
        received = time.perf_counter()
        if received - sent < best_rtt:
            best_rtt, offset = received - sent, (sent + received) / 2 - remote
    return offset


def read_timelines(actors: list) -> list[NodeTimeline]:
    """Every actor's timeline with its `clock_offset` set (actors still being built are left out)."""
    timelines = get_all([a.timeline.remote() for a in actors], CALL_TIMEOUT_S)
    out = []
    for actor, timeline in zip(actors, timelines):
        if timeline is not None:
            timeline.clock_offset = clock_offset(actor)
            out.append(timeline)
    return out
