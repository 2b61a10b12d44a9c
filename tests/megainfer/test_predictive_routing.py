"""The predictive router's parts: the length estimator, the online step model, forecasts
(checked against the real scheduler stepping with the newcomer added), decisions and their
latency, attention balancing, the autoscaler's decisions, and the fleet simulation."""

from __future__ import annotations

import copy
import dataclasses
import json
import subprocess
import sys

import numpy as np
import pytest

from megainfer.engine_config import EngineConfig
from megainfer.errors import PlanError
from megainfer.messages import NodeLoad, StepSample
from megainfer.plan import Plan
from megainfer.presets import PRESETS
from megainfer.routing.autoscale import AutoscalePolicy, Autoscaler, ScaleAction
from megainfer.routing.forecast import NodeForecast, RequestForecast
from megainfer.routing.length_estimator import BucketedLengthEstimator, MaxTokensEstimator
from megainfer.routing.online_step_model import OnlineStepModel, StepTimeBalancer
from megainfer.routing.policies import PredictiveRouter, make_router
from megainfer.sampling_params import SamplingParams
from megainfer.scheduling.kv_cache import BlockManager
from megainfer.scheduling.node_state import snapshot, step_sample
from megainfer.scheduling.scheduler import ChunkedPrefill, Scheduler
from megainfer.scheduling.sequence import Sequence

TRUTH = (0.004, 2e-5, 1e-4, 1e-7, 1e-9)  # a step's seconds: fixed, per token, per seq, per KV token, per pair


def truth_seconds(s: StepSample) -> float:
    return TRUTH[0] + TRUTH[1] * s.tokens + TRUTH[2] * s.seqs + TRUTH[3] * s.kv_tokens + TRUTH[4] * s.score_pairs


def calibrated() -> OnlineStepModel:
    m = OnlineStepModel(TRUTH)
    m.fit()
    return m


def scheduler(num_blocks: int = 400, budget: int = 64, max_num_seqs: int = 32, clock=lambda: 0.0) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, 16), ChunkedPrefill(), max_num_seqs=max_num_seqs,
                     max_num_batched_tokens=budget, max_model_len=4096, clock=clock)


def add(sched: Scheduler, rid: str, prompt: int, output: int, arrival: float = 0.0) -> Sequence:
    seq = Sequence(rid, [0] * prompt, SamplingParams(max_tokens=output, ignore_eos=True), arrival_time=arrival)
    sched.add(seq)
    return seq


def run_steps(sched: Scheduler, clock: list[float], until=lambda: False, limit: int = 10_000) -> None:
    """Step the scheduler, advancing `clock[0]` by the true step time of each step."""
    for _ in range(limit):
        if not sched.has_unfinished or until():
            return
        out = sched.schedule()
        clock[0] += truth_seconds(step_sample(out))
        sched.update_from_output(out, [0 if s else None for s in out.all_samples()])


# -- length estimator -------------------------------------------------------------------------------
def test_bucketed_estimator_learns_per_prompt_length_and_conditions_on_progress():
    est = BucketedLengthEstimator(prior=100, min_samples=4)
    assert est.estimate(50, 0, 1000) == 100  # the prior before anything finished
    assert est.estimate(50, 0, 40) == 40  # never above max_tokens
    for out in (10, 20, 30, 40):
        est.observe(50, out)  # short prompts: short answers
    for out in (400, 500, 600, 700):
        est.observe(3000, out)  # long prompts: long answers
    assert est.estimate(60, 0, 10_000) == 25  # the mean of its bucket (32..63)
    assert est.estimate(2500, 0, 10_000) == 550
    assert est.estimate(60, 25, 10_000) == 35  # already past 25 tokens: the mean of the longer ones
    assert est.estimate(60, 80, 10_000) == 120  # past everything seen: half again
    assert est.estimate(200, 0, 10_000) == 25  # an empty bucket borrows the nearest with data
    assert MaxTokensEstimator().estimate(60, 5, 77) == 77


