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

from deploy.delta_delivery import DeltaDelivery, TtftFeedback
from deploy.delta_pump import DeltaPump
from deploy.node_group import NodeGroup, states_of
from deploy.ray_calls import cause
from megainfer.errors import DataPlaneError
from megainfer.messages import NodeLoad, NodeState, RequestDelta
from megainfer.routing.prefix_index import PrefixIndex
from megainfer.sampling_params import SamplingParams
from megainfer.server.backend import RequestStream, StreamRegistry

LOAD_REFRESH_S = 0.05  # how stale a router's view of the attention nodes may get
SUBMIT_TIMEOUT_S = 30.0
RETRY_EVERY_S = 0.25  # a request waiting for a recovery asks again this often
DOWN_MARK_S = 1.0  # a node that refused a request is routed around this long (then asked again)
ABORT_TIMEOUT_S = 10.0


class _NodeUnavailable(Exception):
    """The chosen attention node cannot take a request now (re-wiring, restarting, retired)."""


@dataclass(frozen=True)
class Routed:
    """The router's choice for one request."""

    node: int  # attention node, numbered across the groups
    router: object = None  # the router that chose (told where the request went, even if swapped meanwhile)
    predicted_ttft_s: float | None = None  # predictive router only
    routed_at: float | None = None  # when it chose (predictive router only)

    def reached(self, at: float | None) -> None:
        """Tell the predictive router its request reached the node at `at` (None: never will)."""
        if self.routed_at is not None:
            self.router.placed(self.node, self.routed_at, at)


def max_open_requests(plan) -> int:
    """Requests one replica may have open before new ones are refused (backpressure)."""
    return 2 * plan.attention.nodes * plan.scheduler.max_num_seqs


