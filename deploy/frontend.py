"""The frontend of a deployment: it owns every request from submission to its last token.
It routes each request to an attention node of one of its node groups (replicas), queues it
there, pumps the nodes' token deltas to the request streams, tells the router what it learns
(node states, where requests went, measured TTFTs), and fails a dead node's requests.

Attention nodes are numbered across the node groups, in the order the groups were added, so
removing only the newest group keeps every other node's index (and the router's view of it).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from deploy.delta_pump import DeltaPump
from deploy.node_group import NodeGroup, states_of
from deploy.ray_calls import cause
from megainfer.disagg.latency import LatencyHistogram
from megainfer.errors import DataPlaneError
from megainfer.messages import NodeLoad, NodeState, RequestDelta
from megainfer.sampling_params import SamplingParams
from megainfer.server.backend import RequestStream, StreamRegistry

LOAD_REFRESH_S = 0.05  # how stale a router's view of the attention nodes may get
SUBMIT_TIMEOUT_S = 30.0
ABORT_TIMEOUT_S = 10.0
# |predicted - measured| TTFT of requests the predictive router placed, seconds.
ROUTER_ERROR_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass(frozen=True)
class Routed:
    """The router's choice for one request."""

    node: int  # attention node, numbered across the groups
    router: object = None  # the router that chose (told where the request went, even if swapped meanwhile)
    predicted_ttft_s: float | None = None  # predictive router only
    routed_at: float | None = None  # when it chose (predictive router only)


def max_open_requests(plan) -> int:
    """Requests one replica may have open before new ones are refused (backpressure)."""
    return 2 * plan.attention.nodes * plan.scheduler.max_num_seqs


