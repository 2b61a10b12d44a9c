"""Discrete-event simulation of one colocated engine: the real `Scheduler` (not a copy) forms
every step, and the planner's step model prices it instead of running a model.

Requests enter the scheduler when the virtual clock passes their arrival (between steps, as
in the engine's loop); each step's duration advances the clock, and the scheduler stamps
tokens with it, so TTFT and every time between tokens come from the same code that stamps
them in the engine. Per layer, the step's tokens activate a number of distinct experts
drawn from the routing model (`expert_load`), so expert-weight bytes follow from the
batches the scheduler actually forms.
"""

from __future__ import annotations

import time
from array import array
from dataclasses import dataclass, field

import numpy as np

from megainfer.tools.bench.workload import SimRequest
from megainfer.config import ModelConfig
from megainfer.engine_config import EngineConfig
from megainfer.errors import ConfigError
from megainfer.sampling_params import SamplingParams
from megainfer.scheduling.scheduler import Scheduler
from megainfer.scheduling.scheduler_output import SchedulerOutput
from megainfer.scheduling.sequence import Sequence
from megainfer.scheduling.step_layout import StepLayout
from megainfer.tools.simulator.expert_load import ExpertActivation
from megainfer.tools.simulator.routing_skew import FITTED_RANK_OFFSET, FITTED_SKEW
from planner.step_cost_model import AttentionWork, ColocatedStepModel, LayerClass

_TOKEN = 0  # the simulator's stand-in token id: no model reads it, no stop condition matches it


