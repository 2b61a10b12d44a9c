"""One replica's node actors: spawned into its placement, formed into tensor-parallel groups,
waited for, wired over M2N, asked for health, re-wired after a failure, stopped. Every call
to the nodes goes to all of them at once (`ray.get` on a list, `ray.wait`).

Ranks, in the order every list here keeps: attention leaders (index = attention node), their
followers node by node, expert leaders, their followers node by node.
"""

from __future__ import annotations

import logging
import os
import time

import ray
from ray.exceptions import RayTaskError
from tqdm.auto import tqdm

from deploy.attention_node import AttentionNode
from deploy.attention_shard import AttentionShard
from deploy.expert_node import ExpertNode
from deploy.expert_shard import ExpertShard
from deploy.node_names import attention_rank_name, attention_rank_names, node_names
from deploy.placement import Placement
from deploy.runtime_config import DeploymentRuntime, rank_name
from deploy.ray_calls import cause, gather, get_all
from megainfer.errors import PlanError
from megainfer.messages import (FinishReason, NodeHealth, NodeResources, NodeRole, NodeState, NodeStats, NodeStatus,
                                RankPlacement)
from megainfer.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

READY_TIMEOUT_S = 600.0  # loading weights can take a while on real clusters
CALL_TIMEOUT_S = 5.0  # a node that does not answer health or state within this is taken as dead
STATS_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 10.0
WARM_UP_TIMEOUT_S = 60.0
WARM_UP_POLL_S = 0.05


def _followers(leaders: list, shards: list, tp: int) -> list[list]:
    """Each leader's follower ranks."""
    return [shards[i * (tp - 1):(i + 1) * (tp - 1)] for i in range(len(leaders))]


