"""Where a plan's nodes go on a Ray cluster: one placement bundle per node, a capacity check
that names what is missing before anything starts, and the options each rank's actor is
started with. Shared by a single deployment and by every replica of a replica set."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import ray
from ray.exceptions import GetTimeoutError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from megainfer.errors import PlanError
from megainfer.messages import RankPlacement
from megainfer.plan import AttentionSpec, ExpertSpec, Plan

if TYPE_CHECKING:
    from kernels.startup import KernelReport

NodeSpec = AttentionSpec | ExpertSpec

PLACEMENT_TIMEOUT_S = 60.0
ACTOR_CONCURRENCY = 16  # a node actor answers the driver (requests, polls, health) while it steps


def bundle_of(side: NodeSpec) -> dict:
    """One node's bundle: a CPU per rank, and on GPUs a GPU per rank on a host of the node's
    GPU type (the accelerator_type resource Ray declares for it; a token amount, so the
    bundle pins the type without using it up)."""
    if side.gpu == "cpu":
        return {"CPU": side.tp}
    return {"CPU": side.tp, "GPU": side.tp, f"accelerator_type:{side.gpu}": 0.001}


def bundles(plan: Plan) -> list[dict]:
    """One placement bundle per node, attention nodes first."""
    return [bundle_of(plan.attention)] * plan.attention.nodes + [bundle_of(plan.experts)] * plan.experts.nodes


def resources_needed(plan: Plan, replicas: int = 1) -> dict[str, float]:
    """The cluster's resources `replicas` copies of the plan take, summed over their bundles."""
    need: dict[str, float] = {}
    for b in bundles(plan):
        for key, amount in b.items():
            need[key] = need.get(key, 0.0) + amount * replicas
    return need


def connect_ray(address: str | None, plan: Plan, replicas: int = 1, rehearsal: bool = False) -> bool:
    """Join the cluster at `address`, or start a local Ray with room for `replicas` copies of
    the plan, unless this process is already connected. A rehearsal (a GPU plan with CPU
    tensors) declares the plan's GPUs and GPU types on the local Ray, as `ray start
    --num-gpus N --resources '{"accelerator_type:H20": 1}'` would. True when this call
    started Ray (the caller stops it)."""
    if ray.is_initialized():
        return False
    if address:
        ray.init(address=address, log_to_driver=False)
        return False
    need = resources_needed(plan, replicas)
    options: dict = {}
    if rehearsal:
        options = dict(num_gpus=int(need.get("GPU", 0)),
                       resources={key: 1.0 for key in need if key.startswith("accelerator_type:")})
    # Workers at nice 0, not Ray's 15: a node's step loop must not yield its core to the driver
    # (deploy/node_process.py).
    ray.init(num_cpus=max(os.cpu_count() or 1, int(need.get("CPU", 0))), include_dashboard=False,
             log_to_driver=False, _system_config={"worker_niceness": 0}, **options)
    return True


def describe_needs(plan: Plan) -> str:
    def nodes(side: NodeSpec) -> str:
        return f"{side.nodes} x {f'{side.tp} CPU(s)' if side.gpu == 'cpu' else f'{side.tp} {side.gpu} GPU(s)'}"

    return f"attention {nodes(plan.attention)}, experts {nodes(plan.experts)}"


def check_capacity(plan: Plan) -> None:
    """Fail at once, naming what is missing, when the cluster as a whole lacks the resources
    (placement would otherwise wait for them until its timeout)."""
    need = resources_needed(plan)
    have = ray.cluster_resources()
    missing = [f"{k} (needs {v:g}, has {have.get(k, 0.0):g})" for k, v in need.items() if have.get(k, 0.0) < v]
    if not plan.is_cpu:
        missing += gpu_type_shortfalls(plan, [n["Resources"] for n in ray.nodes() if n.get("Alive")])
    if missing:
        raise PlanError(f"the cluster cannot place this plan ({describe_needs(plan)}): it lacks "
                        + ", ".join(missing) + "; join a cluster with these GPUs (--address) or plan for what you have")


def gpu_type_shortfalls(plan: Plan, hosts: list[dict]) -> list[str]:
    """Per GPU type: the plan's GPUs against those of the hosts of that type, and each node's
    tp GPUs against the largest such host (a node's ranks share one host)."""
    shortfalls = []
    for gpu in dict.fromkeys((plan.attention.gpu, plan.experts.gpu)):  # one or two types, in order
        sides = [s for s in (plan.attention, plan.experts) if s.gpu == gpu]
        wanted, tp = sum(s.tp * s.nodes for s in sides), max(s.tp for s in sides)
        typed = [h.get("GPU", 0.0) for h in hosts if f"accelerator_type:{gpu}" in h]
        if sum(typed) < wanted:
            shortfalls.append(f"{gpu} GPUs (needs {wanted}, its hosts have {sum(typed):g})")
        elif max(typed, default=0.0) < tp:
            shortfalls.append(f"a host with {tp} {gpu} GPUs for a tp-{tp} node "
                              f"(the largest has {max(typed, default=0.0):g})")
    return shortfalls


def rank_placement(name: str, links: dict[str, str] | None = None,
                   kernels: KernelReport | None = None) -> RankPlacement:
    """Called inside a node actor: the Ray node it runs on, that node's GPU type, its GPUs,
    the M2N backend of each of its links (`links`, from `SwitchableLink.backends`) and which
    implementation each of its operators runs (`kernels`, decided at its start)."""
    context = ray.get_runtime_context()
    node_id = context.get_node_id()
    resources = next((n["Resources"] for n in ray.nodes() if n["NodeID"] == node_id), {})
    types = [key.split(":", 1)[1] for key in resources if key.startswith("accelerator_type:")]
    return RankPlacement(name, node_id, types[0] if types else None,
                         [str(i) for i in context.get_accelerator_ids().get("GPU", [])], dict(links or {}), kernels)


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
        """Ray options of one rank's actor in node `bundle`: one of the bundle's CPUs, and one of
        its GPUs on GPUs (Ray then shows the actor that GPU alone, as cuda:0). A restarted rank
        reloads its weights; the ranks of a tensor-parallel node are all restarted together by the
        recovery (NodeGroup.recover), which then forms their group anew."""
        return dict(num_cpus=1, num_gpus=0 if side.gpu == "cpu" else 1, max_restarts=-1,
                    max_concurrency=ACTOR_CONCURRENCY,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(self.group,
                                                                         placement_group_bundle_index=bundle))

    def release(self) -> None:
        if self.group is not None:
            remove_placement_group(self.group)
            self.group = None
