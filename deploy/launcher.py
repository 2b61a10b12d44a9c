"""`Deployment`: a plan brought up on Ray and served as a generation backend.

Ray is the control plane: placement (one placement group, a bundle per node), actor
lifecycle (a node that dies is restarted, reloading its weights), health, and the small
messages of requests and token deltas. The data plane is the M2N transport between the
node actors; per-layer activations never touch Ray's object store.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
from tqdm.auto import tqdm

from deploy.attention_node import AttentionNode
from deploy.expert_node import ExpertNode
from deploy.attention_shard import AttentionShard
from deploy.expert_shard import ExpertShard
from deploy.node_config import attention_rank_names, node_names, weights_of
from megainfer.disagg import latency
from megainfer.disagg.latency import LatencyHistogram
from megainfer.errors import ConfigError, DataPlaneError, MegaInferError, PlanError
from megainfer.plan import Plan
from megainfer.routing.policies import NodeLoad, make_router
from megainfer.sampling_params import SamplingParams
from megainfer.server.backend import RequestStream, StreamRegistry

logger = logging.getLogger(__name__)

READY_TIMEOUT_S = 600.0  # loading weights can take a while on real clusters
HEALTH_EVERY_S = 0.5
LOAD_REFRESH_S = 0.05  # how stale a router's view of the attention nodes may get
# |predicted - measured| TTFT of requests the predictive router placed, seconds.
ROUTER_ERROR_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def bundles(plan: Plan) -> list[dict]:
    """One placement bundle per node, attention nodes first: tp GPUs each (and the GPU type
    pinned in heterogeneous plans), or one CPU each in a CPU plan."""
    def bundle(gpu: str, tp: int) -> dict:
        if gpu == "cpu":
            return {"CPU": tp}
        return {"CPU": 1, "GPU": tp, f"accelerator_type:{gpu}": 0.001}

    return [bundle(plan.attention.gpu, plan.attention.tp)] * plan.attention.nodes + \
        [bundle(plan.experts.gpu, plan.experts.tp)] * plan.experts.nodes


class Deployment:
    """One replica of a plan. `routed_externally`: a `ReplicaSet` routes over this replica's
    attention nodes together with its other replicas' (and tracks their state), so this one
    keeps no router of its own running."""

    def __init__(self, plan: Plan, address: str | None = None, show_progress: bool = True, *,
                 routed_externally: bool = False) -> None:
        self.plan = plan
        self.address = address
        self.show_progress = show_progress
        self.model, _ = weights_of(plan)
        plan.check_model(self.model)
        if self.model.expert_intermediate_size % plan.experts.tp:
            raise PlanError(f"experts.tp = {plan.experts.tp} does not divide the experts' intermediate size "
                            f"({self.model.expert_intermediate_size}); choose a tp that divides it")
        self.attention_names, self.expert_names = node_names(plan)
        self.attention_rank_names = attention_rank_names(plan)
        self.registry = StreamRegistry(max_open=2 * plan.attention.nodes * plan.scheduler.max_num_seqs)
        self._owner: dict[str, int] = {}  # request id -> attention node index
        self.routed_externally = routed_externally
        self.router = make_router(plan.serve.router)
        self._loads: list[NodeLoad] = []  # per attention node: the last snapshot, plus what was routed since
        self._predicted: dict[str, tuple[float, float]] = {}  # request id -> (submitted at, predicted TTFT)
        self.router_error = LatencyHistogram(ROUTER_ERROR_BUCKETS)
        self._route_lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._started_ray = False
        self._pg = None
        self.attention: list = []  # rank 0 of each attention node
        self.shards: list = []  # the other ranks of tensor-parallel attention nodes, node by node
        self.experts: list = []  # rank 0 of each expert node
        self.expert_shards: list = []  # the other ranks of tensor-parallel expert nodes, node by node

    # -- bring-up -----------------------------------------------------------------------------
    def start(self) -> "Deployment":
        """Bring the plan up; on any failure, release what was started and re-raise."""
        try:
            return self._start()
        except BaseException:
            self.close()
            raise

    def _start(self) -> "Deployment":
        if not ray.is_initialized():
            if self.address:
                ray.init(address=self.address, log_to_driver=False)
            else:
                need = int(sum(b.get("CPU", 0) for b in bundles(self.plan)))
                ray.init(num_cpus=max(os.cpu_count() or 1, need), include_dashboard=False, log_to_driver=False)
                self._started_ray = True
        local = self._started_ray or self.address is None
        host = "127.0.0.1" if local else None
        self._check_capacity()
        self._pg = placement_group(bundles(self.plan), strategy="PACK")
        try:
            ray.get(self._pg.ready(), timeout=60)
        except GetTimeoutError:
            raise PlanError(f"the cluster cannot place this plan's {len(bundles(self.plan))} nodes "
                            f"({self._describe_needs()}); available: {ray.available_resources()}") from None
        secret = os.urandom(32)
        threads = 1 if self.plan.attention.gpu == "cpu" else None
        plan_dict = self.plan.to_dict()

        tp, tp_e = self.plan.attention.tp, self.plan.experts.tp

        def actor(cls, bundle: int, *args):
            side = self.plan.experts if cls in (ExpertNode, ExpertShard) else self.plan.attention
            gpus = 0 if side.gpu == "cpu" else 1  # one rank, one GPU of its node's bundle
            # A tensor-parallel group cannot be re-formed around one restarted rank (yet).
            restarts = -1 if side.tp == 1 else 0
            return ray.remote(cls).options(
                num_cpus=1, num_gpus=gpus, max_restarts=restarts, max_concurrency=16,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=bundle),
            ).remote(plan_dict, *args, secret, host or "", threads)

        self.attention = [actor(AttentionNode, i, i) for i in range(self.plan.attention.nodes)]
        self.shards = [actor(AttentionShard, i, i, r) for i in range(self.plan.attention.nodes) for r in range(1, tp)]
        first_expert = self.plan.attention.nodes
        self.experts = [actor(ExpertNode, first_expert + k, k) for k in range(self.plan.experts.nodes)]
        self.expert_shards = [actor(ExpertShard, first_expert + k, k, r)
                              for k in range(self.plan.experts.nodes) for r in range(1, tp_e)]
        if tp > 1:
            self._form_tp_groups(self.attention, self.shards, tp)
        if tp_e > 1:
            self._form_tp_groups(self.experts, self.expert_shards, tp_e)
        self._wait_ready(self.attention + self.shards + self.experts + self.expert_shards)
        self._wire()
        for i, node in enumerate(self.attention):
            self._spawn(self._dispatch, node, i, name=f"dispatch-{i}")
        self._warm_up()
        # The first steps pay for lazy set-up (allocations, the first messages): a router that
        # fitted its step model on them would think the nodes slow for a long while.
        self.node_states()
        if not self.routed_externally:
            self._refresh_loads()
            self._spawn(self._track_loads, name="loads")
        self._spawn(self._supervise, name="supervisor")
        return self

    def _check_capacity(self) -> None:
        """Fail at once, naming what is missing, when the cluster as a whole lacks the resources
        (placement would otherwise wait for them until its timeout)."""
        need: dict[str, float] = {}
        for b in bundles(self.plan):
            for key, amount in b.items():
                need[key] = need.get(key, 0.0) + amount
        have = ray.cluster_resources()
        missing = {k: v for k, v in need.items() if have.get(k, 0.0) < v}
        if missing:
            raise PlanError(f"the cluster cannot place this plan ({self._describe_needs()}): it lacks "
                            + ", ".join(f"{k} (needs {v:g}, has {have.get(k, 0.0):g})" for k, v in missing.items())
                            + "; join a cluster with these GPUs (--address) or plan for what you have")

    def _describe_needs(self) -> str:
        a, e = self.plan.attention, self.plan.experts
        fmt = lambda s, n: f"{n} x {'1 CPU' if s.gpu == 'cpu' else f'{s.tp} {s.gpu} GPU(s)'}"  # noqa: E731
        return f"attention {fmt(a, a.nodes)}, experts {fmt(e, e.nodes)}"

    def _wait_ready(self, actors: list) -> None:
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
                    raise _cause(exc) from None
                pending.pop(done[0])
                bar.update(1)

    def _form_tp_groups(self, leaders: list, followers: list, tp: int) -> None:
        """Each tensor-parallel node's ranks join a torch.distributed group of their own."""
        calls = []
        for i, leader in enumerate(leaders):
            master = ray.get(leader.tp_master.remote())
            calls.append(leader.join_group.remote(master))
            calls += [f.join_group.remote(master) for f in followers[i * (tp - 1):(i + 1) * (tp - 1)]]
        try:
            ray.get(calls, timeout=READY_TIMEOUT_S)
        except RayTaskError as exc:
            raise _cause(exc) from None

    def _attention_ranks(self) -> list:
        """Every attention rank actor, in the order of `attention_rank_names`."""
        tp = self.plan.attention.tp
        return [a for i, leader in enumerate(self.attention)
                for a in [leader] + self.shards[i * (tp - 1):(i + 1) * (tp - 1)]]

    def _wire(self) -> None:
        """Fresh endpoints on every rank, every attention rank connected to every expert node."""
        ranks = self._attention_ranks()
        nodes = ranks + self.experts
        addresses = ray.get([n.open_endpoint.remote() for n in nodes])
        attn_addr = dict(zip(self.attention_rank_names, addresses[:len(ranks)]))
        expert_addr = dict(zip(self.expert_names, addresses[len(ranks):]))
        ray.get([n.connect.remote(expert_addr) for n in ranks] + [n.connect.remote(attn_addr) for n in self.experts])
        ray.get([n.serve.remote() for n in nodes + self.expert_shards])

    def _warm_up(self) -> None:
        params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        streams = [self.submit(f"warmup-{i}", [1, 2, 3], params, node=i) for i in range(len(self.attention))]
        for stream in streams:
            stream.wait_finished(60.0)

    def _spawn(self, target, *args, name: str) -> None:
        t = threading.Thread(target=target, args=args, name=name, daemon=True)
        t.start()
        self._threads.append(t)

    # -- serving ------------------------------------------------------------------------------
    def submit(self, request_id: str, prompt, params: SamplingParams, node: int | None = None,
               predicted_ttft_s: float | None = None, routed: tuple[int, float] | None = None) -> RequestStream:
        """Queue a request on attention node `node`, or where the router sends it. `routed`:
        (the router's node index, when it chose) where a replica set chose `node`."""
        stream = self.registry.open(request_id)
        submitted = time.monotonic()
        tokens = prompt_tokens(prompt)
        with self._route_lock:
            router = self.router  # the one to tell where the request went, even if swapped meanwhile
            if node is None:
                node = router.choose(self._loads, tokens, params.max_tokens)
                last = getattr(router, "last", None)
                predicted_ttft_s = last.ttft_s if last is not None else None
                routed = (node, last.at) if last is not None else None
            if node < len(self._loads):  # (a replica set tracks loads itself)
                self._loads[node].add(tokens)
        if predicted_ttft_s is not None:
            self._predicted[request_id] = (submitted, predicted_ttft_s)
        self._owner[request_id] = node
        try:
            stream.prompt_tokens = ray.get(
                self.attention[node].add_request.remote(request_id, prompt, dataclasses.asdict(params)), timeout=30)
            if routed is not None:  # the node's scheduler holds it: snapshots asked from now on show it
                router.placed(*routed, time.monotonic())
        except BaseException as exc:
            if routed is not None:
                router.placed(*routed, None)
            self.registry.close(request_id)
            self._owner.pop(request_id, None)
            self._predicted.pop(request_id, None)
            if isinstance(exc, RayTaskError):
                raise _cause(exc) from None
            if isinstance(exc, (RayActorError, GetTimeoutError)):
                raise DataPlaneError(f"{self.attention_names[node]} is unavailable: {exc}") from None
            raise
        return stream

    def node_states(self) -> list:
        """(NodeState or None, when it was asked for) of every attention node; None where the
        node did not answer or is still wiring."""
        taken = time.monotonic()
        refs = [n.state.remote() for n in self.attention]
        states = []
        for ref in refs:
            try:
                states.append(ray.get(ref, timeout=5))
            except (RayActorError, GetTimeoutError):
                states.append(None)
        # A node answers between two steps (its step holds the engine), so its state is as of
        # the answer, not the asking: forecasts start then. Requests routed after the asking
        # are the ones the router replays onto it.
        answered = time.monotonic()
        for state in states:
            if state is not None:
                state.time = answered
        return [(s, taken) for s in states]

    def _refresh_loads(self) -> None:
        """Every attention node's state to the router; a node that does not answer keeps its last load."""
        states = self.node_states()
        with self._route_lock:
            self._loads = observe_states(self.router, [states], self._loads)

    def use_router(self, router) -> None:
        """Route with `router` from now on (`bench routing` compares routers on one deployment);
        it sees every node's state at once."""
        with self._route_lock:
            self.router = router
        self._refresh_loads()

    def _track_loads(self) -> None:
        while not self._stop.wait(LOAD_REFRESH_S):
            self._refresh_loads()

    def owns(self, request_id: str) -> bool:
        return request_id in self._owner

    @property
    def open_requests(self) -> int:
        """Requests submitted here that have not finished."""
        return len(self._owner)

    def abort(self, request_id: str) -> bool:
        i = self._owner.pop(request_id, None)
        self.registry.close(request_id)
        if i is None:
            return False
        try:
            return ray.get(self.attention[i].abort.remote(request_id), timeout=10)
        except (RayActorError, GetTimeoutError):
            return False

    def _dispatch(self, node, index: int) -> None:
        while not self._stop.is_set():
            try:
                deltas = ray.get(node.poll.remote(0.05), timeout=10)
            except (RayActorError, GetTimeoutError):
                time.sleep(0.2)  # the supervisor handles the node; keep listening
                continue
            for d in deltas:
                rid = d["request_id"]
                if rid in self._predicted and (d["new_token_ids"] or d["finished"]):
                    submitted, predicted = self._predicted.pop(rid)
                    if d["new_token_ids"]:
                        measured = time.monotonic() - submitted
                        self.router_error.observe(abs(measured - predicted))
                        learn = getattr(self.router, "observe_ttft", None)
                        if learn is not None:
                            learn(predicted, measured)
                if d["finished"]:
                    self._owner.pop(rid, None)
                self.registry.deliver(d)

    def _supervise(self) -> None:
        while not self._stop.wait(HEALTH_EVERY_S):
            states = self.health()
            if all(s["state"] == "serving" for s in states):
                continue
            bad = [s["name"] for s in states if s["state"] != "serving"]
            logger.warning("nodes %s are not serving; re-wiring the deployment", ", ".join(bad))
            try:
                self._recover(states)
            except Exception:
                logger.exception("re-wiring failed; retrying")

    def health(self) -> list[dict]:
        """Attention leaders first (index = attention node), then their followers, then expert
        leaders, then theirs."""
        shard_names = [n for n in self.attention_rank_names if "." in n]
        expert_shard_names = [f"{e}.{r}" for e in self.expert_names for r in range(1, self.plan.experts.tp)]
        names = self.attention_names + shard_names + self.expert_names + expert_shard_names
        refs = [n.health.remote() for n in self.attention + self.shards + self.experts + self.expert_shards]
        states = []
        for name, ref in zip(names, refs):
            try:
                states.append(ray.get(ref, timeout=5))
            except (RayActorError, GetTimeoutError) as exc:
                states.append({"name": name, "state": "dead", "error": str(exc)})
        return states

    def _recover(self, states: list[dict]) -> None:
        # Requests on an attention node that died went with it: tell their clients.
        for i, s in enumerate(states[:len(self.attention)]):
            if s["state"] == "dead":
                for rid, owner in list(self._owner.items()):
                    if owner == i:
                        self._owner.pop(rid, None)
                        self.registry.deliver({"request_id": rid, "new_token_ids": [], "new_text": "", "finished": True,
                                               "finish_reason": "error", "error_code": "unavailable",
                                               "error": f"{s['name']} died"})
        if max(self.plan.attention.tp, self.plan.experts.tp) > 1 and any(s["state"] == "dead" for s in states):
            raise DataPlaneError("a rank of a tensor-parallel deployment died; re-forming its group is not "
                                 "supported yet: redeploy")
        nodes = self.attention + self.shards + self.experts
        for n in nodes:
            try:
                ray.get(n.interrupt.remote(), timeout=5)
            except (RayActorError, GetTimeoutError):
                pass
        self._wait_ready(nodes)  # restarted nodes have reloaded their weights
        self._wire()
        logger.info("deployment re-wired and serving")

    def info(self) -> dict:
        nodes = []
        for s in self.health():
            role = "attention" if s["name"].startswith("attention") else "expert"
            if "." in s["name"]:
                nodes.append({"name": s["name"], "role": role, "state": s["state"],
                              "detail": "tensor-parallel follower" if s["state"] == "serving" else s.get("error") or ""})
                continue
            detail = (f"running {s.get('running', 0)}, waiting {s.get('waiting', 0)}" if role == "attention"
                      else f"experts {s.get('experts')}, steps {s.get('steps')}") if s["state"] == "serving" \
                else (s.get("error") or "")
            nodes.append({"name": s["name"], "role": role, "state": s["state"], "detail": detail})
        return {"model": self.model.name, "plan_yaml": self.plan.to_yaml(), "nodes": nodes}

    def stats(self) -> list[dict]:
        return ray.get([n.stats.remote() for n in self.attention])

    def metrics_snapshot(self) -> dict:
        """The deployment's state for the metrics endpoint: attention nodes summed (KV usage
        over all their blocks), M2N latencies merged over every attention leader."""
        stats = self.stats()
        blocks = sum(s["num_kv_blocks"] for s in stats) or 1
        return {"running": sum(s["num_running"] for s in stats), "waiting": sum(s["num_waiting"] for s in stats),
                "kv_cache_usage": sum(s["kv_cache_usage"] * s["num_kv_blocks"] for s in stats) / blocks,
                "kv_blocks": blocks,
                "expert_bytes_read": sum(s["expert_bytes_read"] for s in stats),
                "m2n": {k: latency.merge([s["m2n"][k] for s in stats]) for k in ("send", "receive_wait")},
                "router_ttft_error": self.router_error.snapshot() if self.router.name == "predictive" else None}

    def close(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(5)
        for n in self.attention + self.shards + self.experts + self.expert_shards:
            try:
                ray.get(n.stop.remote(), timeout=10)
            except Exception:
                pass
            ray.kill(n, no_restart=True)
        if self._pg is not None:
            remove_placement_group(self._pg)
        if self._started_ray:
            ray.shutdown()


def observe_states(router, replicas: list[list], loads: list[NodeLoad]) -> list[NodeLoad]:
    """Hand each replica's node states ((NodeState, asked-at) per attention node) to the router
    and return the loads they imply. A replica's attention nodes run every step together, so
    the router takes them together; while one of them does not answer (None), the router keeps
    its last view of them all and that node keeps its last load."""
    fresh = []
    first = 0
    for states in replicas:
        for i, (state, _) in enumerate(states, first):
            if state is None:
                fresh.append(loads[i] if i < len(loads) else NodeLoad(capacity_tokens=0))
            else:
                fresh.append(NodeLoad(**state.load()))
        if states and all(state is not None for state, _ in states):
            router.observe_lockstep(first, [state for state, _ in states], states[0][1])
        first += len(states)
    return fresh


def prompt_tokens(prompt) -> int:
    """Token ids count exactly; text is estimated at four bytes a token until its node tokenizes it."""
    return len(prompt) if not isinstance(prompt, str) else len(prompt.encode()) // 4 + 1


def _cause(exc: RayTaskError) -> BaseException:
    """The exception a node raised (RequestError, DataPlaneError, ...) rather than Ray's wrapper."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, MegaInferError):
        return cause
    return ConfigError(str(cause or exc))
