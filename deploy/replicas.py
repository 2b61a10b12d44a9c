"""`ReplicaSet`: replicas of one plan behind one predictive router, grown and retired by the
autoscaler (plan.yaml's `autoscale` section): a frontend over several node groups, plus the
autoscaler's decisions.

Each replica is a node group with its own placement group and supervisor. The frontend routes
over every attention node of every replica as one list, replicas in the order they started, so
retiring only the newest keeps every other node's index. A new request whose best predicted
TTFT passes `autoscale.predicted_ttft_s` starts another replica in the background if the
cluster has room (Ray places it, or says what is missing); the newest replica retires after
`autoscale.idle_s` without a request.
"""

from __future__ import annotations

import logging
import threading
import time

import ray

from deploy.frontend import LOAD_REFRESH_S, Frontend, max_open_requests
from deploy.node_weights import checked_model
from deploy.node_group import NodeGroup, health_of, resources_of
from deploy.placement import Placement, connect_ray
from deploy.runtime_config import runtime_of
from deploy.status import expert_window, metrics_snapshot, node_infos
from deploy.supervisor import Supervisor
from megainfer.errors import ConfigError
from megainfer.messages import ExpertLoadReport, NodeHealth, NodeResources
from megainfer.plan import Plan
from megainfer.routing.autoscale import Autoscaler
from megainfer.routing.policies import make_router
from megainfer.sampling_params import SamplingParams
from megainfer.server.backend import BackendInfo, RequestStream
from megainfer.server.metrics import MetricsSnapshot

logger = logging.getLogger(__name__)