class Frontend:
    def __init__(self, router, max_open_per_group: int) -> None:
        self.router = router
        self.max_open_per_group = max_open_per_group
        self.registry = StreamRegistry(max_open=0)
        self.router_error = LatencyHistogram(ROUTER_ERROR_BUCKETS)
        self.groups: list[NodeGroup] = []
        self._nodes: list = []  # attention leader actors, numbered across the groups
        self._pumps: list[DeltaPump] = []  # one per attention node, same numbering
        self._loads: list[NodeLoad] = []  # per node: the last snapshot, plus what was routed since
        self._owner: dict[str, int] = {}  # request id -> attention node
        self._predicted: dict[str, tuple[float, float]] = {}  # request id -> (submitted at, predicted TTFT)
        self._lock = threading.Lock()  # the router's state: loads, groups, the router itself
        self._stop = threading.Event()
        self._tracker: threading.Thread | None = None

    # -- node groups ----------------------------------------------------------------------------
    def add_group(self, group: NodeGroup) -> None:
        """Serve through `group`'s attention nodes from now on (a started, warmed-up group)."""
        with self._lock:
            first = len(self._nodes)
            self.groups.append(group)
            self._nodes += group.attention
            self._pumps += [DeltaPump(node, f"{first + i}", self._deliver) for i, node in enumerate(group.attention)]
            self.registry.max_open = self.max_open_per_group * len(self.groups)
        self.refresh()

    def remove_group(self, group: NodeGroup) -> None:
        """Stop routing to `group`, the newest one: its nodes' indices fall off the end."""
        with self._lock:
            if not self.groups or self.groups[-1] is not group:
                raise ValueError("only the newest node group can be removed")
            self.groups.pop()
            first = len(self._nodes) - len(group.attention)
            self.router.forget(first)
            self._nodes, self._loads = self._nodes[:first], self._loads[:first]
            pumps, self._pumps = self._pumps[first:], self._pumps[:first]
            self.registry.max_open = self.max_open_per_group * len(self.groups)
        for pump in pumps:
            pump.stop()

    def nodes_of(self, group: NodeGroup) -> range:
        first = 0
        for g in self.groups:
            if g is group:
                return range(first, first + len(g.attention))
            first += len(g.attention)
        return range(0)

    # -- routing ------------------------------------------------------------------------------
    def route(self, prompt_tokens: int, max_tokens: int) -> Routed:
        with self._lock:
            router = self.router
            node = router.choose(self._loads, prompt_tokens, max_tokens)
            self._loads[node].add(prompt_tokens)
            last = getattr(router, "last", None)  # the predictive router's forecast of this choice
        return Routed(node, router, last.ttft_s, last.at) if last is not None else Routed(node, router)

    def pin(self, node: int, prompt_tokens: int) -> Routed:
        """Send a request to `node`, whatever the router would say (tests, benches)."""
        with self._lock:
            if node < len(self._loads):
                self._loads[node].add(prompt_tokens)
        return Routed(node)

    def use_router(self, router) -> None:
        """Route with `router` from now on; it sees every node's state at once."""
        with self._lock:
            self.router = router
        self.refresh()

    def refresh(self) -> None:
        """Every group's node states to the router; a node that does not answer keeps its last load."""
        states = states_of(list(self.groups))  # (asked at, node states) per group, asked all at once
        with self._lock:
            self._loads = observe_states(self.router, states, self._loads)[:len(self._nodes)]

    def loads_of(self, group: NodeGroup) -> list[NodeLoad]:
        nodes = self.nodes_of(group)
        with self._lock:
            return self._loads[nodes.start:nodes.stop]

    def start_tracking(self) -> None:
        self._tracker = threading.Thread(target=self._track, name="node-states", daemon=True)
        self._tracker.start()

    def _track(self) -> None:
        while not self._stop.wait(LOAD_REFRESH_S):
            self.refresh()

    # -- requests -----------------------------------------------------------------------------
    def submit(self, request_id: str, prompt, params: SamplingParams, routed: Routed | None = None) -> RequestStream:
        """Queue a request where `routed` says, or where the router sends it."""
        return self.send(*self.admit(request_id, prompt, params, routed), prompt, params)

    def admit(self, request_id: str, prompt, params: SamplingParams,
              routed: Routed | None = None) -> tuple[RequestStream, Routed]:
        """Open the request's stream, then route it (unless `routed` says where it goes): a
        duplicate id or a full registry is refused before any router counts the request."""
        stream = self.registry.open(request_id)
        if routed is None:
            try:
                routed = self.route(prompt_tokens(prompt), params.max_tokens)
            except BaseException:
                self.registry.close(request_id)
                raise
        return stream, routed

    def send(self, stream: RequestStream, routed: Routed, prompt, params: SamplingParams) -> RequestStream:
        """Queue an admitted request on the node the router chose."""
        request_id = stream.request_id
        submitted = time.monotonic()
        if routed.predicted_ttft_s is not None:
            self._predicted[request_id] = (submitted, routed.predicted_ttft_s)
        self._owner[request_id] = routed.node
        try:
            with self._lock:
                if routed.node >= len(self._nodes):  # its group retired meanwhile
                    raise DataPlaneError(f"attention node {routed.node} was retired; retry")
                node = self._nodes[routed.node]
            stream.prompt_tokens = ray.get(node.add_request.remote(request_id, prompt, params),
                                           timeout=SUBMIT_TIMEOUT_S)
            if routed.routed_at is not None:  # the node holds it: snapshots asked for from now on show it
                routed.router.placed(routed.node, routed.routed_at, time.monotonic())
        except BaseException as exc:
            if routed.routed_at is not None:
                routed.router.placed(routed.node, routed.routed_at, None)
            self._forget(request_id)
            if isinstance(exc, RayTaskError):
                raise cause(exc) from None
            if isinstance(exc, (RayActorError, GetTimeoutError)):
                raise DataPlaneError(f"attention node {routed.node} is unavailable: {exc}") from None
            raise
        return stream

    def abort(self, request_id: str) -> bool:
        node = self._owner.get(request_id)
        self._forget(request_id)
        if node is None:
            return False
        try:
            with self._lock:
                actor = self._nodes[node] if node < len(self._nodes) else None
            return actor is not None and ray.get(actor.abort.remote(request_id), timeout=ABORT_TIMEOUT_S)
        except (RayActorError, GetTimeoutError):
            return False

    def owner_of(self, request_id: str) -> int | None:
        """The attention node a request went to, while it is open."""
        return self._owner.get(request_id)

    def open_requests_on(self, nodes: range) -> int:
        return sum(1 for node in list(self._owner.values()) if node in nodes)

    def fail_requests_on(self, nodes: list[int], reason: str) -> None:
        """Requests on attention nodes that died went with them: tell their clients."""
        for request_id, node in list(self._owner.items()):
            if node in nodes:
                self._deliver(RequestDelta.failure(request_id, reason))

    def _deliver(self, delta: RequestDelta) -> None:
        if delta.request_id in self._predicted and (delta.new_token_ids or delta.finished):
            submitted, predicted = self._predicted.pop(delta.request_id)
            if delta.new_token_ids:
                measured = time.monotonic() - submitted
                self.router_error.observe(abs(measured - predicted))
                learn = getattr(self.router, "observe_ttft", None)
                if learn is not None:
                    learn(predicted, measured)
        if delta.finished:
            self._owner.pop(delta.request_id, None)
        self.registry.deliver(delta)

    def _forget(self, request_id: str) -> None:
        self.registry.close(request_id)
        self._owner.pop(request_id, None)
        self._predicted.pop(request_id, None)

    def close(self) -> None:
        self._stop.set()
        if self._tracker is not None:
            self._tracker.join(5)
        for pump in self._pumps:
            pump.stop()
        for pump in self._pumps:
            pump.join(5)


def observe_states(router, groups: list[tuple[float, list[NodeState | None]]],
                   loads: list[NodeLoad]) -> list[NodeLoad]:
    """Hand each group's node states (with when they were asked for: the router replays what
    it routed since) to the router and return the loads they imply. A group's attention nodes
    run every step together, so the router takes them together; while one of them does not
    answer (None), the router keeps its last view of them all and that node keeps its last load."""
    fresh = []
    first = 0
    for asked_at, states in groups:
        for i, state in enumerate(states, first):
            if state is None:
                fresh.append(loads[i] if i < len(loads) else NodeLoad(capacity_tokens=0))
            else:
                fresh.append(state.load())
        if states and all(state is not None for state in states):
            router.observe_lockstep(first, states, asked_at)
        first += len(states)
    return fresh


def prompt_tokens(prompt) -> int:
    """Token ids count exactly; text is estimated at four bytes a token until its node tokenizes it."""
    return len(prompt) if not isinstance(prompt, str) else len(prompt.encode()) // 4 + 1
