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

from megainfer.config import EngineConfig, ModelConfig
from megainfer.errors import ConfigError
from megainfer.routing.autoscale import Autoscaler
from megainfer.routing.node_state import NodeState, StepSample
from megainfer.routing.policies import NodeLoad, PredictiveRouter, Router
from megainfer.sampling_params import SamplingParams
from megainfer.scheduler import Scheduler, SchedulerOutput
from megainfer.sequence import Sequence
from megainfer.simulator.sim import Simulator
from megainfer.simulator.workload import SimRequest
from planner.step_time import ColocatedStepModel

_TOKEN = 0


@dataclass
class ClusterResult:
    router: str
    rate: float
    num_requests: int
    duration_s: float
    ttft_s: np.ndarray
    e2e_s: np.ndarray
    tbt_s: np.ndarray
    predicted_ttft_s: np.ndarray  # predictive only: the prediction for each request, arrival order
    actual_ttft_s: np.ndarray  # the same requests' simulated TTFT
    per_replica: list[int]  # requests each replica served
    preemptions: int = 0
    decision_p99_s: float = 0.0
    scale_events: list[dict] = field(default_factory=list)
    waiting_trace: list[tuple[float, int]] = field(default_factory=list)  # (time, longest queue) at snapshots
    wall_s: float = 0.0

    def summary(self) -> dict:
        def pct(a: np.ndarray, q: float) -> float:
            return float(np.percentile(a, q)) if len(a) else 0.0

        err = np.abs(self.predicted_ttft_s - self.actual_ttft_s)
        return {"router": self.router, "rate": self.rate, "requests": self.num_requests,
                "duration_s": self.duration_s,
                "ttft_mean_s": float(self.ttft_s.mean()), "ttft_p50_s": pct(self.ttft_s, 50),
                "ttft_p99_s": pct(self.ttft_s, 99), "e2e_mean_s": float(self.e2e_s.mean()),
                "e2e_p99_s": pct(self.e2e_s, 99), "tbt_p99_s": pct(self.tbt_s, 99),
                "prediction_mae_s": float(err.mean()) if len(err) else None,
                "prediction_bias_s": float((self.predicted_ttft_s - self.actual_ttft_s).mean()) if len(err) else None,
                "preemptions": self.preemptions, "decision_p99_ms": self.decision_p99_s * 1e3, "per_replica": self.per_replica,
                "scale_events": self.scale_events, "wall_s": self.wall_s}


class _Replica:
    def __init__(self, sim: Simulator, clock) -> None:
        self.sim = sim
        self.sched = Scheduler.from_config(sim.config, num_blocks=sim.num_blocks, max_model_len=sim.max_model_len,
                                           eos_token_ids=(), num_layers=sim.model.num_layers)
        self.sched.clock = clock
        self.step: SchedulerOutput | None = None  # in flight
        self.step_sample: StepSample | None = None
        self.step_start = 0.0
        self.steps: list[StepSample] = []  # measured since the last snapshot
        self.finished: list[tuple[int, int]] = []
        self.served = 0
        self.ready_at = 0.0
        self.idle_since = 0.0