# -- online step model ------------------------------------------------------------------------------
def test_online_step_model_recovers_step_times_from_measured_steps():
    rng = np.random.default_rng(0)
    model = OnlineStepModel()
    samples = []
    for _ in range(300):
        tokens, seqs = int(rng.integers(1, 512)), int(rng.integers(1, 64))
        kv = float(rng.integers(seqs, 50_000))
        pairs = kv + float(rng.integers(0, 200_000))
        s = StepSample(tokens, seqs, kv, pairs)
        samples.append(StepSample(tokens, seqs, kv, pairs, truth_seconds(s)))
    model.observe(samples)
    assert model.num_samples == 300 and (model.coef >= 0).all()
    errors = [abs(model.predict(s) - s.seconds) / s.seconds for s in samples]
    assert np.mean(errors) < 0.02
    # Collinear features (decode-only steps: tokens == seqs, pairs == kv) never go negative.
    decode = OnlineStepModel()
    decode.observe([StepSample(n, n, 100.0 * n, 100.0 * n, 0.003 + 1e-4 * n) for n in range(1, 200)])
    assert (decode.coef >= 0).all() and decode.predict(StepSample(50, 50, 5000, 5000)) == pytest.approx(0.008, 0.05)


def test_online_step_model_leaves_out_noise_steps():
    rng = np.random.default_rng(1)
    samples = []
    for i in range(200):
        s = StepSample(int(rng.integers(1, 512)), int(rng.integers(1, 64)), float(rng.integers(64, 50_000)), 0.0)
        slow = 40.0 if i % 50 == 7 else 1.0  # four steps descheduled for a long while
        samples.append(StepSample(s.tokens, s.seqs, s.kv_tokens, 0.0, slow * truth_seconds(s)))
    model = OnlineStepModel()
    model.observe(samples)
    errors = [abs(model.predict(s) - truth_seconds(s)) / truth_seconds(s) for s in samples]
    assert np.median(errors) < 0.03


# -- forecasts against the real scheduler -------------------------------------------------------------
def busy_node(clock) -> Scheduler:
    sched = scheduler(clock=lambda: clock[0])
    for i in range(6):
        add(sched, f"d{i}", 40, 30)
    run_steps(sched, clock, limit=8)  # some decoding, some still prefilling
    for i in range(4):
        add(sched, f"w{i}", 90, 12, arrival=clock[0])  # queued behind them
    return sched


@pytest.mark.parametrize("prompt, output", [(20, 5), (150, 20), (700, 3)])
def test_forecast_predicts_what_the_scheduler_then_does(prompt, output):
    clock = [0.0]
    sched = busy_node(clock)
    state = snapshot(sched, clock[0])
    forecast = NodeForecast.build(state, calibrated(), MaxTokensEstimator())
    ttft, e2e = forecast.predict(clock[0], prompt, output)
    # The truth: the same scheduler with the newcomer at the back of its queue, stepped on.
    arrived = clock[0]
    new = add(sched, "new", prompt, output, arrival=arrived)
    run_steps(sched, clock, until=lambda: new.is_finished)
    true_ttft, true_e2e = new.first_token_time - arrived, new.last_token_time - arrived
    step = truth_seconds(StepSample(64, 10, 1000, 1000))
    assert ttft == pytest.approx(true_ttft, abs=1.5 * step)
    assert e2e == pytest.approx(true_e2e, abs=2 * step + 0.05 * true_e2e)


def test_forecast_of_an_idle_node_and_past_the_horizon():
    model = calibrated()
    idle = NodeForecast.build(snapshot(scheduler(), 5.0), model, MaxTokensEstimator())
    ttft, _ = idle.predict(7.0, 128, 4)  # two chunks of 64 on an empty node
    assert ttft == pytest.approx(2 * model.seconds(64, 1, 64, 64 * 65 / 2), rel=0.3)
    clock = [0.0]
    sched = busy_node(clock)
    short = NodeForecast.build(snapshot(sched, clock[0]), model, MaxTokensEstimator(), horizon=3)
    full = NodeForecast.build(snapshot(sched, clock[0]), model, MaxTokensEstimator())
    # Extrapolation past a short horizon stays in the same range as the full forecast.
    assert short.predict(clock[0], 300, 5)[0] == pytest.approx(full.predict(clock[0], 300, 5)[0], rel=0.5)


