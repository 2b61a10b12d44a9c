"""A node's next steps, forecast by running the real `Scheduler` forward from its snapshot.

`NodeForecast.build` rebuilds the node's scheduler from a `NodeState` (its running and
waiting requests with their lengths so far; each request's remaining output from the length
estimator) and steps it up to `horizon` times with the online step model pricing each step.
For every step it records when it ends and the *spare*: the prompt tokens the scheduler would
give one more request at the back of the queue (the budget left once everyone ahead is
served, bounded by free KV blocks and the sequence cap). The scheduler is first-come
first-served, so a newcomer changes nothing ahead of it: its first token comes at the end of
the step where the cumulative spare covers its prompt (a layered-prefill cohort completes its
groups later: `lag`), and its last token `output - 1` steps after that. A prediction is then a
couple of binary searches, not a simulation: microseconds per candidate.

Nodes that run every step together (the attention nodes of a disaggregated replica, which meet
the expert nodes every layer) are forecast together on one `LockstepSteps`: it keeps each node's
work in each step, and prices a step on all of it (the sums the experts compute, the busiest
node's share the attention half waits on), so a node idle beside a busy one is predicted at the
busy one's pace, a request committed to one lengthens its siblings' steps, and a prompt beside
another node's prompt costs less than one queued behind it on the same node.

Routing a request there `commit`s it to the forecast (its tokens leave the spare, its decode
adds to the steps it rides), so the next decision sees it before the next snapshot does.
Past the horizon the forecast extrapolates: the backlog left then drains at the budget the
decodes leave, one step after another (`ForecastTail`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from megainfer.messages import NodeState, RequestLengths
from megainfer.routing.length_estimator import OutputLengthEstimator
from megainfer.routing.online_step_model import OnlineStepModel
from megainfer.sampling_params import SamplingParams
from megainfer.scheduling.kv_cache import BlockManager
from megainfer.scheduling.node_state import step_sample
from megainfer.scheduling.scheduler import ChunkedPrefill, LayeredPrefill, Scheduler
from megainfer.scheduling.sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class RequestForecast:
    """What the forecasts predicted for a request on the node the router placed it on
    (`PredictiveRouter.last`)."""

    node: int
    ttft_s: float
    e2e_s: float
    output_tokens: int  # the estimate the prediction assumed
    at: float = 0.0  # when the router chose (its clock)


# A work row: one node's (tokens, seqs, kv_tokens, score_pairs) in one step.
TOKENS, SEQS, KV_TOKENS, SCORE_PAIRS = range(4)
PEAK_COLUMNS = [TOKENS, KV_TOKENS, SCORE_PAIRS]  # the columns the busiest node bounds


class LockstepSteps:
    """When a forecast's steps end. Nodes in lockstep (a disaggregated replica's attention
    nodes meet the experts every layer) share one: it holds every member's work in every step
    (rows of tokens, seqs, kv_tokens, score_pairs) and each step lasts as long as the model
    prices all of it, so a request committed to one node changes its siblings' steps too."""

    def __init__(self, work: np.ndarray, model: OnlineStepModel) -> None:
        self.work = np.asarray(work, dtype=np.float64)  # (members, steps, 4)
        self.model = model
        self.summed = self.work.sum(axis=0)
        self.peak = self.work[:, :, PEAK_COLUMNS].max(axis=0)
        self.dur = model.price(self.summed, self.peak)
        self.members: list[NodeForecast] = []
        self.reindex()

    def reindex(self) -> None:
        self.end = np.cumsum(self.dur)
        self.start = self.end - self.dur
        for m in self.members:
            m._index()

    def add(self, member: int, steps: slice, rows: np.ndarray) -> None:
        """`member` does `rows` more work in `steps`: those steps are repriced."""
        mine = self.work[member]
        mine[steps] += rows
        self.summed[steps] += rows
        self.peak[steps] = np.maximum(self.peak[steps], mine[steps][:, PEAK_COLUMNS])
        self.dur[steps] = self.model.price(self.summed[steps], self.peak[steps])

    def added_s(self, member: int, steps: slice, rows: np.ndarray) -> float:
        """Seconds `rows` more work by `member` in `steps` would add to them."""
        peak = np.maximum(self.peak[steps], self.work[member][steps][:, PEAK_COLUMNS] + rows[:, PEAK_COLUMNS])
        return float((self.model.price(self.summed[steps] + rows, peak) - self.dur[steps]).sum())

    def added_one_s(self, member: int, step: int, prompt: int) -> float:
        """`added_s` for a whole prompt from a fresh prefix in one step (most placements), in
        plain floats: numpy's per-call overhead would dominate a single row."""
        cost = self.model.coefficients
        pairs = prompt * (prompt + 1) / 2
        peak_tokens, peak_kv, peak_pairs = self.peak[step].tolist()
        tokens, _, kv, own_pairs = self.work[member, step].tolist()
        return (cost.tokens * prompt + cost.seqs + cost.kv_tokens * prompt + cost.score_pairs * pairs
                + cost.peak_tokens * max(tokens + prompt - peak_tokens, 0.0)
                + cost.peak_kv_tokens * max(kv + prompt - peak_kv, 0.0)
                + cost.peak_score_pairs * max(own_pairs + pairs - peak_pairs, 0.0))

    @property
    def alone(self) -> bool:
        """One node (a colocated engine, a simulated replica): its work is every step's peak
        too, so a step's time is linear in its work and who did what need not be tracked."""
        return len(self.members) == 1

    def tail_s(self, member: int, row: tuple[float, float, float, float], others_prefill: bool = True) -> float:
        """A step past the horizon with `member` doing `row` and every other member its tail
        step (its decodes, and its prompt chunk unless `others_prefill` is False)."""
        if self.alone:
            return self.model.seconds(*row)
        return self.model.lockstep_seconds([row if j == member else m.tail.row(m.tail.chunk if others_prefill else 0)
                                            for j, m in enumerate(self.members)])


