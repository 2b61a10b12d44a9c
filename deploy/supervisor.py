"""Watches one node group: when a node is not serving, its in-flight requests are failed (a
dead attention node's requests went with it) and the group is re-wired; serving resumes."""

from __future__ import annotations

import logging
import threading

from deploy.frontend import Frontend
from deploy.node_group import NodeGroup
from megainfer.messages import NodeStatus

logger = logging.getLogger(__name__)

HEALTH_EVERY_S = 0.5


class Supervisor:
    def __init__(self, group: NodeGroup, frontend: Frontend) -> None:
        self.group = group
        self.frontend = frontend
        self.incidents = 0  # times it found nodes not serving and began a recovery
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="supervisor", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self._stop.wait(HEALTH_EVERY_S):
            health = self.group.health()
            if all(h.serving for h in health):
                continue
            self.incidents += 1
            logger.warning("nodes %s are not serving; re-wiring the deployment",
                           ", ".join(h.name for h in health if not h.serving))
            nodes = self.frontend.nodes_of(self.group)
            for node, leader in zip(nodes, health):  # attention leaders come first, in node order
                if leader.status is NodeStatus.DEAD:
                    self.frontend.fail_requests_on([node], f"{leader.name} died")
                elif self.group.restarted_attention:  # the recovery restarts it: its requests go with it
                    self.frontend.fail_requests_on([node], f"{leader.name} restarts to re-form its "
                                                           "tensor-parallel group")
            try:
                self.group.recover()
            except Exception:
                logger.exception("re-wiring failed; retrying")

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(5)
