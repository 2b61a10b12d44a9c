"""Discrete-event simulation of a fleet of colocated replicas behind one router (Block's
setting): each replica is the real `Scheduler` priced by the planner's step model, as in
`sim.Simulator`; every `snapshot_s` each replica's `NodeState` (with the steps it measured
and the requests it finished since) goes to the router, as a deployment's load tracker does;
each arrival is routed on what the router knows then.

Replicas may differ in GPU type (a step model each, in turn): a heterogeneous fleet, as the
planner builds them.

The client does not know a request's output length: the router sees `client_max_tokens`
(the context left, by default) and must estimate; the replica stops the request at its true
length. With `length_oracle` the router is told the true length instead.

An `Autoscaler` may grow the fleet: a replica it adds serves after `start_delay_s` (loading
weights), and the newest replica retires once it has been idle long enough.
"""

from __future__ import annotations

import heapq
import time
from array import array
from dataclasses import dataclass, field

import numpy as np

from megainfer.tools.bench.workload import SimRequest
from megainfer.config import ModelConfig
from megainfer.engine_config import EngineConfig
from megainfer.errors import ConfigError
from megainfer.messages import NodeLoad, StepSample
from megainfer.routing.autoscale import Autoscaler, ScaleEvent
from megainfer.routing.policies import PredictiveRouter, Router
from megainfer.routing.prefix_index import PrefixIndex
from megainfer.sampling_params import SamplingParams
from megainfer.scheduling.node_state import snapshot, step_sample
from megainfer.scheduling.prefix_hash import engine_salt
from megainfer.scheduling.scheduler import Scheduler
from megainfer.scheduling.scheduler_output import SchedulerOutput
from megainfer.scheduling.sequence import Sequence
from megainfer.tools.simulator.routing_skew import FITTED_RANK_OFFSET, FITTED_SKEW
from megainfer.tools.simulator.sim import Simulator
from planner.step_cost_model import ColocatedStepModel

_TOKEN = 0  # every simulated token: only lengths matter


@dataclass
class ClusterResult:
    router: str
    rate: float
    num_requests: int
    duration_s: float
    ttft_s: np.ndarray
    e2e_s: np.ndarray
    tbt_s: np.ndarray
    predicted_ttft_s: np.ndarray  # predictive only: the prediction for each request, in first-token order
    actual_ttft_s: np.ndarray  # the same requests' simulated TTFT
    per_replica: list[int]  # requests each replica served
    preemptions: int = 0
    decision_p99_s: float = 0.0
    scale_events: list[ScaleEvent] = field(default_factory=list)  # the autoscaler's, this run
    waiting_trace: list[tuple[float, int]] = field(default_factory=list)  # (time, longest queue) at snapshots
    wall_s: float = 0.0
    prefix_queries: int = 0  # prompt tokens looked up in the replicas' prefix caches (0: caching not simulated)
    prefix_hits: int = 0  # of those, found cached

    def summary(self) -> dict:
        def pct(values: np.ndarray, q: float) -> float:
            return float(np.percentile(values, q)) if len(values) else 0.0

        error = np.abs(self.predicted_ttft_s - self.actual_ttft_s)
        return {"router": self.router, "rate": self.rate, "requests": self.num_requests,
                "duration_s": self.duration_s,
                "ttft_mean_s": float(self.ttft_s.mean()), "ttft_p50_s": pct(self.ttft_s, 50),
                "ttft_p99_s": pct(self.ttft_s, 99), "e2e_mean_s": float(self.e2e_s.mean()),
                "e2e_p99_s": pct(self.e2e_s, 99), "tbt_p99_s": pct(self.tbt_s, 99),
                "prediction_mae_s": float(error.mean()) if len(error) else None,
                "prediction_bias_s": float((self.predicted_ttft_s - self.actual_ttft_s).mean()) if len(error) else None,
                "preemptions": self.preemptions, "decision_p99_ms": self.decision_p99_s * 1e3,
                "per_replica": self.per_replica,
                "prefix_hit_rate": self.prefix_hits / self.prefix_queries if self.prefix_queries else None,
                "scale_events": [event.as_dict() for event in self.scale_events], "wall_s": self.wall_s}