@pytest.mark.parametrize("busy", [False, True])
def test_forecast_prices_a_long_prompt_chunk_by_chunk_past_the_horizon(busy):
    """Each chunk of a long prompt reads the prefix before it: the tail prices that too."""
    heavy = (0.004, 2e-5, 1e-4, 2e-6, 2e-8)  # attention over the prefix matters
    clock = [0.0]
    sched = busy_node(clock) if busy else scheduler(clock=lambda: clock[0])
    model = OnlineStepModel(heavy)
    forecast = NodeForecast.build(snapshot(sched, clock[0]), model, MaxTokensEstimator(), horizon=2)
    ttft, _ = forecast.predict(clock[0], 1500, 2)
    arrived = clock[0]
    new = add(sched, "long", 1500, 2, arrival=arrived)
    for _ in range(10_000):
        if new.num_output_tokens:
            break
        out = sched.schedule()
        clock[0] += model.predict(step_sample(out))
        sched.update_from_output(out, [0 if s else None for s in out.all_samples()])
    true_ttft = new.first_token_time - arrived
    assert ttft == pytest.approx(true_ttft, rel=0.15)


def test_forecast_waits_for_kv_rather_than_predicting_a_preempted_start():
    model = calibrated()
    clock = [0.0]
    tight = scheduler(num_blocks=30, clock=lambda: clock[0])  # 480 tokens of KV
    for i in range(4):
        add(tight, f"d{i}", 80, 60)
    run_steps(tight, clock, limit=10)
    roomy = scheduler(num_blocks=400, clock=lambda: clock[0])
    for i in range(4):
        add(roomy, f"d{i}", 80, 60)
    run_steps(roomy, [0.0], limit=10)
    f_tight = NodeForecast.build(snapshot(tight, clock[0]), model, MaxTokensEstimator())
    f_roomy = NodeForecast.build(snapshot(roomy, clock[0]), model, MaxTokensEstimator())
    t_tight, _ = f_tight.predict(clock[0], 150, 20)
    t_roomy, _ = f_roomy.predict(clock[0], 150, 20)
    assert t_tight > 3 * t_roomy  # it can only start once the decodes free their blocks


def test_commit_makes_the_next_request_wait_for_the_first():
    forecast = NodeForecast.build(snapshot(scheduler(), 0.0), calibrated(), MaxTokensEstimator())
    first, _ = forecast.predict(0.0, 256, 10)
    forecast.commit(0.0, 256, 10)
    second, _ = forecast.predict(0.0, 256, 10)
    assert second > 1.8 * first  # its four chunks come after the first's four


# -- the router -----------------------------------------------------------------------------------
def predictive(nodes: list[Scheduler], now: float = 0.0) -> PredictiveRouter:
    router = PredictiveRouter(MaxTokensEstimator(), clock=lambda: now, step_prior=TRUTH)
    for i, sched in enumerate(nodes):
        router.observe(i, snapshot(sched, now), now)
    return router


def test_predictive_routes_to_the_lowest_predicted_ttft_and_remembers_what_it_routed():
    clock = [0.0]
    busy, idle = busy_node(clock), scheduler()
    router = predictive([busy, idle], clock[0])
    loads = [NodeLoad(6400), NodeLoad(6400)]
    assert router.choose(loads, 100, 10) == 1
    assert router.last.node == 1 and 0 < router.last.ttft_s < router.predict(0, 100, 10, clock[0])[0]
    picks = [router.choose(loads, 300, 10) for _ in range(8)]
    assert picks.count(0) >= 1 and picks.count(1) >= 1  # the idle node fills up until it is the busier
    # A snapshot taken before those decisions keeps them (replayed onto the new forecast).
    before = router.predict(1, 100, 10, clock[0])[0]
    router.observe(1, snapshot(idle, clock[0]), clock[0])
    assert router.predict(1, 100, 10, clock[0])[0] == pytest.approx(before, rel=0.2)


