"""Readiness: one backend read serves every caller for a TTL counted from when it arrived."""

from __future__ import annotations

import threading
import time

from megainfer.messages import NodeRole, NodeStatus
from megainfer.server.backend import BackendInfo, NodeInfo
from megainfer.server.readiness import Readiness


class SlowBackend:
    """info() takes `delay_s` (as a deployment's does while a node actor dies), answering in turn
    from `states`."""

    def __init__(self, states: list[NodeStatus], delay_s: float) -> None:
        self.states, self.delay_s, self.reads = states, delay_s, 0

    def info(self) -> BackendInfo:
        time.sleep(self.delay_s)
        state = self.states[min(self.reads, len(self.states) - 1)]
        self.reads += 1
        return BackendInfo("m", "", [NodeInfo("expert0", NodeRole.EXPERT, state, "")])


def test_a_slow_read_answers_the_callers_queued_behind_it():
    backend = SlowBackend([NodeStatus.DEAD, NodeStatus.SERVING], delay_s=0.3)
    readiness = Readiness(backend, ttl_s=0.2)  # shorter than one read
    answers = []
    callers = [threading.Thread(target=lambda: answers.append(readiness.check().ok)) for _ in range(3)]
    for c in callers:
        c.start()
    for c in callers:
        c.join()
    # One read, and every caller saw the outage it found, none a later read's recovery.
    assert backend.reads == 1 and answers == [False, False, False]
    time.sleep(0.25)  # past the TTL, counted from the answer: the next caller reads again
    assert readiness.check().ok and backend.reads == 2