class ClusterSimulator:
    def __init__(self, model: ModelConfig, step_model: ColocatedStepModel | list[ColocatedStepModel],
                 config: EngineConfig, replicas: int,
                 router: Router, *, snapshot_s: float = 0.05, expert_skew: float = 0.0, seed: int = 0,
                 client_max_tokens: int | None = None, length_oracle: bool = False,
                 autoscaler: Autoscaler | None = None, start_delay_s: float = 30.0) -> None:
        if replicas < 1:
            raise ConfigError(f"--replicas must be at least 1, got {replicas}")
        # A heterogeneous fleet: replica k runs on step_models[k % len] (its GPU type).
        self.step_models = step_model if isinstance(step_model, list) else [step_model]
        self.model, self.config = model, config
        self.router = router
        self.snapshot_s = snapshot_s
        self.expert_skew, self.seed = expert_skew, seed
        self.client_max_tokens = client_max_tokens
        self.length_oracle = length_oracle
        self.autoscaler = autoscaler
        self.start_delay_s = start_delay_s
        self.initial = autoscaler.policy.min_replicas if autoscaler else replicas
        self.now = 0.0

    def _replica(self, k: int) -> _Replica:
        step_model = self.step_models[k % len(self.step_models)]
        return _Replica(Simulator(self.model, step_model, self.config, expert_skew=self.expert_skew,
                                  seed=self.seed + 7919 * k), lambda: self.now)

    def run(self, requests: list[SimRequest], rate: float = 0.0) -> ClusterResult:
        started = time.perf_counter()
        if isinstance(self.router, PredictiveRouter):
            self.router.clock = lambda: self.now  # predictions on the simulated clock
        reps = [self._replica(k) for k in range(self.initial)]
        max_len = reps[0].sim.max_model_len
        for r in requests:
            if r.input_len + r.output_len > max_len:
                raise ConfigError(f"a request of {r.input_len} + {r.output_len} tokens exceeds the model's context "
                                  f"of {max_len}")
        pending = sorted(requests, key=lambda r: r.arrival_s)
        self.now = pending[0].arrival_s if pending else 0.0
        first = self.now
        steps: list[tuple[float, int]] = []  # (end time, replica) of steps in flight
        loads = [NodeLoad(**NodeState.of(r.sched, self.now).load()) for r in reps]
        next_snap = self.now
        predicted: dict[str, float] = {}
        ttft, e2e, tbt = array("d"), array("d"), array("d")
        pred_ttft, act_ttft = array("d"), array("d")
        events: list[dict] = []
        waiting_trace: list[tuple[float, int]] = []
        nxt = 0
        unfinished = 0
        while nxt < len(pending) or unfinished:
            t_arr = pending[nxt].arrival_s if nxt < len(pending) else float("inf")
            t_step = steps[0][0] if steps else float("inf")
            if next_snap <= min(t_arr, t_step):
                self.now = next_snap
                for k, rep in enumerate(reps):
                    if rep.ready_at > self.now:
                        continue
                    state = NodeState.of(rep.sched, self.now, rep.steps, rep.finished)
                    rep.steps, rep.finished = [], []
                    loads[k] = NodeLoad(**state.load())
                    self.router.observe(k, state, self.now)
                waiting_trace.append((self.now, max(len(rep.sched.waiting) for rep in reps)))
                self._retire(reps, loads, events)
                next_snap += self.snapshot_s
                continue
            if t_step <= t_arr:
                self.now, k = heapq.heappop(steps)
                rep = reps[k]
                out = rep.step
                rep.steps.append(StepSample(**{**rep.step_sample.__dict__, "seconds": self.now - rep.step_start}))
                for seq in rep.sched.update_from_output(out, [_TOKEN if s else None for s in out.all_samples()]):
                    if seq.num_output_tokens == 1:
                        ttft.append(seq.first_token_time - seq.arrival_time)
                        if seq.request_id in predicted:
                            pred_ttft.append(predicted.pop(seq.request_id))
                            act_ttft.append(ttft[-1])
                    if seq.is_finished:
                        unfinished -= 1
                        e2e.append(seq.last_token_time - seq.arrival_time)
                        tbt.extend(seq.tbt_s)
                        rep.finished.append((seq.num_prompt_tokens, seq.num_output_tokens))
                self._start_step(k, rep, steps)
                continue
            self.now = t_arr
            r = pending[nxt]
            rid = f"r{nxt}"
            nxt += 1
            serving = [k for k, rep in enumerate(reps) if rep.ready_at <= self.now]
            client_max = r.output_len if self.length_oracle else \
                (self.client_max_tokens or max_len - r.input_len)
            choice = self.router.choose([loads[j] for j in serving], r.input_len, client_max)
            self.router.placed(choice, self.now, self.now)  # the replica's scheduler holds it at once
            k = serving[choice]
            loads[k].add(r.input_len)
            rep = reps[k]
            rep.served += 1
            seq = Sequence(rid, [_TOKEN] * r.input_len, SamplingParams(max_tokens=r.output_len, ignore_eos=True),
                           arrival_time=self.now)
            rep.sched.add(seq)
            unfinished += 1
            if isinstance(self.router, PredictiveRouter):
                predicted[rid] = self.router.last.ttft_s
                if self.autoscaler is not None:
                    self._scale_up(reps, loads, events)
            if rep.step is None:
                self._start_step(k, rep, steps)
        return ClusterResult(
            router=self.router.name, rate=rate, num_requests=len(requests), duration_s=self.now - first,
            ttft_s=np.frombuffer(ttft), e2e_s=np.frombuffer(e2e), tbt_s=np.frombuffer(tbt),
            predicted_ttft_s=np.frombuffer(pred_ttft), actual_ttft_s=np.frombuffer(act_ttft),
            per_replica=[rep.served for rep in reps], preemptions=sum(rep.sched.num_preemptions for rep in reps),
            decision_p99_s=self.router.decision_p99_s() if isinstance(self.router, PredictiveRouter) else 0.0,
            scale_events=events, waiting_trace=waiting_trace, wall_s=time.perf_counter() - started)

    def _start_step(self, k: int, rep: _Replica, steps: list) -> None:
        rep.step = None
        if not rep.sched.has_unfinished:
            rep.idle_since = self.now
            return
        out = rep.sched.schedule()
        if out.is_empty:
            raise ConfigError("a replica can place no work: its KV cache cannot hold the waiting requests")
        samples = out.all_samples()
        cost = rep.sim.step_model.step(rep.sim.describe_step(out), samples.count(True))
        rep.step, rep.step_start = out, self.now
        rep.step_sample = StepSample.of(out, num_layers=self.model.num_layers)
        heapq.heappush(steps, (self.now + cost.seconds, k))

    # -- autoscaling ----------------------------------------------------------------------------
    def _scale_up(self, reps: list[_Replica], loads: list[NodeLoad], events: list[dict]) -> None:
        starting = sum(rep.ready_at > self.now for rep in reps)
        if self.autoscaler.should_add(self.router.last.ttft_s, len(reps), starting, self.now):
            waiting = [len(rep.sched.waiting) for rep in reps if rep.ready_at <= self.now]
            rep = self._replica(len(reps))
            rep.ready_at = rep.idle_since = self.now + self.start_delay_s
            reps.append(rep)
            loads.append(NodeLoad(**NodeState.of(rep.sched, self.now).load()))
            events.append({"time_s": self.now, "action": "add", "replicas": len(reps),
                           "predicted_ttft_s": self.router.last.ttft_s, "max_waiting": max(waiting, default=0)})

    def _retire(self, reps: list[_Replica], loads: list[NodeLoad], events: list[dict]) -> None:
        if self.autoscaler is None or len(reps) <= 1:
            return
        newest = reps[-1]
        idle = newest.step is None and not newest.sched.has_unfinished and newest.ready_at <= self.now
        if idle and self.autoscaler.should_retire(len(reps), self.now - newest.idle_since, self.now):
            reps.pop()
            loads.pop()
            self.router.forget(len(reps))
            events.append({"time_s": self.now, "action": "retire", "replicas": len(reps)})
