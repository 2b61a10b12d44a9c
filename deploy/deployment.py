"""`Deployment`: a plan brought up on Ray and served as a generation backend.

Ray is the control plane: placement (`placement`), the nodes' actors and their lifecycle
(`node_group`), health and recovery (`supervisor`), and the small messages of requests and
token deltas (`frontend`). The data plane is the M2N transport between the node actors;
per-layer activations never touch Ray's object store. This class only puts those parts
together for one replica; `replicas.ReplicaSet` puts them together for many.
"""

from __future__ import annotations

import ray

from deploy.expert_rebalance import ExpertRebalancer
from deploy.frontend import Frontend, max_open_requests, prompt_tokens
from deploy.node_weights import checked_model
from deploy.node_group import NodeGroup
from deploy.placement import Placement, connect_ray
from deploy.runtime_config import runtime_of
from deploy.status import expert_window, metrics_snapshot, node_infos
from deploy.supervisor import Supervisor
from megainfer.messages import ExpertLoadReport, NodeHealth, NodeResources, NodeStats, RebalanceReport
from megainfer.plan import Plan
from megainfer.routing.policies import make_router
from megainfer.sampling_params import SamplingParams
from megainfer.server.backend import BackendInfo, RequestStream
from megainfer.server.metrics import MetricsSnapshot


class Deployment:
    """One replica of a plan behind its own router."""

    def __init__(self, plan: Plan, address: str | None = None, show_progress: bool = True,
                 device: str | None = None, step_prior: tuple[float, ...] | None = None) -> None:
        """`device`: where tensors live, default the plan's; "cpu" rehearses a GPU plan (its
        placement, GPU types and groups) with CPU tensors. `step_prior`: the predictive
        router's prior step model (planner.step_prior), where the plan routes predictively."""
        self.plan = plan
        self.address = address
        self.show_progress = show_progress
        self.model = checked_model(plan)
        self.runtime = runtime_of(plan, device)
        predictive = plan.serve.router == "predictive" and step_prior is not None
        router = make_router(plan.serve.router, step_prior=step_prior) if predictive else make_router(plan.serve.router)
        self.frontend = Frontend(router, max_open_requests(plan), plan.serve.recovery_wait_s)
        self.group: NodeGroup | None = None
        self.supervisor: Supervisor | None = None
        self.rebalancer: ExpertRebalancer | None = None
        self._started_ray = False

    def start(self) -> "Deployment":
        """Bring the plan up; on any failure, release what was started and re-raise."""
        try:
            self._started_ray = connect_ray(self.address, self.plan, rehearsal=self.runtime.is_rehearsal)
            local = self._started_ray or self.address is None
            self.group = NodeGroup(self.runtime, Placement(self.plan), self.show_progress)
            self.group.start(local)
            self.frontend.add_group(self.group)
            self.frontend.start_tracking()
            self.supervisor = Supervisor(self.group, self.frontend)
            self.rebalancer = ExpertRebalancer(self.group, self.plan, self.model)
            self.rebalancer.start()
        except BaseException:
            self.close()
            raise
        return self

    # -- serving ------------------------------------------------------------------------------
    def submit(self, request_id: str, prompt, params: SamplingParams, node: int | None = None) -> RequestStream:
        """Queue a request on attention node `node`, or where the router sends it."""
        routed = None if node is None else self.frontend.pin(node, prompt_tokens(prompt))
        return self.frontend.submit(request_id, prompt, params, routed)

    def abort(self, request_id: str) -> bool:
        return self.frontend.abort(request_id)

    def reset_prefix_cache(self) -> bool:
        return self.frontend.reset_prefix_cache()

    def expert_load(self) -> ExpertLoadReport | None:
        return expert_window(self.groups)

    def rebalance_experts(self) -> RebalanceReport:
        """Re-place the experts now, from the attention nodes' window (deploy/expert_rebalance.py)."""
        return self.rebalancer.rebalance()

    @property
    def router(self):
        return self.frontend.router

    @property
    def router_error(self):
        return self.frontend.ttft_feedback.router_error

    @property
    def registry(self):
        return self.frontend.registry

    @property
    def groups(self) -> list[NodeGroup]:
        """Its node groups: this one replica's (the same shape as `ReplicaSet.groups`)."""
        return [self.group] if self.group is not None else []

    @property
    def supervisors(self) -> list[Supervisor]:
        return [self.supervisor] if self.supervisor is not None else []

    @property
    def experts(self) -> list:
        return self.group.experts

    def use_router(self, router) -> None:
        """Route with `router` from now on (`bench routing` compares routers on one deployment)."""
        self.frontend.use_router(router)

    # -- what it reports ----------------------------------------------------------------------
    def health(self) -> list[NodeHealth]:
        return self.group.health()

    def stats(self) -> list[NodeStats]:
        return self.group.stats()

    def resources(self) -> list[NodeResources]:
        return self.group.resources()

    def info(self) -> BackendInfo:
        return BackendInfo(self.model.name, self.plan.to_yaml(), node_infos([self.group]))

    def metrics_snapshot(self) -> MetricsSnapshot:
        predictive = self.router.name == "predictive"
        return metrics_snapshot([self.group], self.router_error if predictive else None)

    def close(self) -> None:
        if self.rebalancer is not None:
            self.rebalancer.stop()
        if self.supervisor is not None:
            self.supervisor.stop()
        self.frontend.close()
        if self.group is not None:
            self.group.stop()
        if self._started_ray:
            ray.shutdown()