def test_lockstep_nodes_share_one_step_model_and_one_timeline():
    """A disaggregated replica's attention nodes run every step together: the router fits one
    model on their work added up step by step, and a request on one node slows the other's."""
    router = PredictiveRouter(MaxTokensEstimator(), clock=lambda: 0.0)
    work = {0: [(100, 2), (64, 1)], 1: [(8, 8), (64, 4)], 2: [(3, 3), None]}  # per step: node 0, node 1
    rng = np.random.default_rng(0)
    for round_ in range(40):
        reports: list[list[StepSample]] = [[], []]
        for k in range(3):
            step = 3 * round_ + k
            per_node = [w for w in work[k] if w is not None]
            seconds = TRUTH[0] + sum(TRUTH[1] * t + TRUTH[2] * q for t, q in per_node) * rng.uniform(0.98, 1.02)
            for node, w in enumerate(work[k]):
                if w is not None:
                    reports[node].append(StepSample(w[0], w[1], 0.0, 0.0, seconds, step))
        done = 3 * round_ + 3
        # Node 1 reports its last step late: that step waits for it before the model sees it.
        states = [snapshot(scheduler(), 0.0, reports[0], steps_done=done),
                  snapshot(scheduler(), 0.0, reports[1][:-1], steps_done=done - 1)]
        router.observe_lockstep(0, states, 0.0)
        router._unmatched[0].setdefault(done - 1, []).append(reports[1][-1])
    model = router.models[0]
    assert router.models[1] is model and model.num_samples == 3 * 40 - 1
    both = TRUTH[0] + TRUTH[1] * 164 + TRUTH[2] * 3
    assert model.seconds(164, 3, 0, 0) == pytest.approx(both, rel=0.05)  # the sums, not either node's part

    clock = [0.0]
    busy = busy_node(clock)
    heavy = (0.004, 4e-4, 1e-4, 1e-7, 1e-9)  # prompt tokens dominate a step
    router = PredictiveRouter(MaxTokensEstimator(), clock=lambda: clock[0], step_prior=heavy)
    router.observe_lockstep(0, [snapshot(busy, clock[0]), snapshot(scheduler(), clock[0])], clock[0])
    alone = NodeForecast.build(snapshot(scheduler(), clock[0]), OnlineStepModel(heavy), MaxTokensEstimator())
    beside_busy, _ = router.predict(1, 60, 5, clock[0])
    assert beside_busy > 1.5 * alone.predict(clock[0], 60, 5)[0]  # its steps carry the busy node's prompts
    before = router.predict(0, 20, 5, clock[0])[0]
    assert router.choose([NodeLoad(6400), NodeLoad(6400)], 60, 5) == 1
    assert router.predict(0, 20, 5, clock[0])[0] > before  # node 1's prefill lengthens node 0's steps


SIDE_BY_SIDE = (0.004, 5e-5, 1e-4, 0.0, 0.0, 2e-4, 0.0, 0.0)  # the experts add the nodes' tokens up, attention waits on the busiest


def side_by_side_seconds(rows: list[tuple[int, int]]) -> float:
    """A lockstep step of nodes doing (tokens, seqs) each."""
    c = SIDE_BY_SIDE
    return c[0] + sum(c[1] * t + c[2] * q for t, q in rows) + c[5] * max(t for t, _ in rows)


