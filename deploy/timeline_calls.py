"""Nodes' timelines (megainfer/disagg/node_timeline.py) switched on and read back onto the driver's
clock: the driver's side (`trace`, `read_timelines`) of the calls every node actor answers
(`NodeActor.trace`, `.timeline`, `.clock`: deploy/node_actor.py).

Every process of one host reads the same CLOCK_MONOTONIC, but a node on another host has its
own. So each node's offset to the driver's clock is estimated as NTP does with one server:
the driver asks for the node's clock several times, and the sample with the shortest round
trip brackets the node's reading most tightly; the node read its clock, on average, halfway
through that round trip. The error is at most half that round trip (~1 ms over Ray).
"""

from __future__ import annotations

import time

from deploy.ray_calls import get_all
from megainfer.messages import NodeTimeline

CALL_TIMEOUT_S = 30.0
CLOCK_SAMPLES = 7


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