class NodeGroup:
    def __init__(self, runtime: DeploymentRuntime, placement: Placement, show_progress: bool = True) -> None:
        self.runtime = runtime
        self.plan = plan = runtime.plan
        self.placement = placement
        self.show_progress = show_progress
        self.attention_names, self.expert_names = node_names(plan)
        self.attention: list = []  # rank 0 of each attention node
        self.shards: list = []  # the other ranks of tensor-parallel attention nodes, node by node
        self.experts: list = []  # rank 0 of each expert node
        self.expert_shards: list = []  # the other ranks of tensor-parallel expert nodes, node by node
        # Where the experts' slots are now: the plan's, until a re-placement (deploy/expert_rebalance.py).
        self.expert_replicas = None

    @property
    def actors(self) -> list:
        return self.attention + self.shards + self.experts + self.expert_shards

    def ranks(self) -> list[tuple[str, NodeRole, int]]:
        """(name, role, rank within its node) of each of `actors`, in their order."""
        attention_tp, expert_tp = self.plan.attention.tp, self.plan.experts.tp
        return ([(name, NodeRole.ATTENTION, 0) for name in self.attention_names]
                + [(attention_rank_name(i, rank), NodeRole.ATTENTION, rank)
                   for i in range(len(self.attention_names)) for rank in range(1, attention_tp)]
                + [(name, NodeRole.EXPERT, 0) for name in self.expert_names]
                + [(rank_name(name, rank), NodeRole.EXPERT, rank) for name in self.expert_names
                   for rank in range(1, expert_tp)])

    # -- bring-up -----------------------------------------------------------------------------
    def start(self, local: bool) -> "NodeGroup":
        """Spawn, group, load, wire and warm up every rank; on any failure, stop what started and
        re-raise. `local`: Ray runs on this machine alone, so endpoints listen on loopback."""
        try:
            self._spawn(os.urandom(32), "127.0.0.1" if local else "")
            self._form_tp_groups()
            self.wait_ready(self.actors)
            self.wire()
            self._warm_up()
        except BaseException:
            self.stop()
            raise
        return self

    def _spawn(self, secret: bytes, host: str) -> None:
        plan, runtime = self.plan, self.runtime

        def actor(cls, side, bundle: int, *args):
            return ray.remote(cls).options(**self.placement.actor_options(side, bundle)).remote(
                plan, *args, secret, host)

        attention_nodes = plan.attention.nodes
        self.attention = [actor(AttentionNode, plan.attention, node.index, node) for node in runtime.attention]
        self.shards = [actor(AttentionShard, plan.attention, node.index, node, rank)
                       for node in runtime.attention for rank in range(1, plan.attention.tp)]
        self.experts = [actor(ExpertNode, plan.experts, attention_nodes + node.index, node)
                        for node in runtime.experts]
        self.expert_shards = [actor(ExpertShard, plan.experts, attention_nodes + node.index, node, rank)
                              for node in runtime.experts for rank in range(1, plan.experts.tp)]

    def _form_tp_groups(self) -> None:
        """Each tensor-parallel node's ranks join a torch.distributed group of their own."""
        groups = []
        if self.plan.attention.tp > 1:
            groups += zip(self.attention, _followers(self.attention, self.shards, self.plan.attention.tp))
        if self.plan.experts.tp > 1:
            groups += zip(self.experts, _followers(self.experts, self.expert_shards, self.plan.experts.tp))
        if not groups:
            return
        masters = get_all([leader.tp_master.remote() for leader, _ in groups], READY_TIMEOUT_S)
        get_all([rank.join_group.remote(master) for (leader, followers), master in zip(groups, masters)
                 for rank in [leader, *followers]], READY_TIMEOUT_S)

    def wait_ready(self, actors: list) -> None:
        """Until every actor has loaded its weights, in the order they finish (with progress)."""
        pending = {a.ready.remote(): a for a in actors}
        deadline = time.monotonic() + READY_TIMEOUT_S
        with tqdm(total=len(actors), desc="starting nodes (loading weights)", unit="node",
                  disable=not self.show_progress) as bar:
            while pending:
                done, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
                if not done:
                    raise PlanError(f"{len(pending)} node(s) did not start within {READY_TIMEOUT_S:g} s")
                try:
                    bar.set_postfix_str(ray.get(done[0]))
                except RayTaskError as exc:
                    raise cause(exc) from None
                pending.pop(done[0])
                bar.update(1)

    def wire(self) -> None:
        """Fresh endpoints on every rank, every attention rank connected to every expert node."""
        followers = _followers(self.attention, self.shards, self.plan.attention.tp)
        ranks = [rank for leader, own in zip(self.attention, followers) for rank in [leader, *own]]
        nodes = ranks + self.experts
        addresses = get_all([n.open_endpoint.remote() for n in nodes], READY_TIMEOUT_S)
        attention_addresses = dict(zip(attention_rank_names(self.plan), addresses[:len(ranks)]))
        expert_addresses = dict(zip(self.expert_names, addresses[len(ranks):]))
        get_all([n.connect.remote(expert_addresses) for n in ranks]
                + [n.connect.remote(attention_addresses) for n in self.experts], READY_TIMEOUT_S)
        get_all([n.serve.remote() for n in nodes + self.expert_shards], READY_TIMEOUT_S)

    def _warm_up(self) -> None:
        """Two tokens through every attention node before the group serves: the first steps pay
        for lazy set-up (allocations, the first messages). Their measured steps are drained, so
        no router fits its step model on them."""
        params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        get_all([node.add_request.remote(f"warmup-{i}", [1, 2, 3], params) for i, node in enumerate(self.attention)],
                WARM_UP_TIMEOUT_S)
        pending = set(range(len(self.attention)))
        cursors: dict[int, tuple[str | None, int]] = {i: (None, 0) for i in pending}  # acknowledged deltas
        deadline = time.monotonic() + WARM_UP_TIMEOUT_S
        while pending:
            if time.monotonic() > deadline:
                raise PlanError(f"nodes {sorted(pending)} did not answer a warm-up request in {WARM_UP_TIMEOUT_S:g} s")
            order = sorted(pending)
            for i, batch in zip(order, get_all([self.attention[i].poll.remote(*cursors[i], WARM_UP_POLL_S)
                                                for i in order], WARM_UP_TIMEOUT_S)):
                cursors[i] = (batch.incarnation, batch.last)
                for delta in batch.deltas:
                    if delta.finished and delta.finish_reason is FinishReason.ERROR:
                        raise PlanError(f"{self.attention_names[i]} failed its warm-up request: {delta.error}")
                    if delta.finished:
                        pending.discard(i)
        # Acknowledge the last deltas, so the frontend's pumps start from an empty outbox.
        get_all([node.poll.remote(*cursors[i], 0.0) for i, node in enumerate(self.attention)], WARM_UP_TIMEOUT_S)
        self.states()

    # -- while serving ------------------------------------------------------------------------
    def health(self) -> list[NodeHealth]:
        """Every rank's health, in `actors` order; a rank that does not answer is DEAD."""
        return health_of([self])[0]

    def states(self) -> tuple[float, list[NodeState | None]]:
        return states_of([self])[0]

    def stats(self) -> list[NodeStats]:
        return stats_of([self])

    def resources(self) -> list[NodeResources]:
        """What every rank holds (memory, KV blocks, M2N slots), in `actors` order; a rank that
        does not answer (dead, stopped) is left out."""
        return resources_of([self])

    def placements(self) -> list[RankPlacement]:
        """Where every rank runs, in `actors` order."""
        return get_all([n.placement.remote() for n in self.actors], CALL_TIMEOUT_S)

    @property
    def restarted_attention(self) -> bool:
        """Whether a recovery restarts the attention nodes' processes (tensor-parallel
        attention: their requests go with them)."""
        return self.plan.attention.tp > 1

    def recover(self) -> None:
        """Re-wire after a failure: every node stops stepping, restarted ones reload their
        weights, then the data plane is built anew.

        A tensor-parallel node's ranks may have left the failed step at different collectives,
        and their group pairs collectives by order: resuming would pair a stale one with a new
        one (a hang or wrong sums). So every rank of a tensor-parallel side is restarted (its
        process, by Ray) and the groups are formed anew, as at start-up."""
        restart = []
        if self.restarted_attention:
            restart += self.attention + self.shards
        if self.plan.experts.tp > 1:
            restart += self.experts + self.expert_shards
        kept = [n for n in self.attention + self.shards + self.experts if n not in restart]
        gather([n.interrupt.remote() for n in kept], CALL_TIMEOUT_S)
        restart_ranks(restart)
        self.wait_ready(kept)
        self._form_tp_groups()  # loads the restarted ranks' weights
        if self.expert_replicas is not None and self.expert_replicas.version:
            # Restarted ranks loaded the plan's placement: every rank takes the one reached.
            get_all([n.restore_experts.remote(self.expert_replicas) for n in self.actors], READY_TIMEOUT_S)
        self.wire()
        logger.info("deployment re-wired and serving%s",
                    f" ({len(restart)} tensor-parallel ranks restarted)" if restart else "")

    def stop(self) -> None:
        """Stop every rank and free the placement (again is harmless)."""
        actors = self.actors
        gather([n.stop.remote() for n in actors], STOP_TIMEOUT_S)
        for n in actors:
            ray.kill(n, no_restart=True)
        self.attention, self.shards, self.experts, self.expert_shards = [], [], [], []
        self.placement.release()


