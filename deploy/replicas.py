"""`ReplicaSet`: replicas of one plan behind one predictive router, grown and retired by the
autoscaler (plan.yaml's `autoscale` section).

Each replica is a `Deployment` (its attention and expert nodes, its own placement group). The
set routes over every attention node of every replica as one list, replicas in the order they
started, so retiring only the newest keeps every other node's index. A new request whose
best predicted TTFT passes `autoscale.predicted_ttft_s` starts another replica in the
background if the cluster has room (Ray places it, or says what is missing); the newest
replica retires after `autoscale.idle_s` without a request.
"""

from __future__ import annotations

import logging
import os
import threading
import time

import ray

from deploy.launcher import LOAD_REFRESH_S, Deployment, bundles, observe_states, prompt_tokens
from megainfer.disagg import latency
from megainfer.errors import MegaInferError, RequestError
from megainfer.plan import Plan
from megainfer.routing.autoscale import Autoscaler
from megainfer.routing.policies import NodeLoad, make_router
from megainfer.sampling_params import SamplingParams
from megainfer.server.backend import RequestStream

logger = logging.getLogger(__name__)


class ReplicaSet:
    def __init__(self, plan: Plan, address: str | None = None, show_progress: bool = True) -> None:
        if plan.autoscale is None:
            raise ValueError("ReplicaSet needs a plan with an autoscale section")
        self.plan = plan
        self.address = address
        self.show_progress = show_progress
        self.autoscaler = Autoscaler(plan.autoscale)
        self.router = make_router("predictive")
        self.replicas: list[Deployment] = []
        self._last_request: list[float] = []  # per replica: when it last got a request (or started)
        self._starting: threading.Thread | None = None
        self._loads: list[NodeLoad] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._started_ray = False
        self.events: list[dict] = []  # scale decisions and their outcome, for info() and tests

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> "ReplicaSet":
        try:
            if not ray.is_initialized():
                if self.address:
                    ray.init(address=self.address, log_to_driver=False)
                else:  # room for the largest fleet the plan allows
                    need = int(sum(b.get("CPU", 0) for b in bundles(self.plan))) * self.plan.autoscale.max_replicas
                    ray.init(num_cpus=max(os.cpu_count() or 1, need), include_dashboard=False, log_to_driver=False)
                    self._started_ray = True
            for _ in range(self.plan.autoscale.min_replicas):
                self._add(self._new_replica())
        except BaseException:
            self.close()
            raise
        tracker = threading.Thread(target=self._track, name="replica-states", daemon=True)
        tracker.start()
        self._threads.append(tracker)
        return self

    def _new_replica(self) -> Deployment:
        return Deployment(self.plan, self.address, self.show_progress, routed_externally=True).start()

    def _add(self, replica: Deployment) -> None:
        replica.router = self.router  # its measured TTFTs teach the router that placed them
        with self._lock:
            self.replicas.append(replica)
            self._last_request.append(time.monotonic())
        self._refresh()

    def _grow(self) -> None:
        """Start one more replica (in this background thread); a cluster without room says so."""
        try:
            replica = self._new_replica()
        except MegaInferError as exc:
            logger.warning("autoscale: could not add a replica: %s", exc)
            self.events.append({"time": time.monotonic(), "action": "add_failed", "error": str(exc)})
            return
        self._add(replica)
        self.events.append({"time": time.monotonic(), "action": "added", "replicas": len(self.replicas)})
        logger.info("autoscale: replica %d serving", len(self.replicas))

    # -- state ----------------------------------------------------------------------------------
    def _nodes(self) -> list[tuple[Deployment, int]]:
        return [(r, j) for r in self.replicas for j in range(len(r.attention))]

    def _refresh(self) -> None:
        states = [r.node_states() for r in list(self.replicas)]
        with self._lock:
            # A replica retired while its nodes answered: its states fall off the end.
            self._loads = observe_states(self.router, states, self._loads)[:len(self._nodes())]

    def _track(self) -> None:
        while not self._stop.wait(LOAD_REFRESH_S):
            try:
                self._refresh()
                self._maybe_retire()
            except Exception:
                logger.exception("replica state refresh failed; retrying")

    def _maybe_retire(self) -> None:
        with self._lock:
            if len(self.replicas) <= 1:
                return
            newest = self.replicas[-1]
            busy = any(load.running or load.waiting for load in self._loads[-len(newest.attention):])
            if busy or newest.open_requests:  # requests still streaming from it
                self._last_request[-1] = time.monotonic()
                return
            if not self.autoscaler.should_retire(len(self.replicas), time.monotonic() - self._last_request[-1],
                                                 time.monotonic()):
                return
            self.replicas.pop()
            self._last_request.pop()
            first = len(self._nodes())
            self.router.forget(first)
            self._loads = self._loads[:first]
        self.events.append({"time": time.monotonic(), "action": "retired", "replicas": len(self.replicas)})
        logger.info("autoscale: retiring idle replica %d", len(self.replicas) + 1)
        newest.close()

    # -- serving --------------------------------------------------------------------------------
    def submit(self, request_id: str, prompt, params: SamplingParams) -> RequestStream:
        tokens = prompt_tokens(prompt)
        with self._lock:
            if any(r.owns(request_id) for r in self.replicas):
                raise RequestError(f"request id {request_id!r} is already in use")
            nodes = self._nodes()
            i = self.router.choose(self._loads[:len(nodes)], tokens, params.max_tokens)
            self._loads[i].add(tokens)
            predicted, routed = self.router.last.ttft_s, (i, self.router.last.at)
            replica, node = nodes[i]
            self._last_request[self.replicas.index(replica)] = time.monotonic()
            starting = int(self._starting is not None and self._starting.is_alive())
            if self.autoscaler.should_add(predicted, len(self.replicas), starting, time.monotonic()):
                self.events.append({"time": time.monotonic(), "action": "add", "predicted_ttft_s": predicted,
                                    "waiting": sum(load.waiting for load in self._loads)})
                self._starting = threading.Thread(target=self._grow, name="autoscale-add", daemon=True)
                self._starting.start()
        return replica.submit(request_id, prompt, params, node=node, predicted_ttft_s=predicted, routed=routed)

    def abort(self, request_id: str) -> bool:
        owner = next((r for r in list(self.replicas) if r.owns(request_id)), None)
        return owner.abort(request_id) if owner is not None else False

    def info(self) -> dict:
        infos = [r.info() for r in list(self.replicas)]
        nodes = [{**n, "name": f"replica{k}.{n['name']}"} for k, info in enumerate(infos) for n in info["nodes"]]
        return {"model": infos[0]["model"] if infos else self.plan.model, "plan_yaml": self.plan.to_yaml(),
                "nodes": nodes}

    def health(self) -> list[dict]:
        return [s for r in list(self.replicas) for s in r.health()]

    def metrics_snapshot(self) -> dict:
        snaps = [r.metrics_snapshot() for r in list(self.replicas)]
        blocks = sum(s["kv_blocks"] for s in snaps) or 1
        return {"running": sum(s["running"] for s in snaps), "waiting": sum(s["waiting"] for s in snaps),
                "kv_cache_usage": sum(s["kv_cache_usage"] * s["kv_blocks"] for s in snaps) / blocks,
                "kv_blocks": blocks,
                "expert_bytes_read": sum(s["expert_bytes_read"] for s in snaps),
                "m2n": {k: latency.merge([s["m2n"][k] for s in snaps]) for k in ("send", "receive_wait")},
                "router_ttft_error": latency.merge([s["router_ttft_error"] for s in snaps]),
                "replicas": len(snaps)}

    def close(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(5)
        if self._starting is not None:
            self._starting.join(60)
        for r in self.replicas:
            r.close()
        self.replicas = []
        if self._started_ray:
            ray.shutdown()
