"""Which attention node (or replica) takes a new request. Policies share one interface: the
deployment (or the cluster simulator) hands every node's snapshot to `observe` as it arrives
and asks `choose` for each request.

- round_robin: in turn.
- random: uniformly at random (seeded).
- least_loaded: Llumnix's freeness, the KV capacity left after what is cached and what is
  still to prefill, per request the node carries; the freest node wins.
- predictive: Block's idea. Each node's snapshot is rolled forward with the real scheduler
  and a step-time model calibrated from the node's own measured steps
  (`routing.forecast`); the request goes where its predicted TTFT (or end-to-end latency)
  is lowest, charging each node only the part of the prompt it does not cache.
- prefix_affinity: the node caching most of the prompt (`routing.prefix_index`), then the
  least loaded; a node carrying well over the mean number of requests is passed over, so one
  popular prefix does not flood one node.

`choose` gets, with each request, `cached[i]`: the prompt tokens node i would serve from its
prefix cache (None where nobody knows: a text prompt, prefix caching off).
"""

from __future__ import annotations

import itertools
import random
import time
from collections import deque
from dataclasses import dataclass

import numpy as np

from megainfer.errors import ConfigError
from megainfer.messages import NodeLoad, StepSample
from megainfer.plan import ROUTERS
from megainfer.routing.forecast import NodeForecast, RequestForecast
from megainfer.routing.length_estimator import BucketedLengthEstimator
from megainfer.routing.online_step_model import OnlineStepModel

OBJECTIVES = ("ttft", "e2e")
OFFSET_GAIN = 0.05  # how fast the TTFT offset follows measured errors (about the last 20 requests)
IN_FLIGHT_S = 30.0  # a routed request no one said reached its node is forgotten after this


@dataclass(slots=True)
class _Routed:
    """A request routed to a node that the node's last snapshot may not hold."""

    routed_at: float  # the router's clock when it chose
    prompt: int  # tokens
    output: int  # the output tokens the router estimated
    reached_at: float | None = None  # when it reached the node's scheduler (None: on its way)


class Router:
    """The interface. `loads[i]` is node i's last snapshot plus what was routed there since."""

    name = "router"

    def observe(self, node: int, state, taken_at: float) -> None:
        """Node `node`'s fresh `NodeState`, asked for at `taken_at` on the router's clock. The
        heuristic policies read only `loads`."""

    def observe_lockstep(self, first: int, states: list, taken_at: float) -> None:
        """Fresh states of nodes `first`, `first + 1`, ... that run every step together (the
        attention nodes of one disaggregated replica)."""
        for j, state in enumerate(states):
            self.observe(first + j, state, taken_at)

    def forget(self, node: int) -> None:
        """Nodes `node` and up are gone (retired replicas)."""

    def placed(self, node: int, routed_at: float, reached_at: float | None) -> None:
        """The request routed to `node` when the router's clock read `routed_at` reached the
        node's scheduler at `reached_at` (None: it never will, it was refused), so snapshots
        asked for after `reached_at` hold it."""

    def choose(self, loads: list[NodeLoad], prompt_tokens: int, max_tokens: int,
               cached: list[int] | None = None) -> int:
        """Index of the node that takes a request of `prompt_tokens` tokens and at most
        `max_tokens` generated ones, of which node i caches `cached[i]`."""
        raise NotImplementedError


class RoundRobin(Router):
    name = "round_robin"

    def __init__(self) -> None:
        self._next = itertools.count()

    def choose(self, loads: list[NodeLoad], prompt_tokens: int, max_tokens: int = 0,
               cached: list[int] | None = None) -> int:
        return next(self._next) % len(loads)


class RandomRouter(Router):
    name = "random"

    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)

    def choose(self, loads: list[NodeLoad], prompt_tokens: int, max_tokens: int = 0,
               cached: list[int] | None = None) -> int:
        return self._rng.randrange(len(loads))


class LeastLoaded(Router):
    name = "least_loaded"

    def choose(self, loads: list[NodeLoad], prompt_tokens: int, max_tokens: int = 0,
               cached: list[int] | None = None) -> int:
        # Ties go to the lower index, so equal nodes fill in a stable order.
        return max(range(len(loads)), key=lambda i: (loads[i].freeness(), -i))