class ForecastTail:
    """One node's steps past the forecast's horizon, extrapolated: the prompt backlog left at the
    horizon drains at the budget the decodes leave, each step priced on the lockstep timeline
    with every member's tail work. A request committed past the horizon joins the decodes and
    keeps the tail busy until its prompt is computed (`free_s`)."""

    def __init__(self, timeline: LockstepSteps, member: int, *, budget: int, backlog: int, decodes: int,
                 kv: float, cohort_lag: int) -> None:
        self.timeline = timeline
        self.member = member  # this node's row in the timeline's work
        self.budget = budget  # prompt tokens a step (or a cohort) can take
        self.backlog = backlog  # prompt tokens still queued at the horizon
        self.decodes = decodes  # sequences decoding at the horizon
        self.kv = kv  # their cached tokens
        self.cohort_lag = cohort_lag  # layered prefill: extra steps a cohort takes past its first
        self.free_s = 0.0  # when the tail has computed every prompt token queued in it (relative)
        self.base_s = 0.0  # a step without a newcomer here (`reindex`)

    @property
    def rate(self) -> int:
        """Prompt tokens a step past the horizon computes here."""
        return self.budget if self.cohort_lag else max(self.budget - self.decodes, 1)

    @property
    def chunk(self) -> int:
        """Prompt tokens this node computes in a step past the horizon while its backlog lasts."""
        return min(self.rate, self.backlog)

    def row(self, chunk: float, decodes: int = 0, extra_kv: float = 0.0) -> tuple[float, float, float, float]:
        """This node's work in a step past the horizon: its decodes (`decodes` more, reading
        `extra_kv` more cached tokens) and a prompt chunk of `chunk` tokens (from a fresh prefix:
        the tail does not track where a backlog's prompts stand)."""
        decoding = self.decodes + decodes
        kv = self.kv + extra_kv
        return (chunk + decoding, decoding + (chunk > 0), kv + chunk, kv + chunk * (chunk + 1) / 2)

    def reindex(self, horizon_s: float) -> None:
        """The timeline was repriced; its steps end at `horizon_s`."""
        # A step past the horizon without a newcomer here; every prediction past it asks.
        self.base_s = self.timeline.tail_s(self.member, self.row(0))
        if self.free_s < horizon_s:  # the backlog left at the horizon drains at the tail's rate
            self.free_s = horizon_s + -(-self.backlog // self.rate) * self.step_s(self.chunk)

    def step_s(self, chunk: int) -> float:
        """A step past the horizon: every lockstep node's decodes and prompt chunks then, with a
        prompt chunk of `chunk` tokens here."""
        return self.timeline.tail_s(self.member, self.row(chunk))

    def prefill_s(self, tokens: int, chunks: int, prefix: int) -> float:
        """What `tokens` prompt tokens past `prefix` computed in `chunks` steps past the horizon
        add to them: the tokens, a sequence in each step, each chunk reading the prefix before
        it, and the causal pairs, spread evenly over the chunks."""
        base = self.row(0)
        share = (tokens / chunks, 1.0, prefix + tokens * (chunks + 1) / 2 / chunks,
                 (tokens * prefix + tokens * (tokens + 1) / 2) / chunks)
        with_it = tuple(a + b for a, b in zip(base, share))
        return chunks * (self.timeline.tail_s(self.member, with_it) - self.base_s)

    def decode_s(self, extra_kv: float) -> float:
        """A decode step past the horizon, the newcomer decoding here with `extra_kv` cached tokens."""
        return self.timeline.tail_s(self.member, self.row(0, decodes=1, extra_kv=extra_kv), others_prefill=False)

    def add_decode(self, prompt: int, output: int) -> None:
        """A committed request still decodes at the horizon."""
        self.decodes += 1
        self.kv += prompt + output / 2


class NodeForecast:
    def __init__(self, t0: float, timeline: LockstepSteps, spare: np.ndarray, lag: np.ndarray, kv_free: np.ndarray, *,
                 budget: int, tail_backlog: int, tail_decodes: int, tail_kv: float, model: OnlineStepModel,
                 cohort_lag: int = 0) -> None:
        self.t0 = t0
        self.timeline = timeline
        self.member = len(timeline.members)  # this node's row in the timeline's work
        self.spare = spare.astype(np.int64)
        self.lag = lag.astype(np.int64)
        self.kv_free = kv_free.astype(np.int64)  # KV tokens free after each step's allocation
        self.cohort_lag = cohort_lag  # layered prefill: extra steps a cohort takes past its first
        self.model = model
        self.tail = ForecastTail(timeline, self.member, budget=budget, backlog=tail_backlog, decodes=tail_decodes,
                                 kv=tail_kv, cohort_lag=cohort_lag)
        timeline.members.append(self)

    @property
    def dur(self) -> np.ndarray:
        return self.timeline.dur

    @property
    def start(self) -> np.ndarray:
        return self.timeline.start

    @property
    def end(self) -> np.ndarray:
        return self.timeline.end

    def _index(self) -> None:
        self.cum_spare = np.cumsum(self.spare)
        self.cum_open = np.cumsum(self.spare > 0)  # steps a newcomer's prompt could take a chunk in
        # A newcomer admitted at step k holds p + (j - k) tokens at step j: it fits for good when
        # p <= min over j >= k of (kv_free[j] - j) + k. That bound rises with k, so the first
        # step it fits is a binary search.
        steps = np.arange(len(self.kv_free))
        headroom = self.kv_free - steps
        self.kv_gate = np.minimum.accumulate(headroom[::-1])[::-1] + steps if len(headroom) else headroom
        self.tail.reindex(self.horizon_s)

    @property
    def horizon_s(self) -> float:
        end = self.timeline.end
        return float(end[-1]) if len(end) else 0.0

    def _prefill_added_s(self, first: int, last: int, prompt: int) -> float:
        """What the newcomer's prompt, spread over steps first..last, adds to them."""
        if self.timeline.alone:
            chunks = int(self.cum_open[last]) - (int(self.cum_open[first - 1]) if first > 0 else 0)
            cost = self.model.alone
            return (cost.tokens * prompt + cost.seqs * chunks + cost.kv_tokens * prompt * (chunks + 1) / 2
                    + cost.score_pairs * prompt * (prompt + 1) / 2)
        if last == first:
            return self.timeline.added_one_s(self.member, last, prompt)
        return self.timeline.added_s(self.member, *self._chunk_rows(first, last, prompt))

    def _chunk_rows(self, first: int, last: int, prompt: int) -> tuple[slice, np.ndarray]:
        """The newcomer's work in steps first..last where its prompt is spread over the steps'
        spare budget, each chunk reading the prefix before it (last -1: it takes every step's
        spare up to the horizon and finishes past it)."""
        stop = last + 1 if last >= 0 else len(self.spare)
        chunk = self.spare[first:stop].astype(np.float64)
        if last >= 0:
            chunk[-1] = prompt - chunk[:-1].sum()
        prefix = np.cumsum(chunk) - chunk
        computing = chunk > 0
        rows = np.column_stack((chunk, computing, np.where(computing, prefix + chunk, 0.0),
                                chunk * prefix + chunk * (chunk + 1) / 2))
        return slice(first, stop), rows

    def room_next(self, now: float) -> int:
        """The spare budget of the first step that starts after `now` (the whole budget past
        the horizon)."""
        i = int(self.start.searchsorted(now - self.t0))
        return int(self.spare[i]) if i < len(self.spare) else self.tail.budget

    def _place(self, now: float, prompt: int) -> tuple[int, int, float]:
        """(first step the newcomer may join, the step its last prompt token is computed in or -1
        past the horizon, and when -1 the time its last prompt token is computed)."""
        rel = now - self.t0
        horizon = len(self.dur)  # steps forecast
        join_step = int(self.start.searchsorted(rel))
        # Not before the KV cache can keep it to the end (else it would be the one preempted).
        join_step = max(join_step, int(self.kv_gate.searchsorted(prompt)))
        before = int(self.cum_spare[join_step - 1]) if join_step > 0 else 0
        prompt_step = int(self.cum_spare.searchsorted(before + prompt)) if join_step < horizon else horizon
        if prompt_step < horizon:
            return join_step, prompt_step, 0.0
        got = int(self.cum_spare[-1]) - before if join_step < horizon else 0
        within = self.timeline.added_s(self.member, *self._chunk_rows(join_step, -1, prompt)) if got else 0.0
        tail = self.tail
        steps = -(-(prompt - got) // tail.rate)
        past = max(tail.free_s, rel) + within + steps * tail.base_s + tail.prefill_s(prompt - got, steps, got)
        return join_step, -1, past

    def predict(self, now: float, prompt: int, output: int) -> tuple[float, float]:
        """(TTFT, end-to-end latency) of a request of `prompt` tokens arriving at `now` that
        generates `output` tokens."""
        rel = now - self.t0
        join_step, prompt_step, past = self._place(now, prompt)
        horizon = len(self.dur)
        if prompt_step >= 0:  # the forecast's steps do not carry the newcomer's prompt yet: add its cost
            done = prompt_step + int(self.lag[prompt_step])
            first_token = self.end[done] if done < horizon else \
                self.horizon_s + (done - horizon + 1) * self.tail.step_s(0)
            first_token += self._prefill_added_s(join_step, prompt_step, prompt)
        else:  # past the horizon: `_place` priced its chunks
            done = horizon + self.cohort_lag
            first_token = past + self.cohort_lag * self.tail.step_s(0)
        first_token = max(first_token, rel)
        decode_steps = max(output - 1, 0)
        mean_ctx = prompt + output / 2
        decode_extra = decode_steps * self.model.marginal(1, mean_ctx, mean_ctx)
        last_in = min(done + decode_steps, horizon - 1)
        within = max(last_in - done, 0) if done < horizon else 0
        ride = (self.end[last_in] - self.end[done]) if within else 0.0
        ride += (decode_steps - within) * self.tail.decode_s(mean_ctx)
        ttft = first_token - rel
        return ttft, ttft + ride + decode_extra

    def commit(self, now: float, prompt: int, output: int) -> None:
        """The request was routed here: it takes its spare and rides the steps it decodes in."""
        join_step, prompt_step, past = self._place(now, prompt)
        horizon = len(self.dur)
        if prompt_step < 0:  # its prompt finishes past the horizon: the tail is busy until then
            if join_step < horizon:
                if not self.timeline.alone:  # (alone, `past` priced these chunks)
                    self.timeline.add(self.member, *self._chunk_rows(join_step, -1, prompt))
                self.spare[join_step:] = 0
            self.tail.free_s = past
            self.tail.add_decode(prompt, output)
            self.timeline.reindex()
            return
        before = int(self.cum_spare[join_step - 1]) if join_step > 0 else 0
        timeline = self.timeline
        alone = timeline.alone
        if alone:
            self.dur[prompt_step] += self._prefill_added_s(join_step, prompt_step, prompt)
        else:
            timeline.add(self.member, *self._chunk_rows(join_step, prompt_step, prompt))
        self.spare[prompt_step] = int(self.cum_spare[prompt_step]) - (before + prompt)
        self.spare[join_step:prompt_step] = 0
        done = prompt_step + int(self.lag[prompt_step])
        last = done + max(output - 1, 0)
        held = np.minimum(prompt + np.maximum(np.arange(join_step, horizon) - done, 0), prompt + output)
        self.kv_free[join_step:] -= np.where(np.arange(join_step, horizon) <= last, held, 0)
        if done + 1 < horizon:
            ride = slice(done + 1, min(last, horizon - 1) + 1)
            ctx = prompt + output / 2
            if alone:
                self.dur[ride] += self.model.marginal(1, ctx, ctx)
            else:
                timeline.add(self.member, ride, np.array([[1.0, 1.0, ctx, ctx]]))
            if not self.cohort_lag:
                self.spare[ride] = np.maximum(self.spare[ride] - 1, 0)
        if last >= horizon:
            self.tail.add_decode(prompt, output)
        timeline.reindex()

    # -- building ---------------------------------------------------------------------------------
    @classmethod
    def build(cls, state: NodeState, model: OnlineStepModel, estimator: OutputLengthEstimator, *,
              horizon: int = 128) -> "NodeForecast":
        return cls.build_lockstep([state], model, estimator, horizon=horizon)[0]

    @classmethod
    def build_lockstep(cls, states: list[NodeState], model: OnlineStepModel, estimator: OutputLengthEstimator, *,
                       horizon: int = 128) -> list["NodeForecast"]:
        """Forecasts of nodes that run every step together, on one timeline: each step is
        priced by the model on all of their work in it (one node alone is the colocated case)."""
        replays = [_Replay(state, estimator) for state in states]
        idle = (0.0, 0.0, 0.0, 0.0)
        work = []  # per step, every node's row
        while len(work) < horizon and any(replay.scheduler.has_unfinished for replay in replays):
            outs = [replay.scheduler.schedule() if replay.scheduler.has_unfinished else None for replay in replays]
            if any(out is not None and out.is_empty for out in outs):
                break  # nothing fits (a KV cache full of waiting prompts): the tail takes over
            work.append([step_sample(out, num_layers=replay.num_layers).work() if out is not None else idle
                         for replay, out in zip(replays, outs)])
            for replay, out in zip(replays, outs):
                replay.record(out)
        timeline = LockstepSteps(np.asarray(work, dtype=np.float64).reshape(len(work), len(replays), 4).transpose(1, 0, 2),
                            model)
        forecasts = [replay.forecast(state.time, timeline, model) for replay, state in zip(replays, states)]
        timeline.reindex()
        return forecasts


class _Replay:
    """One node's scheduler rebuilt from its snapshot, stepped forward, and what each step
    would leave a newcomer."""

    def __init__(self, state: NodeState, estimator: OutputLengthEstimator) -> None:
        knobs = state.knobs
        layered = knobs.layered
        self.block_manager = block_manager = BlockManager(knobs.num_blocks, knobs.block_size)
        self.num_layers = layered.num_layers if layered is not None else 1
        self.layered = layered is not None
        policy = LayeredPrefill(layered) if layered is not None else ChunkedPrefill()
        self.scheduler = scheduler = Scheduler(block_manager, policy, max_num_seqs=knobs.max_num_seqs,
                                               max_num_batched_tokens=knobs.max_num_batched_tokens,
                                               max_model_len=knobs.max_model_len, clock=lambda: 0.0)
        for i, lengths in enumerate(state.running):
            seq = _sequence(f"r{i}", lengths, estimator)
            cached = lengths.cached
            if block_manager.blocks_for_tokens(cached) > block_manager.num_free_blocks:
                scheduler.add(seq)  # the snapshot raced a preemption: it recomputes, as the node will
                continue
            block_manager.allocate(seq, cached)
            seq.num_computed_tokens = cached
            seq.status = SequenceStatus.RUNNING
            scheduler.running.append(seq)
            scheduler.requests[seq.request_id] = seq
        for i, lengths in enumerate(state.waiting):
            scheduler.add(_sequence(f"w{i}", lengths, estimator))
        self.budget = layered.chunk_tokens if layered is not None else knobs.max_num_batched_tokens
        self.group_lag = 0
        if self.layered:
            self.group_lag = layered.groups(self.budget) - 1
        self.spare: list[int] = []
        self.lag: list[int] = []
        self.kv_free: list[int] = []

    def record(self, out) -> None:
        """The step `out` (None: this node has nothing to run in it) and then run it."""
        room, step_lag = _room(self.scheduler, out, self.layered, self.budget, self.group_lag)
        self.spare.append(room)
        self.lag.append(step_lag)
        self.kv_free.append(self.block_manager.num_free_blocks * self.block_manager.block_size)
        if out is not None:
            self.scheduler.update_from_output(out, [0 if sampled else None for sampled in out.all_samples()])

    def forecast(self, t0: float, timeline: LockstepSteps, model: OnlineStepModel) -> NodeForecast:
        scheduler = self.scheduler
        backlog = sum(s.num_uncomputed_tokens for s in scheduler.waiting) + \
            sum(s.num_uncomputed_tokens for s in scheduler.running if s.num_uncomputed_tokens > 1)
        decodes = [s for s in scheduler.running if s.num_uncomputed_tokens <= 1]
        return NodeForecast(t0, timeline, np.asarray(self.spare), np.asarray(self.lag), np.asarray(self.kv_free),
                            budget=self.budget, tail_backlog=backlog, tail_decodes=len(decodes),
                            tail_kv=float(sum(s.num_computed_tokens for s in decodes)), model=model,
                            cohort_lag=self.group_lag)


def _sequence(request_id: str, lengths: RequestLengths, estimator: OutputLengthEstimator) -> Sequence:
    generated = lengths.tokens - lengths.prompt
    total = estimator.estimate(lengths.prompt, generated, lengths.max_tokens)
    return Sequence(request_id, [0] * lengths.prompt,
                    SamplingParams(max_tokens=max(total, generated + 1), ignore_eos=True),
                    token_ids=[0] * lengths.tokens, arrival_time=0.0)


def _room(scheduler: Scheduler, out, layered: bool, budget: int, group_lag: int) -> tuple[int, int]:
    """Prompt tokens this step would give one more request at the back of the queue, and how
    many steps later those tokens complete (`out` None: the node is idle in this step)."""
    if scheduler.waiting or (out is not None and out.preempted) or len(scheduler.running) >= scheduler.max_num_seqs:
        return 0, 0
    block_manager = scheduler.block_manager
    kv_room = block_manager.num_free_blocks * block_manager.block_size
    if not layered:
        return max(0, min(budget - (out.total_tokens if out is not None else 0), kv_room)), 0
    cohort = out.layered if out is not None else None
    if cohort is None:  # no cohort in flight and nobody waiting: one would form now
        return min(budget, kv_room), group_lag
    if cohort.group == 0:  # a cohort formed this step: a newcomer would have joined it
        return max(0, min(budget - sum(cohort.num_tokens), kv_room)), cohort.num_groups - 1
    return 0, 0