def run_lockstep(nodes: list[Scheduler], clock: list[float], watch: Sequence) -> float:
    """Step nodes together under the side-by-side truth until `watch` has its first token."""
    for _ in range(10_000):
        outs = [n.schedule() if n.has_unfinished else None for n in nodes]
        rows = [(o.total_tokens, len(o.seqs)) for o in outs if o is not None and not o.is_empty]
        clock[0] += side_by_side_seconds(rows)
        for n, o in zip(nodes, outs):
            if o is not None:
                n.update_from_output(o, [0 if s else None for s in o.all_samples()])
        if watch.num_tokens > watch.num_prompt_tokens:
            return clock[0]
    raise AssertionError("the watched request never got its first token")


def test_lockstep_fit_tells_the_busiest_nodes_share_from_the_sum():
    """Attention nodes compute their halves side by side and the experts compute every token:
    fitted on lockstep steps, the model learns both, and a node alone costs their sum."""
    model = OnlineStepModel()
    rng = np.random.default_rng(1)
    samples = []
    for step in range(300):
        rows = [(int(t), int(rng.integers(1, 8))) for t in rng.integers(1, 256, size=2)]
        if step % 3 == 0:
            rows = rows[:1]  # one node idle in this step
        per_node = [StepSample(t, q, 0.0, 0.0, 0.0, step) for t, q in rows]
        seconds = side_by_side_seconds(rows) * rng.uniform(0.98, 1.02)
        samples.append(dataclasses.replace(StepSample.lockstep(per_node), seconds=seconds))
    model.observe(samples)
    c = model.describe()
    assert c["peak_tokens"] > 2 * c["tokens"]  # the busiest node's tokens, not all of them, set the pace
    for rows in ([(128, 1), (128, 1)], [(256, 1)], [(200, 4), (20, 2)], [(5, 5), (240, 1)]):
        step = StepSample.lockstep([StepSample(t, q, 0.0, 0.0) for t, q in rows])
        assert model.predict(step) == pytest.approx(side_by_side_seconds(rows), rel=0.05)
    assert model.seconds(100, 1, 0, 0) == pytest.approx(side_by_side_seconds([(100, 1)]), rel=0.05)


def test_lockstep_prompt_goes_beside_the_other_nodes_prompt_when_attention_runs_side_by_side():
    """A long prompt arrives while node 0 prefills another. Queued behind it on node 0 it
    waits for the whole of it; beside it on node 1 both share steps that cost far less than two
    steps. The forecast prices both as the lockstep nodes then run, and the router takes node 1;
    under a model where the nodes' work only adds up, the two would look alike."""
    clock = [0.0]
    nodes = [scheduler(budget=128, clock=lambda: clock[0]), scheduler(budget=128, clock=lambda: clock[0])]
    add(nodes[0], "long0", 1024, 2)
    for _ in range(2):  # two chunks in
        out = nodes[0].schedule()
        clock[0] += side_by_side_seconds([(out.total_tokens, len(out.seqs))])
        nodes[0].update_from_output(out, [0 if s else None for s in out.all_samples()])
    now = clock[0]
    router = PredictiveRouter(MaxTokensEstimator(), clock=lambda: now, step_prior=SIDE_BY_SIDE)
    router.observe_lockstep(0, [snapshot(n, now) for n in nodes], now)
    predicted = [router.predict(i, 1024, 2, now)[0] for i in range(2)]
    measured = []
    for target in range(2):
        trial = [copy.deepcopy(n) for n in nodes]
        t = [now]
        for n in trial:
            n.clock = lambda: t[0]
        newcomer = add(trial[target], "long1", 1024, 2, arrival=now)
        measured.append(run_lockstep(trial, t, newcomer) - now)
    assert measured[1] < 0.75 * measured[0]  # beside is better
    for p, m in zip(predicted, measured):
        assert p == pytest.approx(m, rel=0.1)
    assert router.choose([NodeLoad(6400), NodeLoad(6400)], 1024, 2) == 1
    summed = PredictiveRouter(MaxTokensEstimator(), clock=lambda: now,
                              step_prior=(0.004, 2.5e-4, 1e-4, 0.0, 0.0))  # a node alone priced the same
    summed.observe_lockstep(0, [snapshot(n, now) for n in nodes], now)
    assert summed.predict(1, 1024, 2, now)[0] > 1.3 * measured[1]