class PrefixAffinity(Router):
    """The node caching most of the prompt, then the freest (least_loaded's freeness). A node
    carrying more than `load_cap` times the mean requests per node, plus `slack`, is passed
    over while another is under it: a popular prefix spreads once its node is busy, and its
    blocks are then cached on the next node too."""

    name = "prefix_affinity"

    def __init__(self, load_cap: float = 1.5, slack: int = 4) -> None:
        self.load_cap = load_cap
        self.slack = slack

    def choose(self, loads: list[NodeLoad], prompt_tokens: int, max_tokens: int = 0,
               cached: list[int] | None = None) -> int:
        carried = [load.running + load.waiting for load in loads]
        cap = self.load_cap * sum(carried) / len(loads) + self.slack
        candidates = [i for i, n in enumerate(carried) if n <= cap] or list(range(len(loads)))
        hits = cached or [0] * len(loads)
        return max(candidates, key=lambda i: (hits[i], loads[i].freeness(), -i))


class PredictiveRouter(Router):
    """Routes to the node with the lowest predicted latency for this request.

    `observe` (off the request path) calibrates the node's step model with the steps it
    measured, teaches the length estimator the requests that finished, and rebuilds the
    node's forecast; requests routed since the snapshot was asked for are replayed onto it.
    `choose` predicts on every node's forecast and commits the request to the winner."""

    name = "predictive"

    def __init__(self, estimator=None, *, objective: str = "ttft", horizon: int = 128,
                 clock=time.monotonic, step_prior: tuple[float, ...] | None = None) -> None:
        if objective not in OBJECTIVES:
            raise ConfigError(f"objective {objective!r} is not one of {', '.join(OBJECTIVES)}")
        self.estimator = estimator if estimator is not None else BucketedLengthEstimator()
        self.objective = objective
        self.horizon = horizon
        self.clock = clock
        self.step_prior = step_prior
        self.models: list = []
        self.forecasts: list = []
        # Per node, what was routed there that its last snapshot may not hold.
        self._routed: list[list[_Routed]] = []
        # Lockstep replicas, by first node: step number -> the samples of it reported so far.
        self._unmatched: dict[int, dict[int, list[StepSample]]] = {}
        self.last = None  # the RequestForecast of the last choice
        # The mean of what the forecasts miss, mostly what they cannot see and every node pays
        # alike: the request's way to the node and its first token's way back. Learned from
        # measured TTFTs (`observe_ttft`); it moves every candidate's prediction by as much, so
        # it changes what is reported, not the choice.
        self.ttft_offset_s = 0.0
        self.decision_s: deque[float] = deque(maxlen=4096)

    def _grow(self, n: int) -> None:
        while len(self.models) < n:
            self.models.append(OnlineStepModel(self.step_prior) if self.step_prior else OnlineStepModel())
            self.forecasts.append(None)
            self._routed.append([])

    def observe(self, node: int, state, taken_at: float) -> None:
        self._grow(node + 1)
        model = self.models[node]
        model.observe(state.steps)
        self._rebuild(node, [state], model, taken_at)

    def observe_lockstep(self, first: int, states: list, taken_at: float) -> None:
        """The nodes share every step's time, so they share one step model, fitted on their
        work added up step by step, and one forecast timeline."""
        self._grow(first + len(states))
        model = self.models[first]
        self.models[first:first + len(states)] = [model] * len(states)
        model.observe(self._match_steps(first, states))
        self._rebuild(first, states, model, taken_at)

    def _match_steps(self, first: int, states: list) -> list[StepSample]:
        """The replica's steps complete in every node's report: the nodes' samples of each step
        number added up. A node that sat a step out (idle) reports nothing for it."""
        if any(state.steps_done < 0 for state in states):  # unnumbered steps: nothing to match them by
            return [s for state in states for s in state.steps]
        unmatched = self._unmatched.setdefault(first, {})
        for state in states:
            for s in state.steps:
                unmatched.setdefault(s.step, []).append(s)
        done = min(state.steps_done for state in states)
        newest = max(state.steps_done for state in states)
        matched = []
        for step in sorted(unmatched):
            if step < done:
                matched.append(StepSample.lockstep(unmatched.pop(step)))
            elif step > newest:  # numbered before the replica was re-wired (numbering restarts)
                del unmatched[step]
        return matched

    def _rebuild(self, first: int, states: list, model: OnlineStepModel, taken_at: float) -> None:
        for state in states:
            for prompt, output in state.finished:
                self.estimator.observe(prompt, output)
            # The caller may know the state held later than it was asked for (the node answered
            # after its step); it never held before.
            state.time = max(state.time, taken_at)
        forecasts = NodeForecast.build_lockstep(states, model, self.estimator, horizon=self.horizon)
        for node, forecast in enumerate(forecasts, first):
            # A snapshot asked for before a request reached the node does not hold it (a request
            # still on its way when the node answered would otherwise vanish from the forecasts
            # until the next snapshot, and the next long prompt would queue behind it).
            routed = [r for r in self._routed[node] if (r.reached_at is None and r.routed_at > taken_at - IN_FLIGHT_S)
                      or (r.reached_at is not None and r.reached_at >= taken_at)]
            for r in routed:
                forecast.commit(r.routed_at, r.prompt, r.output)
            self._routed[node] = routed
            self.forecasts[node] = forecast

    def forget(self, node: int) -> None:
        del self.models[node:], self.forecasts[node:], self._routed[node:]
        for first in [f for f in self._unmatched if f >= node]:
            del self._unmatched[first]

    def predict(self, node: int, prompt_tokens: int, output_tokens: int, now: float) -> tuple[float, float]:
        forecast = self.forecasts[node]
        if forecast is None:  # no snapshot yet: nothing known, so nothing queued
            return 0.0, 0.0
        return forecast.predict(now, prompt_tokens, output_tokens)

    def choose(self, loads: list[NodeLoad], prompt_tokens: int, max_tokens: int = 0,
               cached: list[int] | None = None) -> int:
        started = time.perf_counter()
        self._grow(len(loads))
        now = self.clock()
        output = self.estimator.estimate(prompt_tokens, 0, max(max_tokens, 1))
        primary = 0 if self.objective == "ttft" else 1  # which of (TTFT, e2e) decides; the other breaks ties
        # What each node must compute: the prompt less what it caches (at least the last token).
        uncached = [max(prompt_tokens - (cached[i] if cached else 0), 1) for i in range(len(loads))]
        best, best_latency = 0, None
        for i in range(len(loads)):
            latency = self.predict(i, uncached[i], output, now)
            if best_latency is None or \
                    (latency[primary], latency[1 - primary]) < (best_latency[primary], best_latency[1 - primary]):
                best, best_latency = i, latency
            elif latency == best_latency and self._lighter(i, best, loads, now):
                best = i
        forecast = self.forecasts[best]
        if forecast is not None:
            forecast.commit(now, uncached[best], output)
        self._routed[best].append(_Routed(now, uncached[best], output))
        offset = self.ttft_offset_s
        ttft_s, e2e_s = best_latency
        self.last = RequestForecast(best, max(ttft_s + offset, 0.0), max(e2e_s + offset, 0.0), output, now)
        self.decision_s.append(time.perf_counter() - started)
        return best

    def placed(self, node: int, routed_at: float, reached_at: float | None) -> None:
        if node >= len(self._routed):
            return
        routed = self._routed[node]
        for r in routed:
            if r.routed_at == routed_at and r.reached_at is None:
                if reached_at is None:
                    routed.remove(r)
                else:
                    r.reached_at = reached_at
                return

    def _lighter(self, i: int, j: int, loads: list[NodeLoad], now: float) -> bool:
        """Nodes in lockstep predict alike whenever both have room in the next step. Then the
        one with less work in that step takes the request (the nodes compute their halves side
        by side, so the step waits on the busier), and between equals the one with more KV room
        per request, as least_loaded would."""
        forecast_i, forecast_j = self.forecasts[i], self.forecasts[j]
        if forecast_i is not None and forecast_j is not None:
            room_i, room_j = forecast_i.room_next(now), forecast_j.room_next(now)
            if room_i != room_j:
                return room_i > room_j
        return loads[i].freeness() > loads[j].freeness()

    def observe_ttft(self, predicted_s: float, measured_s: float) -> None:
        """A placed request's first token came `measured_s` after submission; `predicted_s` is
        what `last.ttft_s` said then."""
        self.ttft_offset_s += OFFSET_GAIN * (measured_s - predicted_s)

    def decision_p99_s(self) -> float:
        return float(np.percentile(np.fromiter(self.decision_s, float), 99)) if self.decision_s else 0.0


def make_router(name: str, seed: int = 0, **options) -> Router:
    if name == "round_robin":
        return RoundRobin()
    if name == "random":
        return RandomRouter(seed)
    if name == "least_loaded":
        return LeastLoaded()
    if name == "predictive":
        return PredictiveRouter(**options)
    if name == "prefix_affinity":
        return PrefixAffinity()
    raise ConfigError(f"router {name!r} is not one of {', '.join(ROUTERS)}")
