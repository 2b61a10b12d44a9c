"""Where a plan's nodes go on a Ray cluster: one placement bundle per node, a capacity check
that names what is missing before anything starts, and the options each rank's actor is
started with. Shared by a single deployment and by every replica of a replica set."""

from __future__ import annotations

import os

import ray
from ray.exceptions import GetTimeoutError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from megainfer.errors import PlanError
from megainfer.plan import AttentionSpec, ExpertSpec, Plan

NodeSpec = AttentionSpec | ExpertSpec

PLACEMENT_TIMEOUT_S = 60.0
ACTOR_CONCURRENCY = 16  # a node actor answers the driver (requests, polls, health) while it steps


def bundles(plan: Plan) -> list[dict]:
    """One placement bundle per node, attention nodes first: tp GPUs each (and the GPU type
    pinned in heterogeneous plans), or one CPU per rank in a CPU plan."""
    def bundle(side: NodeSpec) -> dict:
        if side.gpu == "cpu":
            return {"CPU": side.tp}
        return {"CPU": 1, "GPU": side.tp, f"accelerator_type:{side.gpu}": 0.001}

    return [bundle(plan.attention)] * plan.attention.nodes + [bundle(plan.experts)] * plan.experts.nodes


def cpus_needed(plan: Plan, replicas: int = 1) -> int:
    return int(sum(b.get("CPU", 0) for b in bundles(plan))) * replicas


def connect_ray(address: str | None, cpus: int) -> bool:
    """Join the cluster at `address`, or start a local Ray with at least `cpus` CPUs, unless
    this process is already connected. True when this call started Ray (the caller stops it)."""
    if ray.is_initialized():
        return False
    if address:
        ray.init(address=address, log_to_driver=False)
        return False
    ray.init(num_cpus=max(os.cpu_count() or 1, cpus), include_dashboard=False, log_to_driver=False)
    return True


def describe_needs(plan: Plan) -> str:
    def nodes(side: NodeSpec) -> str:
        return f"{side.nodes} x {'1 CPU' if side.gpu == 'cpu' else f'{side.tp} {side.gpu} GPU(s)'}"

    return f"attention {nodes(plan.attention)}, experts {nodes(plan.experts)}"


def check_capacity(plan: Plan) -> None:
    """Fail at once, naming what is missing, when the cluster as a whole lacks the resources
    (placement would otherwise wait for them until its timeout)."""
    need: dict[str, float] = {}
    for b in bundles(plan):
        for key, amount in b.items():
            need[key] = need.get(key, 0.0) + amount
    have = ray.cluster_resources()
    missing = {k: v for k, v in need.items() if have.get(k, 0.0) < v}
    if missing:
        raise PlanError(f"the cluster cannot place this plan ({describe_needs(plan)}): it lacks "
                        + ", ".join(f"{k} (needs {v:g}, has {have.get(k, 0.0):g})" for k, v in missing.items())
                        + "; join a cluster with these GPUs (--address) or plan for what you have")


class Placement:
    """One replica's placement group: bundle i is node i (attention nodes, then expert nodes)."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        check_capacity(plan)
        self.group: PlacementGroup | None = placement_group(bundles(plan), strategy="PACK")
        try:
            ray.get(self.group.ready(), timeout=PLACEMENT_TIMEOUT_S)
        except GetTimeoutError:
            self.release()
            raise PlanError(f"the cluster cannot place this plan's {len(bundles(plan))} nodes "
                            f"({describe_needs(plan)}); available: {ray.available_resources()}") from None

    def actor_options(self, side: NodeSpec, bundle: int) -> dict:
        """Ray options of one rank's actor in node `bundle`: one CPU, and one GPU of the node's
        bundle on GPUs. A restarted rank reloads its weights; a tensor-parallel group cannot be
        re-formed around one restarted rank (yet), so those ranks are not restarted."""
        return dict(num_cpus=1, num_gpus=0 if side.gpu == "cpu" else 1, max_restarts=-1 if side.tp == 1 else 0,
                    max_concurrency=ACTOR_CONCURRENCY,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(self.group,
                                                                         placement_group_bundle_index=bundle))

    def release(self) -> None:
        if self.group is not None:
            remove_placement_group(self.group)
            self.group = None
