"""The engine: requests in, per-step token deltas out. `step()` is schedule -> execute -> update.

The server drives `add_request` / `step` / `abort` from one loop; the offline `LLM` API
drives the same methods until every request is done.

`Engine` orchestrates the step (its scheduling ahead and settling included) over three parts
with a job each: `RequestAdmission` checks a request before it is queued (any thread), the
`OutputProcessor` makes each step's deltas from the requests' output streams (every sequence of
every step), and `StepRecords` keeps the counters `stats()` reports and what a router learns.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from functools import partial
from operator import attrgetter

from megainfer.engine.output_processor import OutputProcessor
from megainfer.engine.request_admission import Prompt, RequestAdmission
from megainfer.engine.step_records import StepRecords
from megainfer.engine_config import EngineConfig
from megainfer.errors import ConfigError, DataPlaneError, RequestError
from megainfer.messages import DeltaColumns, EngineStats, ErrorCode, NodeState, RequestDelta
from megainfer.model.weights import RandomWeights, SafetensorsCheckpoint
from megainfer.model_resolution import resolve_model
from megainfer.routing.online_step_model import OnlineStepModel, StepTimeBalancer
from megainfer.runner.model_runner import ModelRunner, StepResult
from megainfer.runner.step_hooks import StepHooks
from megainfer.sampling_params import SamplingParams
from megainfer.scheduling.node_state import snapshot
from megainfer.scheduling.prefix_hash import engine_salt
from megainfer.scheduling.scheduler import Scheduler
from megainfer.scheduling.scheduler_output import SchedulerOutput, without_finished
from megainfer.scheduling.sequence import Sequence
from megainfer.tokenizer import Tokenizer, load_tokenizer

logger = logging.getLogger(__name__)


class Engine:
    def __init__(self, model: str | os.PathLike = "tiny-mixtral", config: EngineConfig | None = None, *,
                 runner_factory=None, **overrides) -> None:
        """`runner_factory(model_config, config, weights, max_model_len)` builds the runner;
        the default runs the whole model here (`ModelRunner`)."""
        config = config or EngineConfig()
        config = config.replace(**overrides) if overrides else config
        self.model_config, checkpoint = resolve_model(model)
        self.checkpoint = checkpoint  # the resolved directory (None for a preset): chat template, defaults
        # dtype/device "auto" become concrete here: everything below reads the resolved config.
        self.config = config.resolve(self.model_config)
        if checkpoint is None and not self.model_config.runnable_with_random_weights:
            gib = self.model_config.num_params * 4 / 2**30
            raise ConfigError(
                f"preset {str(model)!r} is shape-only (about {gib:.0f} GiB of weights); it serves the planner "
                "and simulator. To run it, pass a checkpoint directory; for a demo use 'tiny-mixtral'")
        weights = SafetensorsCheckpoint(checkpoint) if checkpoint else RandomWeights(self.config.seed)
        self.tokenizer: Tokenizer | None = load_tokenizer(checkpoint, self.model_config)
        self.max_model_len = self.config.resolved_max_model_len(self.model_config)
        self.runner = (runner_factory or ModelRunner)(self.model_config, self.config, weights, self.max_model_len)
        self.scheduler = Scheduler.from_config(self.config, num_blocks=self.runner.num_blocks,
                                               max_model_len=self.max_model_len,
                                               eos_token_ids=self.model_config.eos_token_ids,
                                               num_layers=self.model_config.num_layers,
                                               window=self.model_config.kv_window,
                                               prefix_salt=engine_salt(self.config, self.model_config.name))
        self.admission = RequestAdmission(self.model_config, self.tokenizer, self.max_model_len,
                                          self.scheduler.block_manager)
        self.output_processor = OutputProcessor(self.scheduler, self.tokenizer, self.runner.sampler)
        self.step_model: OnlineStepModel | None = None
        if self.config.target_step_ms is not None:  # attention balancing, on this node's own step times
            self.step_model = OnlineStepModel()
            self.scheduler.step_cap = StepTimeBalancer(self.step_model, self.config.target_step_ms / 1e3)
        # Made once the runner is built: energy counts from here, the weights' loading left out.
        self.step_records = StepRecords(self.model_config, self.config.dtype, self.config.device,
                                        self.runner.num_blocks, self.step_model, self.config.expert_load_window)
        self._last_step_end: float | None = None  # while busy: when the last step ended
        # Asynchronous scheduling: the next step, scheduled while this one ran, and this step,
        # to be settled inside the next one.
        self._takes_hooks = self.runner.takes_step_hooks
        self._schedules_ahead = self.config.async_scheduling and self._takes_hooks
        self._ahead: ScheduledAhead | None = None
        self._pending: PendingStep | None = None

    # -- requests ------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams | None = None) -> Sequence:
        """Queue a request. A bad one raises RequestError and leaves the engine untouched."""
        if request_id in self.scheduler.requests:
            raise RequestError(f"request id {request_id!r} is already in use")
        seq = self.prepare_request(request_id, prompt, params)
        self.add_sequence(seq)
        return seq

    def prepare_request(self, request_id: str, prompt: Prompt, params: SamplingParams | None = None) -> Sequence:
        """Check and tokenize a request into a sequence the scheduler can take, raising
        RequestError for a bad one. Any thread may call it while a step runs
        (`RequestAdmission` reads only what never changes); the caller keeps request ids unique."""
        return self.admission.prepare(request_id, prompt, params)

    def add_sequence(self, seq: Sequence) -> None:
        """Hand a prepared request to the scheduler (between steps)."""
        self.scheduler.add(seq)
        self.output_processor.open(seq)

    def encode_prompt(self, prompt: Prompt, request_id: str = "") -> list[int]:
        """A prompt's token ids, checked (RequestError names `request_id` when given)."""
        return self.admission.encode_prompt(prompt, request_id)

    def abort(self, request_id: str) -> bool:
        """Cancel a request, freeing its KV blocks. False if it is unknown or already done."""
        seq = self.scheduler.abort(request_id)
        if seq is not None:
            self.output_processor.forget(request_id)
        return seq is not None

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished or self._pending is not None

    # -- one step ------------------------------------------------------------------------
    def step(self) -> list[RequestDelta]:
        """One step; its deltas as objects (`step_columns` gives them in columns)."""
        return self.step_columns().deltas

    def step_columns(self, emit: Callable[[DeltaColumns], None] | None = None) -> DeltaColumns:
        """One step: schedule, execute, update; the deltas in columns, as a node hands them on.

        With asynchronous scheduling (`EngineConfig.async_scheduling`, on a runner that takes
        `StepHooks`: an attention node's), the next step is scheduled once this one is under
        way (`_look_ahead`), this step ends with its tokens written where the next step's
        inputs read them, and the rest of it (stop conditions, detokenization, deltas,
        statistics) is settled inside the next step, once its micro-batches are all under way.
        Those deltas go to `emit` as they are made (else they are returned by the call that made
        them: one step late)."""
        produced = DeltaColumns()
        pending, self._pending = self._pending, None
        out = self._ahead.take(self.scheduler) if self._ahead is not None else self.scheduler.schedule()
        self._ahead = None
        settle = partial(self._settle_pieces, pending, emit, produced) if pending is not None else None
        if out.is_empty:
            self._last_step_end = None
            if pending is not None:
                self._settle(pending, emit, produced)
            if self.runner.steps_when_idle:
                self.runner.execute(out)  # a disaggregated node takes part in every step, empty or not
            return produced
        started = time.perf_counter()
        # A step that follows a busy one directly is measured from that one's end: what happens
        # between steps (scheduling, streaming, the driver's calls waiting on the node) delays
        # the next token as much as the compute does, and the router predicts wall-clock time.
        began = self._last_step_end if self._last_step_end is not None else started
        step_id = self._step_id()
        hooks = StepHooks(partial(self._look_ahead, out) if self._schedules_ahead else None, settle,
                          partial(self._place_rows, out) if self._schedules_ahead else None)
        try:
            result = self.runner.execute(out, hooks) if self._takes_hooks else self.runner.execute(out)
        except Exception as exc:  # a broken step fails its own requests; the engine serves on
            self._last_step_end, self._ahead = None, None
            hooks.run_settle()
            code = ErrorCode.UNAVAILABLE if isinstance(exc, DataPlaneError) else ErrorCode.INTERNAL
            if code is ErrorCode.INTERNAL:
                logger.exception("step failed; failing its %d requests", len(out.all_seqs))
            produced.extend(DeltaColumns.of([self.output_processor.fail(seq, f"step failed: {exc}", code=code)
                                             for seq in out.all_seqs]))
            return produced
        hooks.finish_begun()  # what a runner left (a step too short to reach its first layer's end)
        if self._ahead is not None:  # scheduled ahead: settled in the next step
            ended = time.perf_counter()
            if hooks.placed != len(result.sampled) - result.sampled.count(None):  # not all placed as sampled
                self.scheduler.place(out, result.sampled)
            self._pending = PendingStep(out, result, began, ended, step_id)
            self._last_step_end = ended  # the next step is due at once
            return produced
        advanced = self.scheduler.update_from_output(out, result.sampled)
        produced.extend(self.output_processor.deltas(out, result, advanced))
        ended = time.perf_counter()  # detokenizing is part of the step here
        self._last_step_end = ended if self.scheduler.has_unfinished else None
        self.step_records.step_finished(out, result, ended - began, step_id, advanced)
        return produced

    def _look_ahead(self, out: SchedulerOutput) -> Generator[bool, None, SchedulerOutput | None]:
        """Runner hook once step `out` is under way, in two pieces (`StepHooks.run_piece`): its
        sequences advanced, then the next step scheduled and returned (the runner lays it out).
        Left to the next call: a step with a layered cohort or under a policy that schedules
        prompts itself (its group advances only once the step is done), and one whose sampling
        reads its sequences' state (penalties, min_tokens, prompt logprobs), which the
        look-ahead's placeholders would change."""
        if out.layered is not None or not self.scheduler.policy.never_schedules_itself or \
                any(map(_READS_HISTORY, out.seqs)):
            return None
        self.scheduler.advance_ahead(out)
        yield True
        self._ahead = ScheduledAhead(self.scheduler.schedule(), self.scheduler.num_finished)
        return self._ahead.out

    def _place_rows(self, out: SchedulerOutput, rows: list[int], tokens: list[int]) -> bool:
        """Runner hook: a micro-batch's tokens placed as sampled, where the step ahead reads them (False: none is)."""
        if self._ahead is not None:
            self.scheduler.tokens.place_rows(out.all_seqs, rows, tokens)
        return self._ahead is not None

    def _settle(self, pending: "PendingStep", emit: Callable[[DeltaColumns], None] | None,
                produced: DeltaColumns) -> None:
        """The rest of a step scheduled ahead at once (`_settle_pieces`)."""
        deque(self._settle_pieces(pending, emit, produced), maxlen=0)

    def _settle_pieces(self, pending: "PendingStep", emit: Callable[[DeltaColumns], None] | None,
                       produced: DeltaColumns) -> Iterator[bool]:
        """Its stop conditions, deltas (to `emit`, or into `produced`) and statistics, in pieces."""
        return pending.settle_pieces(self.scheduler, self.output_processor, self.step_records,
                                     emit if emit is not None else produced.extend)

    def node_state(self, now: float = 0.0) -> NodeState:
        """The scheduler's state for a router, with the steps measured and the requests
        finished since the last call."""
        steps, finished = self.step_records.drain()
        return snapshot(self.scheduler, now, steps, finished, self._step_id())

    def _step_id(self) -> int:
        """A disaggregated runner numbers its steps, and every attention node of the replica runs
        each number together (the router adds their work up); -1 on a colocated runner."""
        return self.runner.step_id

    def fail_all(self, error: str, code: ErrorCode = ErrorCode.UNAVAILABLE) -> list[RequestDelta]:
        """Fail every unfinished request (their blocks are freed): the node cannot serve them. A
        step scheduled ahead is settled first: its deltas come before the failures."""
        settled = DeltaColumns()
        pending, self._pending, self._ahead = self._pending, None, None
        if pending is not None:
            self._settle(pending, None, settled)
        fail = self.output_processor.fail
        return settled.deltas + [fail(seq, error, code=code) for seq in list(self.scheduler.requests.values())]

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block (vLLM's reset_prefix_cache; for benchmarks). Running
        requests keep their blocks. False when prefix caching is off."""
        return self.scheduler.block_manager.reset_prefix_cache()

    def stats(self) -> EngineStats:
        """The engine's counters so far, with its scheduler's state now."""
        return self.step_records.stats(self.scheduler, self.runner.kernels)


_READS_HISTORY = attrgetter("reads_history")
# Sequences settled per piece of the work beside the layers: about 1 ms of host work at the 2 us
# a sequence the settle and its deltas take (`bench host`), within one layer's device time on the
# shipped plans (about 1.07 ms on the Qwen3-235B one).
SETTLE_PIECE = 512


@dataclass
class PendingStep:
    """A step that ran and awaits its settling (its deltas and statistics)."""

    out: SchedulerOutput
    result: StepResult
    began: float
    ended: float
    step_id: int

    def settle_pieces(self, scheduler: Scheduler, output: OutputProcessor, records: StepRecords,
                      emit: Callable[[DeltaColumns], None]) -> Iterator[bool]:
        """Its stop conditions, deltas and statistics, in pieces of `SETTLE_PIECE` sequences
        (`StepHooks.run_piece`: a runner spreads them over its layers), yielding between two. The
        deltas go to `emit` once, all of them: one poll answer per step for the driver."""
        out, result = self.out, self.result
        advanced: list[Sequence] = []
        columns = DeltaColumns()
        for start in range(0, len(out.seqs), SETTLE_PIECE):
            if start:
                yield True
            piece = scheduler.settle(out, result.sampled, start, start + SETTLE_PIECE)
            advanced += piece
            columns.extend(output.deltas(out, result, piece, prompt_logprobs=not start))
        records.step_finished(out, result, self.ended - self.began, self.step_id, advanced)
        emit(columns)


@dataclass
class ScheduledAhead:
    """The next step, scheduled while the last one ran, with the scheduler's count of finished
    sequences then: one finished since (aborted, failed, or stopped while settling) leaves the
    step before it runs, since its blocks are free."""

    out: SchedulerOutput
    finished_then: int

    def take(self, scheduler: Scheduler) -> SchedulerOutput:
        return self.out if scheduler.num_finished == self.finished_then else without_finished(self.out)