class Frontend:
    def __init__(self, router, max_open_per_group: int, recovery_wait_s: float = 0.0) -> None:
        self.router = router
        self.max_open_per_group = max_open_per_group
        self.recovery_wait_s = recovery_wait_s  # plan serve.recovery_wait_s: see `send`
        self.registry = StreamRegistry(max_open=0)
        self.ttft_feedback = TtftFeedback(router)
        self.groups: list[NodeGroup] = []
        self._nodes: list = []  # attention leader actors, numbered across the groups
        self._pumps: list[DeltaPump] = []  # one per attention node, same numbering
        self._loads: list[NodeLoad] = []  # per node: the last snapshot, plus what was routed since
        self._prefixes = PrefixIndex()  # per node: its cached blocks, from its snapshots (kept across routers)
        self._owner: dict[str, int] = {}  # request id -> attention node
        self.deliveries = DeltaDelivery(self.registry, self._owner, self.ttft_feedback, self._actor)
        self._down = DownNodes()  # nodes that refused a request lately: routed around
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
            self._pumps += [DeltaPump(node, first + i, self.deliveries.batch) for i, node in enumerate(group.attention)]
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
            self._prefixes.forget(first)
            self._nodes, self._loads = self._nodes[:first], self._loads[:first]
            pumps, self._pumps = self._pumps[first:], self._pumps[:first]
            self.registry.max_open = self.max_open_per_group * len(self.groups)
        stop_pumps(pumps, wait=False)

    def nodes_of(self, group: NodeGroup) -> range:
        return attention_nodes_of(self.groups, group)

    # -- routing ------------------------------------------------------------------------------
    def route(self, prompt, params: SamplingParams) -> Routed:
        """The router's choice for `prompt` (text or token ids), with what each node caches of it;
        where it chose a node marked down while another is up, the freest node that is up instead."""
        tokens = prompt_tokens(prompt)
        keys = self._prefixes.prompt_keys(prompt, params.cache_salt)  # the hashing, outside the lock
        with self._lock:
            router, loads = self.router, self._loads
            node = router.choose(loads, tokens, params.max_tokens, self._prefixes.count(keys, len(loads)))
            last = getattr(router, "last", None)  # the predictive router's forecast of this choice
            instead = self._down.steer(node, self._loads)
            if instead is not None:
                if last is not None:  # its forecast committed the request to a node it will not reach
                    router.placed(node, last.at, None)
                node, last = instead, None
            self._loads[node].add(tokens)
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
            self.ttft_feedback.router = router
        self.refresh()

    def refresh(self) -> None:
        """Every group's node states to the router; a node that does not answer keeps its last load."""
        states = states_of(list(self.groups))  # (asked at, node states) per group, asked all at once
        with self._lock:
            self._loads = observe_states(self.router, states, self._loads)[:len(self._nodes)]
            observe_prefixes(self._prefixes, states)

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
        """Queue a request where `routed` says, or where the router sends it (`admit`, `send`)."""
        return self.send(*self.admit(request_id, prompt, params, routed), prompt, params)

    def admit(self, request_id: str, prompt, params: SamplingParams,
              routed: Routed | None = None) -> tuple[RequestStream, Routed]:
        """Open the request's stream, then route it (unless `routed` says where it goes): a
        duplicate id or a full registry is refused before any router counts the request."""
        stream = self.registry.open(request_id)
        if routed is None:
            try:
                routed = self.route(prompt, params)
            except BaseException:
                self.registry.close(request_id)
                raise
        return stream, routed

    def send(self, stream: RequestStream, routed: Routed, prompt, params: SamplingParams) -> RequestStream:
        """Queue an admitted request on the node the router chose. A node that cannot take it now
        (re-wiring, restarting) is routed around for a moment and the request goes to another
        node, or waits for one, up to `recovery_wait_s`: it is served after a recovery."""
        request_id, submitted = stream.request_id, time.monotonic()
        deadline = submitted + self.recovery_wait_s
        if routed.predicted_ttft_s is not None:
            self.ttft_feedback.expect(request_id, submitted, routed.predicted_ttft_s)
        while True:
            try:
                return self._send_once(stream, routed, prompt, params, deadline)
            except _NodeUnavailable as exc:
                self._down.mark(routed.node)
                if time.monotonic() + RETRY_EVERY_S >= deadline or not self.registry.is_open(request_id):
                    self._forget(request_id)
                    raise DataPlaneError(f"{exc} (waited {time.monotonic() - submitted:.1f} s); retry") from None
                time.sleep(RETRY_EVERY_S)
                routed = self.route(prompt, params)
            except BaseException:
                self._forget(request_id)
                raise

    def _send_once(self, stream: RequestStream, routed: Routed, prompt, params: SamplingParams,
                   deadline: float) -> RequestStream:
        request_id = stream.request_id
        self._owner[request_id] = routed.node
        try:
            stream.prompt_tokens = queue_request(self._actor(routed.node), routed.node, request_id, prompt, params,
                                                 deadline)
        except BaseException:
            routed.reached(None)
            self._owner.pop(request_id, None)
            raise
        routed.reached(time.monotonic())  # the node holds it: snapshots asked for from now on show it
        if not self.registry.is_open(request_id):  # the client left while it waited: nobody reads it
            self.abort(request_id)
        return stream

    def abort(self, request_id: str) -> bool:
        node = self._owner.get(request_id)
        self._forget(request_id)
        if node is None:
            return False
        try:
            actor = self._actor(node)
            return actor is not None and ray.get(actor.abort.remote(request_id), timeout=ABORT_TIMEOUT_S)
        except (RayActorError, GetTimeoutError):
            return False

    def reset_prefix_cache(self) -> bool:
        """Every attention leader forgets its cached prefixes, all at once; True if any had a cache."""
        with self._lock:
            nodes = list(self._nodes)
        return any(ray.get([node.reset_prefix_cache.remote() for node in nodes], timeout=SUBMIT_TIMEOUT_S))

    def _actor(self, node: int):
        """Attention node `node`'s actor; None once its group retired."""
        with self._lock:
            return self._nodes[node] if node < len(self._nodes) else None

    def owner_of(self, request_id: str) -> int | None:
        """The attention node a request went to, while it is open."""
        return self._owner.get(request_id)

    def open_requests_on(self, nodes: range) -> int:
        return sum(node in nodes for node in list(self._owner.values()))

    def fail_requests_on(self, nodes: list[int], reason: str) -> None:
        """Requests on attention nodes that died went with them: tell their clients."""
        for request_id, node in list(self._owner.items()):
            if node in nodes:
                self.deliveries.one(node, RequestDelta.failure(request_id, reason))

    def _forget(self, request_id: str) -> None:
        self.registry.close(request_id)
        self._owner.pop(request_id, None)
        self.ttft_feedback.forget(request_id)

    def close(self) -> None:
        self._stop.set()
        if self._tracker is not None:
            self._tracker.join(5)
        stop_pumps(self._pumps)