def test_a_request_on_its_way_stays_in_the_forecast_until_a_snapshot_holds_it():
    """A snapshot asked for after a request was routed but answered before the request reached
    the node's scheduler does not hold it: the router keeps it on the forecast until told it
    arrived before a snapshot was asked for."""
    clock = [0.0]
    nodes = [scheduler(budget=128), scheduler(budget=128)]
    router = PredictiveRouter(MaxTokensEstimator(), clock=lambda: clock[0], step_prior=SIDE_BY_SIDE)
    router.observe_lockstep(0, [snapshot(n, 0.0) for n in nodes], 0.0)
    loads = [NodeLoad(6400), NodeLoad(6400)]
    first = router.choose(loads, 1024, 2)
    routed_at = router.last.at
    clock[0] = 0.01
    router.observe_lockstep(0, [snapshot(n, 0.01) for n in nodes], 0.01)  # the request is still on its way
    assert router.choose(loads, 1024, 2) == 1 - first  # not queued behind the first
    router.placed(first, routed_at, 0.012)
    router.placed(1 - first, router.last.at, None)  # the second was refused by its node
    add(nodes[first], "first", 1024, 2)
    clock[0] = 0.02
    router.observe_lockstep(0, [snapshot(n, 0.02) for n in nodes], 0.02)  # holds the first
    assert router._routed == [[], []]
    assert router.predict(first, 1024, 2, 0.02)[0] > 1.5 * router.predict(1 - first, 1024, 2, 0.02)[0]


def test_predictive_learns_the_latency_its_forecasts_cannot_see():
    clock = [0.0]
    router = predictive([busy_node(clock), scheduler()], clock[0])
    loads = [NodeLoad(6400), NodeLoad(6400)]
    first = router.choose(loads, 100, 10)
    raw = router.last.ttft_s
    for _ in range(200):  # every first token arrives 30 ms later than forecast
        router.observe_ttft(router.last.ttft_s, router.predict(first, 100, 10, clock[0])[0] + 0.03)
        predicted = router.predict(first, 100, 10, clock[0])[0] + router.ttft_offset_s
        router.last = RequestForecast(first, predicted, 0.0, 10)
    assert router.ttft_offset_s == pytest.approx(0.03, abs=1e-3)
    assert router.choose(loads, 100, 10) == first  # the choice does not move
    assert router.last.ttft_s > raw


@pytest.mark.slow  # a timing assertion
def test_predictive_decisions_take_under_a_millisecond_at_p99_with_16_candidates():
    nodes = []
    for k in range(16):
        clock = [0.0]
        sched = scheduler(num_blocks=2000, budget=512, max_num_seqs=256, clock=lambda: clock[0])
        for i in range(20 + 3 * k):  # loaded nodes: long forecasts
            add(sched, f"r{i}", 100 + 37 * i % 900, 50 + i % 200)
        run_steps(sched, clock, limit=20)
        nodes.append(sched)
    router = predictive(nodes)
    loads = [NodeLoad(32_000)] * 16
    rng = np.random.default_rng(0)
    for p in rng.integers(10, 3000, size=50):  # warm up
        router.choose(loads, int(p), 256)
    router.decision_s.clear()
    for p in rng.integers(10, 3000, size=1000):
        router.choose(loads, int(p), 256)
    assert router.decision_p99_s() < 1e-3, f"p99 {router.decision_p99_s() * 1e3:.2f} ms"


def test_every_router_name_builds_and_heuristics_ignore_snapshots():
    for name in ("round_robin", "random", "least_loaded", "predictive"):
        router = make_router(name)
        router.observe(0, snapshot(scheduler(), 0.0), 0.0)
        assert router.choose([NodeLoad(100), NodeLoad(100)], 10, 10) in (0, 1)