class _Replica:
    def __init__(self, sim: Simulator, clock, prefix_caching: bool = False) -> None:
        """`prefix_caching`: the replica's KV cache shares prefixes, as an engine's does."""
        self.sim = sim
        salt = engine_salt(sim.config, sim.model.name) if prefix_caching else None
        self.scheduler = Scheduler.from_config(sim.config, num_blocks=sim.num_blocks, max_model_len=sim.max_model_len,
                                               eos_token_ids=(), num_layers=sim.model.num_layers,
                                               window=sim.model.kv_window, prefix_salt=salt)
        self.scheduler.clock = clock
        self.step: SchedulerOutput | None = None  # in flight
        self.step_sample: StepSample | None = None
        self.step_start = 0.0
        self.steps: list[StepSample] = []  # measured since the last snapshot
        self.finished: list[tuple[int, int]] = []
        self.served = 0
        self.ready_at = 0.0
        self.idle_since = 0.0

    def serving(self, now: float) -> bool:
        """Started (its weights loaded) by `now`."""
        return self.ready_at <= now


class _SharedPrefixes:
    """Prefix caching in a simulated fleet, where the workload shares prefixes (elsewhere nothing
    would hit): replicas name blocks as engines do, and the router sees them through the
    replicas' snapshots (`index`), as a deployment's does."""

    def __init__(self, requests: list[SimRequest], enabled: bool) -> None:
        self.caching = enabled and any(request.prefix_len for request in requests)
        self.index = PrefixIndex()
        # The next token id no request has used (SimRequest.prompt_token_ids): past every prefix's.
        self._own = 1 + sum({r.prefix_id: r.prefix_len for r in requests if r.prefix_id >= 0}.values())

    def prompt(self, request: SimRequest, fleet: int, serving: list[int]) -> tuple[list[int], list[int] | None]:
        """The request's token ids, and per serving replica the tokens of it that replica caches
        (None without caching)."""
        if not self.caching:
            return [_TOKEN] * request.input_len, None
        tokens = request.prompt_token_ids(self._own)
        self._own += request.input_len
        cached = self.index.cached_tokens(tokens, fleet)
        return tokens, [cached[k] for k in serving]


@dataclass
class _Measured:
    """What one run measures, appended as requests progress."""

    ttft_s: array = field(default_factory=lambda: array("d"))
    e2e_s: array = field(default_factory=lambda: array("d"))
    tbt_s: array = field(default_factory=lambda: array("d"))
    predicted_ttft_s: array = field(default_factory=lambda: array("d"))  # with actual_ttft_s, once it is known
    actual_ttft_s: array = field(default_factory=lambda: array("d"))
    predictions: dict[str, float] = field(default_factory=dict)  # request id -> predicted TTFT, until its first token
    waiting_trace: list[tuple[float, int]] = field(default_factory=list)


