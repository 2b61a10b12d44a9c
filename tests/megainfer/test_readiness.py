"""Readiness: one backend read serves every caller for a TTL counted from when it arrived."""

from __future__ import annotations

import threading
import time

from megainfer.messages import NodeRole, NodeStatus
from megainfer.server import readiness as readiness_module
from megainfer.server.backend import BackendInfo, NodeInfo
from megainfer.server.readiness import Readiness


class Clock:
    """`time` as readiness.py reads it: `monotonic` is `now`, which only the test and the slow
    read advance, so no caller's wait for a core moves it past the TTL."""

    def __init__(self) -> None:
        self.now = 100.0

    def monotonic(self) -> float:
        return self.now


class SlowBackend:
    """info() takes `delay_s` on `clock` (as a deployment's does while a node actor dies),
    answering in turn from `states`; the first read waits at `behind` for the callers that
    queue behind it."""

    def __init__(self, states: list[NodeStatus], delay_s: float, clock: Clock, behind: threading.Barrier) -> None:
        self.states, self.delay_s, self.clock, self.behind, self.reads = states, delay_s, clock, behind, 0

    def info(self) -> BackendInfo:
        if self.reads == 0:
            self.behind.wait(timeout=30)
            time.sleep(0.05)  # the callers let through are now (most likely) queued on the read's lock
        self.clock.now += self.delay_s
        state = self.states[min(self.reads, len(self.states) - 1)]
        self.reads += 1
        return BackendInfo("m", "", [NodeInfo("expert0", NodeRole.EXPERT, state, "")])


def test_a_slow_read_answers_the_callers_queued_behind_it(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(readiness_module, "time", clock)
    behind = threading.Barrier(3)  # the first read and the two callers that come while it runs
    backend = SlowBackend([NodeStatus.DEAD, NodeStatus.SERVING], delay_s=0.3, clock=clock, behind=behind)
    readiness = Readiness(backend, ttl_s=0.2)  # shorter than one read
    answers: list[bool] = []

    def caller(wait: bool) -> None:
        if wait:
            behind.wait(timeout=30)  # until the first caller's read is under way
        answers.append(readiness.check().ok)

    callers = [threading.Thread(target=caller, args=(i > 0,)) for i in range(3)]
    for c in callers:
        c.start()
    for c in callers:
        c.join()
    # One read, and every caller saw the outage it found, none a later read's recovery: the TTL
    # counts from the answer (100.3 here), not from the read's start (100.0, already 0.3 ago).
    assert backend.reads == 1 and answers == [False, False, False]
    clock.now += 0.25  # past the TTL, counted from the answer: the next caller reads again
    assert readiness.check().ok and backend.reads == 2