# -- attention balancing --------------------------------------------------------------------------
def test_step_time_cap_limits_prompt_tokens_joining_decodes():
    model = OnlineStepModel((0.01, 1e-3, 0.0, 0.0, 0.0))  # 10 ms + 1 ms per token
    balancer = StepTimeBalancer(model, 0.05)
    assert balancer.prefill_tokens(0, 0, 0) == 40
    assert balancer.prefill_tokens(30, 30, 3000) == 10
    assert balancer.prefill_tokens(45, 45, 4500) == 0
    clock = [0.0]
    sched = scheduler(budget=512, clock=lambda: clock[0])
    sched.step_cap = balancer
    for i in range(30):
        add(sched, f"d{i}", 1, 100)
    run_steps(sched, clock, limit=1)  # thirty one-token prompts: they decode from now on
    add(sched, "long", 400, 5)
    out = sched.schedule()
    assert out.num_single_token == 30 and out.num_scheduled_tokens[-1] == 10  # not the 482 the budget allows
    lone = scheduler(budget=512)
    lone.step_cap = StepTimeBalancer(model, 0.001)  # below the fixed cost: a lone prompt still progresses
    add(lone, "p", 100, 5)
    assert lone.schedule().num_scheduled_tokens == [1]


# -- autoscaling ----------------------------------------------------------------------------------
def test_autoscaler_decisions():
    scaler = Autoscaler(AutoscalePolicy(min_replicas=1, max_replicas=3, predicted_ttft_s=2.0, idle_s=30.0))
    assert not scaler.should_add(1.5, 1, 0, 0.0)  # under the threshold
    assert scaler.should_add(2.5, 1, 0, 1.0)
    assert not scaler.should_add(9.0, 2, 1, 2.0)  # one is starting: its capacity is not predicted yet
    assert not scaler.should_add(9.0, 3, 0, 3.0)  # at max_replicas
    assert not scaler.should_retire(2, 10.0, 4.0) and scaler.should_retire(2, 31.0, 5.0)
    assert not scaler.should_retire(1, 1e9, 6.0)  # at min_replicas
    assert [e.action for e in scaler.events] == [ScaleAction.ADD, ScaleAction.RETIRE]
    assert [(e.time_s, e.replicas, e.predicted_ttft_s) for e in scaler.events] == [(1.0, 2, 2.5), (5.0, 1, None)]
    scaler.should_add(3.0, 1, 0, 7.0, waiting=4)
    scaler.add_failed(8.0, "no room")  # the fleet stays as it was
    scaler.should_add(3.0, 1, 0, 9.0)
    scaler.added(10.0, 2)
    assert [(str(e.action), e.replicas) for e in scaler.events[2:]] == [("add", 2), ("add_failed", 1), ("add", 2),
                                                                         ("added", 2)]
    assert scaler.events[2].waiting == 4 and scaler.events[3].error == "no room"
    assert scaler.events[3].as_dict() == {"time_s": 8.0, "action": "add_failed", "replicas": 1, "error": "no room"}


@pytest.mark.parametrize("section, message", [
    ({"min_replicas": 0}, "autoscale.min_replicas must be at least 1"),
    ({"min_replicas": 3, "max_replicas": 2}, "must be at least autoscale.min_replicas"),
    ({"predicted_ttft_s": 0}, "autoscale.predicted_ttft_s must be positive"),
    ({"max_replicas": "two"}, "autoscale.max_replicas must be int"),
])
def test_autoscale_section_errors_name_the_key(section, message):
    with pytest.raises(PlanError, match=message):
        Plan.from_dict({"model": "tiny-mixtral", "serve": {"router": "predictive"}, "autoscale": section})