def restart_ranks(actors: list) -> None:
    """Restart the processes of `actors` and return once each answers from a new process
    (a call made right after `ray.kill` may still reach the old one)."""
    if not actors:
        return
    before = [getattr(r, "pid", None) for r in gather([a.resources.remote() for a in actors], CALL_TIMEOUT_S)]
    for actor in actors:
        ray.kill(actor, no_restart=False)
    deadline = time.monotonic() + READY_TIMEOUT_S
    pending = dict(zip(actors, before))
    while pending:
        if time.monotonic() > deadline:
            raise PlanError(f"{len(pending)} restarted rank(s) did not come back within {READY_TIMEOUT_S:g} s")
        answers = gather([a.resources.remote() for a in pending], CALL_TIMEOUT_S)
        for (actor, old_pid), answer in zip(list(pending.items()), answers):
            if isinstance(answer, NodeResources) and answer.pid != old_pid:
                del pending[actor]
        if pending:
            time.sleep(0.2)


def _split(flat: list, groups: list[NodeGroup], count) -> list[list]:
    """`flat` (answers of every group's nodes, group after group) cut back into one list per group."""
    out, start = [], 0
    for group in groups:
        out.append(flat[start:start + count(group)])
        start += count(group)
    return out


def health_of(groups: list[NodeGroup]) -> list[list[NodeHealth]]:
    """Every rank's health in each group, all asked at once (one node that hangs delays no
    other group's answer); a rank that does not answer is DEAD."""
    answers = gather([n.health.remote() for group in groups for n in group.actors], CALL_TIMEOUT_S)
    return [[answer if isinstance(answer, NodeHealth) else NodeHealth(name, role, NodeStatus.DEAD, rank, str(answer))
             for (name, role, rank), answer in zip(group.ranks(), answers_of_group)]
            for group, answers_of_group in zip(groups, _split(answers, groups, lambda g: len(g.actors)))]


def states_of(groups: list[NodeGroup]) -> list[tuple[float, list[NodeState | None]]]:
    """(when they were asked for, every attention node's scheduler state) of each group, all
    asked at once; None where a node did not answer or is still wiring. A node answers between
    two steps, so its state is as of the answer: forecasts start when the answers arrived."""
    asked_at = time.monotonic()
    answers = gather([n.state.remote() for group in groups for n in group.attention], CALL_TIMEOUT_S)
    answered = time.monotonic()
    states = [answer if isinstance(answer, NodeState) else None for answer in answers]
    for state in states:
        if state is not None:
            state.time = answered
    return [(asked_at, part) for part in _split(states, groups, lambda g: len(g.attention))]


def resources_of(groups: list[NodeGroup]) -> list[NodeResources]:
    """Every rank's resources in each group, all asked at once; ranks that do not answer are left out."""
    answers = gather([n.resources.remote() for group in groups for n in group.actors], CALL_TIMEOUT_S)
    return [answer for answer in answers if isinstance(answer, NodeResources)]


def stats_of(groups: list[NodeGroup]) -> list[NodeStats]:
    """Every attention leader's stats, all groups asked at once."""
    return get_all([n.stats.remote() for group in groups for n in group.attention], STATS_TIMEOUT_S)