def stop_pumps(pumps: list[DeltaPump], wait: bool = True) -> None:
    """Stop every pump at once, then (with `wait`) join them."""
    for pump in pumps:
        pump.stop()
    for pump in pumps if wait else ():
        pump.join(5)


def attention_nodes_of(groups: list[NodeGroup], group: NodeGroup) -> range:
    """The numbers of `group`'s attention nodes, counted across `groups` in order."""
    first = 0
    for g in groups:
        if g is group:
            return range(first, first + len(g.attention))
        first += len(g.attention)
    return range(0)


class DownNodes:
    """Attention nodes that refused a request lately (re-wiring, restarting): the router's
    choice is moved off them for DOWN_MARK_S, after which they are asked again."""

    def __init__(self) -> None:
        self._until: dict[int, float] = {}
        self._lock = threading.Lock()

    def mark(self, node: int) -> None:
        with self._lock:
            self._until[node] = time.monotonic() + DOWN_MARK_S

    def steer(self, node: int, loads: list[NodeLoad]) -> int | None:
        """Where a request the router sent to `node` should go instead: the freest node that
        is up, where `node` is down and another is up; None to leave it."""
        now = time.monotonic()
        with self._lock:
            up = [i for i in range(len(loads)) if self._until.get(i, 0.0) <= now]
        if node in up or not up:
            return None
        return max(up, key=lambda i: (loads[i].freeness(), -i))


def queue_request(node, index: int, request_id: str, prompt, params: SamplingParams, deadline: float) -> int:
    """Queue a request on attention node actor `node` (number `index`; None: its group retired),
    waiting for its answer until `deadline` at the latest; its prompt length. _NodeUnavailable
    where the node cannot take it now; the node's own error (a bad request) as it raised it."""
    if node is None:
        raise _NodeUnavailable(f"attention node {index} was retired")
    timeout_s = min(SUBMIT_TIMEOUT_S, max(deadline - time.monotonic(), RETRY_EVERY_S))
    try:
        return ray.get(node.add_request.remote(request_id, prompt, params), timeout=timeout_s)
    except RayTaskError as exc:
        error = cause(exc)
        if isinstance(error, DataPlaneError):  # the node is re-wiring
            raise _NodeUnavailable(str(error)) from None
        raise error from None
    except (RayActorError, GetTimeoutError) as exc:
        raise _NodeUnavailable(f"attention node {index} is unavailable: {exc}") from None


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


def observe_prefixes(index: PrefixIndex, groups: list[tuple[float, list[NodeState | None]]]) -> None:
    """Each answering node's prefix-cache summary into `index` (nodes numbered across the groups)."""
    states = [state for _, group in groups for state in group]
    for node, state in enumerate(states):
        if state is not None:
            index.observe(node, state.prefix)


def prompt_tokens(prompt) -> int:
    """Token ids count exactly; text is estimated at four bytes a token until its node tokenizes it."""
    return len(prompt) if not isinstance(prompt, str) else len(prompt.encode()) // 4 + 1