def fleet(autoscaler=None, replicas: int = 4):
    from megainfer.tools.simulator.cluster import ClusterSimulator
    from planner.catalog import Catalog
    from planner.step_cost_model import ColocatedStepModel

    model = PRESETS["qwen3-30b-a3b"]
    step_model = ColocatedStepModel(model, Catalog.load()["H100"], 1)
    return ClusterSimulator(model, step_model, EngineConfig(max_num_batched_tokens=512), replicas,
                            make_router("predictive"), autoscaler=autoscaler, start_delay_s=5.0, snapshot_s=0.25)


def test_autoscaler_in_the_fleet_adds_before_queues_build_and_retires_when_idle():
    from megainfer.tools.bench.workload import generate

    model = PRESETS["qwen3-30b-a3b"]
    # Rates for one H100 per replica as the fitted H100 curves price it (a long ShareGPT prompt
    # alone takes about a second there, hence the 2 s threshold).
    calm = generate("sharegpt", num_requests=60, rate=1.0, max_model_len=model.max_position_embeddings, seed=1)
    surge = generate("sharegpt", num_requests=400, rate=10.0, max_model_len=model.max_position_embeddings, seed=2)
    tail = generate("sharegpt", num_requests=40, rate=0.1, max_model_len=model.max_position_embeddings, seed=3)
    t1 = calm[-1].arrival_s
    t2 = t1 + surge[-1].arrival_s
    requests = calm + [type(r)(r.arrival_s + t1, r.input_len, r.output_len) for r in surge] + \
        [type(r)(r.arrival_s + t2, r.input_len, r.output_len) for r in tail]
    policy = AutoscalePolicy(min_replicas=1, max_replicas=4, predicted_ttft_s=2.0, idle_s=20.0)
    result = fleet(Autoscaler(policy)).run(requests)
    adds = [e for e in result.scale_events if e.action is ScaleAction.ADD]
    retires = [e for e in result.scale_events if e.action is ScaleAction.RETIRE]
    assert adds and all(t1 <= e.time_s for e in adds)  # the calm phase needs one replica
    first = adds[0]
    assert first.predicted_ttft_s > 2.0
    # Before the queue built: a queue-length trigger (a quarter of the longest queue) would fire later.
    peak = max(w for _, w in result.waiting_trace)
    queue_trigger = next(t for t, w in result.waiting_trace if w >= peak / 4)
    assert first.waiting < peak / 4 and first.time_s < queue_trigger
    assert retires and retires[-1].time_s > t2  # the quiet tail lets the extra replicas go
    assert len(result.ttft_s) == len(requests)
    reported = json.loads(json.dumps(result.summary()))["scale_events"]
    assert reported[0] == {"time_s": first.time_s, "action": "add", "replicas": 2,
                           "predicted_ttft_s": first.predicted_ttft_s, "waiting": first.waiting}


def test_fleet_simulation_reports_prediction_error_and_the_cli_compares_routers(tmp_path):
    from megainfer.tools.bench.workload import generate

    model = PRESETS["qwen3-30b-a3b"]
    requests = generate("sharegpt", num_requests=150, rate=8.0, max_model_len=model.max_position_embeddings)
    summary = fleet().run(requests, 8.0).summary()
    assert summary["requests"] == 150 and sum(summary["per_replica"]) == 150
    assert 0 <= summary["prediction_mae_s"] < 0.5 * summary["ttft_mean_s"] + 0.05
    path = tmp_path / "routing.json"
    out = subprocess.run([sys.executable, "-m", "megainfer", "simulate-routing", "--replicas", "3", "--requests", "40",
                          "--sweep-rates", "4:6:2", "--json", str(path), "--plot", str(tmp_path / "r.png")],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert "capacity (highest rate with P99 TTFT <= 3 s)" in out.stdout and "prediction MAE" in out.stdout
    data = json.loads(path.read_text())
    assert set(data["capacity"]) == {"round_robin", "least_loaded", "predictive"}
    assert (tmp_path / "r.png").stat().st_size > 0
    bad = subprocess.run([sys.executable, "-m", "megainfer", "simulate-routing", "--routers", "fastest"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "choose from" in bad.stderr and "Traceback" not in bad.stderr