class ClusterSimulator:
    def __init__(self, model: ModelConfig, step_model: ColocatedStepModel | list[ColocatedStepModel],
                 config: EngineConfig, replicas: int,
                 router: Router, *, snapshot_s: float = 0.05, expert_skew: float = FITTED_SKEW,
                 expert_rank_offset: float = FITTED_RANK_OFFSET, seed: int = 0,
                 client_max_tokens: int | None = None, length_oracle: bool = False,
                 autoscaler: Autoscaler | None = None, start_delay_s: float = 30.0) -> None:
        if replicas < 1:
            raise ConfigError(f"--replicas must be at least 1, got {replicas}")
        # A heterogeneous fleet: replica k runs on step_models[k % len] (its GPU type).
        self.step_models = step_model if isinstance(step_model, list) else [step_model]
        self.model, self.config = model, config
        self.router = router
        self.snapshot_s = snapshot_s
        self.expert_skew, self.expert_rank_offset, self.seed = expert_skew, expert_rank_offset, seed
        self.client_max_tokens = client_max_tokens
        self.length_oracle = length_oracle
        self.autoscaler = autoscaler
        self.start_delay_s = start_delay_s
        self.initial = autoscaler.policy.min_replicas if autoscaler else replicas
        self.now = 0.0
        # One run's state (`run` resets it).
        self.fleet: list[_Replica] = []
        self.loads: list[NodeLoad] = []  # the router's view: each replica's last snapshot plus what it routed since
        self.steps_in_flight: list[tuple[float, int]] = []  # heap of (end time, replica)
        self.unfinished = 0  # requests arrived and not finished
        self.max_model_len = 0  # tokens, the first replica's
        self.measured = _Measured()
        self.prefixes = _SharedPrefixes([], False)

    def _replica(self, k: int) -> _Replica:
        step_model = self.step_models[k % len(self.step_models)]
        return _Replica(Simulator(self.model, step_model, self.config, expert_skew=self.expert_skew,
                                  expert_rank_offset=self.expert_rank_offset, seed=self.seed + 7919 * k),
                        lambda: self.now, self.prefixes.caching)

    def run(self, requests: list[SimRequest], rate: float = 0.0) -> ClusterResult:
        """Every request through the fleet, events in time order: a snapshot to the router, a
        step that ends, an arrival (ties go in that order)."""
        started = time.perf_counter()
        pending = self._start(requests)
        first_arrival = self.now
        first_event = len(self.autoscaler.events) if self.autoscaler is not None else 0
        next_snapshot = self.now
        arrived = 0
        while arrived < len(pending) or self.unfinished:
            arrival_s = pending[arrived].arrival_s if arrived < len(pending) else float("inf")
            step_end_s = self.steps_in_flight[0][0] if self.steps_in_flight else float("inf")
            if next_snapshot <= min(arrival_s, step_end_s):
                self.now = next_snapshot
                self._snapshot()
                next_snapshot += self.snapshot_s
            elif step_end_s <= arrival_s:
                self._finish_step()
            else:
                self.now = arrival_s
                self._arrive(f"r{arrived}", pending[arrived])
                arrived += 1
        return self._result(len(requests), rate, self.now - first_arrival, first_event, time.perf_counter() - started)

    def _start(self, requests: list[SimRequest]) -> list[SimRequest]:
        """A fresh fleet of the initial replicas, the clock at the first arrival; the requests
        in arrival order."""
        if isinstance(self.router, PredictiveRouter):
            self.router.clock = lambda: self.now  # predictions on the simulated clock
        self.prefixes = _SharedPrefixes(requests, self.config.enable_prefix_caching)
        self.fleet = [self._replica(k) for k in range(self.initial)]
        self.max_model_len = self.fleet[0].sim.max_model_len
        for request in requests:
            if request.input_len + request.output_len > self.max_model_len:
                raise ConfigError(f"a request of {request.input_len} + {request.output_len} tokens exceeds the "
                                  f"model's context of {self.max_model_len}")
        pending = sorted(requests, key=lambda request: request.arrival_s)
        self.now = pending[0].arrival_s if pending else 0.0
        self.loads = [snapshot(rep.scheduler, self.now).load() for rep in self.fleet]
        self.steps_in_flight = []
        self.unfinished = 0
        self.measured = _Measured()
        return pending

    def _snapshot(self) -> None:
        """Every serving replica's state to the router (as a deployment's load tracker does);
        then the newest replica may retire."""
        for k, rep in enumerate(self.fleet):
            if not rep.serving(self.now):
                continue
            state = snapshot(rep.scheduler, self.now, rep.steps, rep.finished)
            rep.steps, rep.finished = [], []
            self.loads[k] = state.load()
            self.prefixes.index.observe(k, state.prefix)
            self.router.observe(k, state, self.now)
        self.measured.waiting_trace.append((self.now, max(len(rep.scheduler.waiting) for rep in self.fleet)))
        self._retire()

    def _finish_step(self) -> None:
        """The earliest step in flight ends: its tokens land, and its replica starts the next."""
        self.now, k = heapq.heappop(self.steps_in_flight)
        rep = self.fleet[k]
        out = rep.step
        rep.steps.append(StepSample(**{**rep.step_sample.__dict__, "seconds": self.now - rep.step_start}))
        measured = self.measured
        tokens = [_TOKEN if sampled else None for sampled in out.all_samples()]
        for seq in rep.scheduler.update_from_output(out, tokens):
            if seq.num_output_tokens == 1:
                measured.ttft_s.append(seq.first_token_time - seq.arrival_time + rep.sim.request_latency_s)
                if seq.request_id in measured.predictions:
                    measured.predicted_ttft_s.append(measured.predictions.pop(seq.request_id))
                    measured.actual_ttft_s.append(measured.ttft_s[-1])
            if seq.is_finished:
                self.unfinished -= 1
                measured.e2e_s.append(seq.last_token_time - seq.arrival_time)
                measured.tbt_s.extend(seq.tbt_s)
                rep.finished.append((seq.num_prompt_tokens, seq.num_output_tokens))
        self._start_step(k, rep)

    def _arrive(self, request_id: str, request: SimRequest) -> None:
        """A request arrives: the router places it on a serving replica, whose scheduler holds
        it at once."""
        serving = [k for k, rep in enumerate(self.fleet) if rep.serving(self.now)]
        client_max = request.output_len if self.length_oracle else \
            (self.client_max_tokens or self.max_model_len - request.input_len)
        tokens, cached = self.prefixes.prompt(request, len(self.fleet), serving)
        choice = self.router.choose([self.loads[k] for k in serving], request.input_len, client_max, cached)
        self.router.placed(choice, self.now, self.now)
        k = serving[choice]
        self.loads[k].add(request.input_len)
        rep = self.fleet[k]
        rep.served += 1
        seq = Sequence(request_id, tokens, SamplingParams(max_tokens=request.output_len, ignore_eos=True),
                       arrival_time=self.now)
        rep.scheduler.add(seq)
        self.unfinished += 1
        if isinstance(self.router, PredictiveRouter):
            # The router forecasts the engine's part; the client sees the request's way too.
            self.measured.predictions[request_id] = self.router.last.ttft_s + rep.sim.request_latency_s
            if self.autoscaler is not None:
                self._scale_up()
        if rep.step is None:
            self._start_step(k, rep)

    def _start_step(self, k: int, rep: _Replica) -> None:
        rep.step = None
        if not rep.scheduler.has_unfinished:
            rep.idle_since = self.now
            return
        out = rep.scheduler.schedule()
        if out.is_empty:
            raise ConfigError("a replica can place no work: its KV cache cannot hold the waiting requests")
        samples = out.all_samples()
        cost = rep.sim.step_model.step(rep.sim.describe_step(out), sampled=samples.count(True),
                                       seqs=len(out.all_seqs))
        rep.step, rep.step_start = out, self.now
        rep.step_sample = step_sample(out, num_layers=self.model.num_layers)
        heapq.heappush(self.steps_in_flight, (self.now + cost.seconds, k))

    def _result(self, num_requests: int, rate: float, duration_s: float, first_event: int,
                wall_s: float) -> ClusterResult:
        measured = self.measured
        predictive = isinstance(self.router, PredictiveRouter)
        return ClusterResult(
            router=self.router.name, rate=rate, num_requests=num_requests, duration_s=duration_s,
            ttft_s=np.frombuffer(measured.ttft_s), e2e_s=np.frombuffer(measured.e2e_s),
            tbt_s=np.frombuffer(measured.tbt_s), predicted_ttft_s=np.frombuffer(measured.predicted_ttft_s),
            actual_ttft_s=np.frombuffer(measured.actual_ttft_s),
            per_replica=[rep.served for rep in self.fleet],
            preemptions=sum(rep.scheduler.num_preemptions for rep in self.fleet),
            decision_p99_s=self.router.decision_p99_s() if predictive else 0.0,
            scale_events=self.autoscaler.events[first_event:] if self.autoscaler is not None else [],
            waiting_trace=measured.waiting_trace, wall_s=wall_s,
            prefix_queries=sum(rep.scheduler.block_manager.prefix.queries for rep in self.fleet if self.prefixes.caching),
            prefix_hits=sum(rep.scheduler.block_manager.prefix.hits for rep in self.fleet if self.prefixes.caching))

    # -- autoscaling ----------------------------------------------------------------------------
    def _scale_up(self) -> None:
        """The autoscaler may start a replica on the last prediction; it serves after
        `start_delay_s`."""
        starting = sum(not rep.serving(self.now) for rep in self.fleet)
        waiting = max((len(rep.scheduler.waiting) for rep in self.fleet if rep.serving(self.now)), default=0)
        if self.autoscaler.should_add(self.router.last.ttft_s, len(self.fleet), starting, self.now, waiting):
            rep = self._replica(len(self.fleet))
            rep.ready_at = rep.idle_since = self.now + self.start_delay_s
            self.fleet.append(rep)
            self.loads.append(snapshot(rep.scheduler, self.now).load())

    def _retire(self) -> None:
        if self.autoscaler is None or len(self.fleet) <= 1:
            return
        newest = self.fleet[-1]
        idle = newest.step is None and not newest.scheduler.has_unfinished and newest.serving(self.now)
        if idle and self.autoscaler.should_retire(len(self.fleet), self.now - newest.idle_since, self.now):
            self.fleet.pop()
            self.loads.pop()
            self.router.forget(len(self.fleet))
            self.prefixes.index.forget(len(self.fleet))