@dataclass
class SimResult:
    policy: str
    num_requests: int
    duration_s: float  # first arrival to last token
    steps: int
    busy_s: float  # time the instance spent in steps
    ttft_s: np.ndarray
    tbt_s: np.ndarray  # every time between tokens, all requests
    max_tbt_s: np.ndarray  # per request
    input_tokens: int
    output_tokens: int
    expert_bytes: float
    energy_j: float
    preemptions: int
    wall_s: float = 0.0
    extra: dict = field(default_factory=dict)
    finished_at_s: np.ndarray = field(default_factory=lambda: np.zeros(0))  # each request's end, from the first arrival
    arrived_at_s: np.ndarray = field(default_factory=lambda: np.zeros(0))  # each request's arrival, from the first

    def offered_rate(self) -> float:
        """This run's arrivals per second, first to last (not the nominal rate: 300 Poisson
        arrivals stray from it by ~6%)."""
        n = len(self.arrived_at_s)
        span = float(self.arrived_at_s.max() - self.arrived_at_s.min()) if n > 1 else 0.0
        return (n - 1) / span if span > 0 else 0.0

    def served_rate(self) -> float:
        """Requests per second the instance keeps up with: the offered rate over (1 + the growth of
        the wait, seconds of TTFT per second of arrival time, fitted over the later two thirds of
        the arrivals). A queue that grows at g s/s means the instance serves 1 / (1 + g) of what
        arrives; one that keeps up has g about 0. (Counting completions in a window instead is
        biased in a run of a few minutes: the first requests meet an empty instance and finish
        faster than later ones.)"""
        n = len(self.arrived_at_s)
        order = np.argsort(self.arrived_at_s)[n // 3:]
        if n < 8 or np.ptp(self.arrived_at_s[order]) == 0:  # too few, or all at once (offline)
            return self.offered_rate()
        growth = float(np.polyfit(self.arrived_at_s[order], self.ttft_s[order], 1)[0])
        return self.offered_rate() / (1 + max(growth, 0.0))

    def queue_growth(self) -> float:
        """Mean TTFT of the last quarter of requests to finish over that of the first half: near
        1 where the instance keeps up, growing with the run where a queue builds (saturation)."""
        n = len(self.ttft_s)
        if n < 8:
            return 1.0
        return float(self.ttft_s[3 * n // 4:].mean() / max(self.ttft_s[:n // 2].mean(), 1e-9))

    def slo_attainment(self, ttft_slo_s: float, tbt_slo_s: float) -> float:
        """Fraction of requests whose TTFT and every time between tokens met the SLOs."""
        met = (self.ttft_s <= ttft_slo_s) & (self.max_tbt_s <= tbt_slo_s)
        return float(met.mean())

    def summary(self, ttft_slo_s: float, tbt_slo_s: float) -> dict:
        def pct(a: np.ndarray, q: float) -> float:
            return float(np.percentile(a, q)) if len(a) else 0.0

        return {
            "policy": self.policy,
            "requests": self.num_requests,
            "duration_s": self.duration_s,
            "steps": self.steps,
            "request_throughput": self.num_requests / self.duration_s if self.duration_s else 0.0,
            "served_rate": self.served_rate(),
            "offered_rate": self.offered_rate(),
            "queue_growth": self.queue_growth(),
            "output_throughput": self.output_tokens / self.duration_s if self.duration_s else 0.0,
            "ttft_mean_s": float(self.ttft_s.mean()),
            "ttft_p99_s": pct(self.ttft_s, 99),
            "tbt_mean_s": float(self.tbt_s.mean()) if len(self.tbt_s) else 0.0,
            "tbt_p99_s": pct(self.tbt_s, 99),
            "slo_attainment": self.slo_attainment(ttft_slo_s, tbt_slo_s),
            "expert_bytes": self.expert_bytes,
            "energy_j": self.energy_j,
            "energy_per_output_token_j": self.energy_j / self.output_tokens if self.output_tokens else 0.0,
            "preemptions": self.preemptions,
            "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens,
            "wall_s": self.wall_s,
        }


class Simulator:
    def __init__(self, model: ModelConfig, step_model: ColocatedStepModel, config: EngineConfig, *,
                 expert_skew: float = FITTED_SKEW, expert_rank_offset: float = FITTED_RANK_OFFSET,
                 seed: int = 0) -> None:
        self.model = model
        self.step_model = step_model
        self.config = config
        self.max_model_len = config.resolved_max_model_len(model)
        kv_tokens = step_model.kv_capacity_tokens()
        self.num_blocks = kv_tokens // config.block_size
        self.activation = ExpertActivation(model.num_experts, model.top_k, skew=expert_skew,
                                           rank_offset=expert_rank_offset, seed=seed)
        self.now = 0.0
        # What a client adds to the engine's TTFT (EfficiencyCurves.request_latency_s).
        self.request_latency_s = step_model.curves.request_latency_s

    def run(self, requests: list[SimRequest]) -> SimResult:
        started = time.perf_counter()
        self._check_fits(requests)
        sched = Scheduler.from_config(self.config, num_blocks=self.num_blocks, max_model_len=self.max_model_len,
                                      eos_token_ids=(), num_layers=self.model.num_layers,
                                      window=self.model.kv_window)
        sched.clock = lambda: self.now
        pending = sorted(requests, key=lambda r: r.arrival_s)
        self.now = pending[0].arrival_s if pending else 0.0
        first_arrival = self.now
        nxt = 0
        totals = _Totals()
        while nxt < len(pending) or sched.has_unfinished:
            while nxt < len(pending) and pending[nxt].arrival_s <= self.now:
                r = pending[nxt]
                sched.add(Sequence(f"r{nxt}", [_TOKEN] * r.input_len,
                                   SamplingParams(max_tokens=r.output_len, ignore_eos=True), arrival_time=r.arrival_s))
                nxt += 1
            if not sched.has_unfinished:
                self.now = pending[nxt].arrival_s
                continue
            out = sched.schedule()
            if out.is_empty:
                if nxt < len(pending):  # nothing fits until something arrives
                    self.now = max(self.now, pending[nxt].arrival_s)
                    continue
                raise ConfigError("the scheduler can place no work: the KV cache cannot hold the waiting requests")
            self._run_step(sched, out, totals)
        return SimResult(
            policy=self.config.prefill_policy, num_requests=len(requests), duration_s=self.now - first_arrival,
            steps=totals.steps, busy_s=totals.busy_s, ttft_s=np.frombuffer(totals.ttft_s),
            tbt_s=np.frombuffer(totals.tbt_s), max_tbt_s=np.frombuffer(totals.max_tbt_s),
            input_tokens=sum(r.input_len for r in requests), output_tokens=sum(r.output_len for r in requests),
            expert_bytes=totals.expert_bytes, energy_j=totals.energy_j, preemptions=sched.num_preemptions,
            wall_s=time.perf_counter() - started, finished_at_s=np.frombuffer(totals.finished_at_s) - first_arrival,
            arrived_at_s=np.array([r.arrival_s for r in requests]) - first_arrival)

    def _check_fits(self, requests: list[SimRequest]) -> None:
        """Every request must fit the model's context and the instance's KV cache on its own."""
        for r in requests:
            if r.input_len + r.output_len > self.max_model_len:
                raise ConfigError(f"a request of {r.input_len} + {r.output_len} tokens exceeds the model's context "
                                  f"of {self.max_model_len}")
            if -(-(r.input_len + r.output_len) // self.config.block_size) > self.num_blocks:
                raise ConfigError(f"a request of {r.input_len + r.output_len} tokens needs more KV blocks than "
                                  f"the instance holds ({self.num_blocks})")

    def _run_step(self, sched: Scheduler, out: SchedulerOutput, totals: _Totals) -> None:
        """Price the step, advance the clock by it, and hand the scheduler its stand-in tokens."""
        layout = StepLayout.of(out, 1)
        cost = self.step_model.step(self.describe_step(out, layout), sampled=layout.num_sampled,
                                    seqs=len(out.all_seqs))
        self.now += cost.seconds
        totals.steps += 1
        totals.busy_s += cost.seconds
        totals.expert_bytes += cost.expert_bytes
        totals.energy_j += cost.energy_j
        for seq in sched.update_from_output(out, [_TOKEN if sampled else None for sampled in layout.samples]):
            if seq.is_finished:
                totals.finished_at_s.append(self.now)
                totals.ttft_s.append(seq.first_token_time - seq.arrival_time + self.request_latency_s)
                gaps = seq.tbt_s
                totals.tbt_s.extend(gaps)
                totals.max_tbt_s.append(max(gaps, default=0.0))

    def describe_step(self, out: SchedulerOutput, layout: StepLayout | None = None) -> list[LayerClass]:
        """The step as layer classes: every layer's share (decodes, chunked prefill) and, under
        layered prefill, the cohort's extra work in its layer group. `layout`: the step's
        (m = 1) layout, when the caller has it already. Experts are drawn for the MoE layers
        only: a dense layer (DeepSeek's first `first_k_dense`) routes nothing."""
        layout = layout or StepLayout.of(out, 1)
        layers, dense = self.model.num_layers, self.model.first_k_dense
        tokens = sum(out.num_scheduled_tokens)
        work = attention_work(out.seqs, out.num_scheduled_tokens)
        if not layout.has_cohort:
            return [LayerClass(layers, tokens, work, self.activation.draw(tokens, layers - dense), dense)]
        cohort_tokens = sum(out.layered.num_tokens)
        cohort_work = attention_work(out.layered.seqs, out.layered.num_tokens)
        inside = layout.cohort_group_layers
        dense_inside = max(0, min(layout.cohort_leave_layer, dense) - layout.cohort_join_layer)
        group = LayerClass(inside, tokens + cohort_tokens, work + cohort_work,
                           self.activation.draw(tokens + cohort_tokens, inside - dense_inside), dense_inside)
        rest = LayerClass(layers - inside, tokens, work,
                          self.activation.draw(tokens, layers - inside - (dense - dense_inside)), dense - dense_inside)
        return [group, rest]


def attention_work(seqs: list[Sequence], num_tokens: list[int]) -> AttentionWork:
    """The attention of chunks starting at each sequence's computed prefix."""
    return AttentionWork.of_chunks([(n, seq.num_computed_tokens) for seq, n in zip(seqs, num_tokens)])


@dataclass
class _Totals:
    """What a run adds up, step by step."""

    steps: int = 0  # steps run
    busy_s: float = 0.0  # seconds the instance spent in steps
    expert_bytes: float = 0.0  # expert-weight bytes read
    energy_j: float = 0.0  # joules
    ttft_s: array = field(default_factory=lambda: array("d"))  # per finished request, seconds
    finished_at_s: array = field(default_factory=lambda: array("d"))  # when each finished, on the clock
    tbt_s: array = field(default_factory=lambda: array("d"))  # every time between tokens, seconds
    max_tbt_s: array = field(default_factory=lambda: array("d"))  # per finished request, seconds