class ReplicaSet:
    def __init__(self, plan: Plan, address: str | None = None, show_progress: bool = True,
                 device: str | None = None, step_prior: tuple[float, ...] | None = None) -> None:
        """`step_prior`: the predictive router's prior step model (planner.step_prior)."""
        if plan.autoscale is None:
            raise ValueError("ReplicaSet needs a plan with an autoscale section")
        self.plan = plan
        self.address = address
        self.show_progress = show_progress
        self.model = checked_model(plan)
        self.runtime = runtime_of(plan, device)
        self.autoscaler = Autoscaler(plan.autoscale)
        self.frontend = Frontend(make_router("predictive", step_prior=step_prior), max_open_requests(plan),
                                 plan.serve.recovery_wait_s)
        self.replicas: list[NodeGroup] = []
        self._supervisors: list[Supervisor] = []
        self._last_request: list[float] = []  # per replica: when it last got a request (or started)
        self._starting: threading.Thread | None = None
        self._lock = threading.Lock()  # replicas and their bookkeeping
        self._stop = threading.Event()
        self._tracker: threading.Thread | None = None
        self._started_ray = False

    @property
    def groups(self) -> list[NodeGroup]:
        """Its replicas' node groups, oldest first."""
        return list(self.replicas)

    @property
    def supervisors(self) -> list[Supervisor]:
        return list(self._supervisors)

    @property
    def events(self):
        """Scale decisions and their outcomes (`ScaleEvent`s)."""
        return self.autoscaler.events

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> "ReplicaSet":
        try:  # room for the largest fleet the plan allows
            self._started_ray = connect_ray(self.address, self.plan, self.plan.autoscale.max_replicas,
                                            rehearsal=self.runtime.is_rehearsal)
            for _ in range(self.plan.autoscale.min_replicas):
                self._add(self._new_replica())
        except BaseException:
            self.close()
            raise
        self._tracker = threading.Thread(target=self._track, name="replica-states", daemon=True)
        self._tracker.start()
        return self

    def _new_replica(self) -> NodeGroup:
        """A started, warmed-up replica (one that fails to start stops what it started)."""
        return NodeGroup(self.runtime, Placement(self.plan), self.show_progress).start(
            local=self._started_ray or self.address is None)

    def _add(self, group: NodeGroup) -> None:
        with self._lock:  # the frontend's groups and these lists change together
            self.frontend.add_group(group)
            self.replicas.append(group)
            self._supervisors.append(Supervisor(group, self.frontend))
            self._last_request.append(time.monotonic())

    def _grow(self) -> None:
        """Start one more replica (in this background thread); a cluster without room says so."""
        try:
            group = self._new_replica()
        except Exception as exc:  # the cluster has no room, or the replica failed to start
            logger.warning("autoscale: could not add a replica: %s", exc)
            self.autoscaler.add_failed(time.monotonic(), str(exc))
            return
        self._add(group)
        self.autoscaler.added(time.monotonic(), len(self.replicas))
        logger.info("autoscale: replica %d serving", len(self.replicas))

    def _track(self) -> None:
        while not self._stop.wait(LOAD_REFRESH_S):
            try:
                self.frontend.refresh()
                self._maybe_retire()
            except Exception:
                logger.exception("replica state refresh failed; retrying")

    def _maybe_retire(self) -> None:
        with self._lock:
            if len(self.replicas) <= 1:
                return
            newest = self.replicas[-1]
            busy = any(load.running or load.waiting for load in self.frontend.loads_of(newest))
            if busy or self.frontend.open_requests_on(self.frontend.nodes_of(newest)):
                self._last_request[-1] = time.monotonic()  # requests still streaming from it
                return
            now = time.monotonic()
            if not self.autoscaler.should_retire(len(self.replicas), now - self._last_request[-1], now):
                return
            self.frontend.remove_group(newest)
            self.replicas.pop()
            self._last_request.pop()
            supervisor = self._supervisors.pop()
        logger.info("autoscale: retiring idle replica %d", len(self.replicas) + 1)
        supervisor.stop()
        newest.stop()

    # -- serving --------------------------------------------------------------------------------
    def submit(self, request_id: str, prompt, params: SamplingParams) -> RequestStream:
        stream, routed = self.frontend.admit(request_id, prompt, params)
        self._after_routing(routed)
        return self.frontend.send(stream, routed, prompt, params)

    def _after_routing(self, routed) -> None:
        """The chosen replica was asked for now; a slow prediction may start another one."""
        with self._lock:
            for k, group in enumerate(self.replicas):
                if routed.node in self.frontend.nodes_of(group):
                    self._last_request[k] = time.monotonic()
            starting = int(self._starting is not None and self._starting.is_alive())
            waiting = max((sum(load.waiting for load in self.frontend.loads_of(group)) for group in self.replicas),
                          default=0)  # on the busiest replica
            if self.autoscaler.should_add(routed.predicted_ttft_s, len(self.replicas), starting, time.monotonic(),
                                          waiting):
                self._starting = threading.Thread(target=self._grow, name="autoscale-add", daemon=True)
                self._starting.start()

    def abort(self, request_id: str) -> bool:
        return self.frontend.abort(request_id)

    def info(self) -> BackendInfo:
        return BackendInfo(self.model.name, self.plan.to_yaml(), node_infos(list(self.replicas), prefix_replicas=True))

    def health(self) -> list[NodeHealth]:
        return [h for health in health_of(list(self.replicas)) for h in health]

    def resources(self) -> list[NodeResources]:
        return resources_of(list(self.replicas))

    def metrics_snapshot(self) -> MetricsSnapshot:
        return metrics_snapshot(list(self.replicas), self.frontend.ttft_feedback.router_error)

    def reset_prefix_cache(self) -> bool:
        return self.frontend.reset_prefix_cache()

    def expert_load(self) -> ExpertLoadReport | None:
        return expert_window(list(self.replicas))

    def rebalance_experts(self):
        raise ConfigError("expert re-placement serves one replica: the plan's autoscale section makes several "
                          "(the plan schema refuses experts.rebalance with autoscale)")

    def close(self) -> None:
        self._stop.set()
        if self._tracker is not None:
            self._tracker.join(5)
        if self._starting is not None:
            self._starting.join(60)
        for supervisor in self._supervisors:
            supervisor.stop()
        self.frontend.close()
        for group in self.replicas:
            group.stop()
        self.replicas = []
        if self._started_ray:
            ray.shutdown()
