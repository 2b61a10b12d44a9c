"""Continuous batching over the paged KV cache. Plain Python, no model inside.

`schedule()` picks the sequences of the next step and how many tokens of each to
compute; `update_from_output()` takes the sampled tokens back, applies stop conditions and
frees finished sequences' blocks. The simulator drives this same class with a
performance model in place of a model.

Every step: running decodes first, one token each, then the prompt work of the prefill
policy (`PrefillPolicy`): under `ChunkedPrefill` (Sarathi-style) the prefill chunks of
running and newly admitted sequences until the step's token budget is spent, under
`LayeredPrefill` a cohort of prompt chunks through one layer group. When the
KV cache runs out, the most recently admitted running sequence is preempted by
recompute: its blocks are freed, it returns to the front of the waiting queue, and later
recomputes its prompt and generated tokens as one prompt. Nothing is lost or repeated.
"""

from __future__ import annotations

import operator
import time
from collections import deque
from typing import Callable, Iterable, Protocol

import numpy as np

from megainfer.engine_config import EngineConfig
from megainfer.messages import LayeredSettings
from megainfer.scheduling.kv_cache import BlockManager
from megainfer.scheduling.scheduler_output import LayeredPass, SchedulerOutput
from megainfer.scheduling.sequence import BLOCK_TABLE, COMPUTED, TOKEN_IDS, FinishReason, Sequence, SequenceStatus
from megainfer.scheduling.token_recorder import TokenRecorder


class PrefillPolicy(Protocol):
    """How prompts advance. `Scheduler.schedule` calls every policy the same way: its running
    loop schedules decodes and every running sequence the policy does not schedule itself
    (asking `num_prefill_tokens` for prompt chunks), then `schedule_prompts` adds the policy's
    own work to the step."""

    name: str
    # Whether `schedule_prompts` spends the step's token budget (and so the step-time cap, which
    # is worked out only for policies that read it).
    uses_token_budget: bool
    # Whether `schedules_itself` is False for every sequence (the running loop's array fast
    # path then asks no sequence).
    never_schedules_itself: bool

    def schedules_itself(self, seq: Sequence) -> bool:
        """Whether the running `seq` is left out of the scheduler's running loop because
        `schedule_prompts` schedules it."""

    def num_prefill_tokens(self, seq: Sequence, token_budget: int) -> int:
        """Tokens of `seq` to compute now; at most `token_budget`, at least 1 if the budget allows."""

    def schedule_prompts(self, scheduler: Scheduler, out: SchedulerOutput, token_budget: int) -> None:
        """After the running loop: add this step's prompt work to `out`, admitting waiting prompts
        with `scheduler.admit`. `token_budget`: tokens the step may still take (under the
        step-time cap when there is one)."""

    def step_done(self, out: SchedulerOutput) -> None:
        """The step `out` ran (`Scheduler.update_from_output`)."""

    def drop(self, seq: Sequence) -> None:
        """`seq` left the running set (preempted, finished, failed): forget any state about it."""

    def layered_settings(self) -> LayeredSettings | None:
        """The layered-prefill settings (what a replay needs to rebuild the policy), None for a
        policy that is not layered."""


class ChunkedPrefill:
    """Sarathi chunked prefill: a prompt takes whatever the step's token budget has left."""

    name = "chunked"
    uses_token_budget = True
    never_schedules_itself = True

    def schedules_itself(self, seq: Sequence) -> bool:
        return False  # running prompts take their next chunk in the running loop

    def num_prefill_tokens(self, seq: Sequence, token_budget: int) -> int:
        return min(seq.num_uncomputed_tokens, token_budget)

    def schedule_prompts(self, scheduler: Scheduler, out: SchedulerOutput, token_budget: int) -> None:
        """Admit waiting prompts in order while the budget, `max_num_seqs` and free blocks allow,
        and only when nothing had to be preempted: they would evict each other."""
        while not out.preempted and scheduler.waiting and token_budget > 0 and scheduler.has_room:
            seq = scheduler.waiting[0]
            scheduler.block_manager.claim_prefix(seq)
            n = self.num_prefill_tokens(seq, token_budget)
            if n <= 0 or not scheduler.block_manager.can_allocate(seq, n):
                scheduler.block_manager.unclaim_prefix(seq)
                break
            scheduler.admit(seq, n)
            out.seqs.append(seq)
            out.num_scheduled_tokens.append(n)
            token_budget -= n

    def step_done(self, out: SchedulerOutput) -> None:
        """Nothing to advance: chunked prefill keeps no state across steps."""

    def drop(self, seq: Sequence) -> None:
        """Nothing to forget: chunked prefill keeps no state across steps."""

    def layered_settings(self) -> None:
        return None


class LayeredPrefill:
    """Layered prefill ("From Tokens to Layers"): the model's layers are cut into G contiguous
    groups; a cohort of newly admitted prompt chunks passes one group per step, alongside
    the decode batch that runs through every layer. So decode never stalls behind a prompt,
    and each prompt token meets each MoE layer once per chunk.

    G = num_layer_groups, or max(1, ceil(cohort tokens / group_tokens)) (or the group table's)
    capped by max_layer_groups, at most the layers (LayeredSettings.groups). Short prompts
    admitted together share a cohort; a prompt longer than the chunk limit passes in several
    cohorts, each layer group by layer group. Prompts never take the step's token budget: a
    cohort is bounded by `chunk_tokens` instead."""

    name = "layered"
    uses_token_budget = False  # a cohort is bounded by its chunk limit, not the step's budget
    never_schedules_itself = False

    def __init__(self, settings: LayeredSettings) -> None:
        self.settings = settings
        self.num_layers, self.chunk_tokens = settings.num_layers, settings.chunk_tokens
        self.cohort: list[Sequence] = []
        self.chunk: list[int] = []  # tokens of each cohort member's chunk
        self.group = 0
        self.bounds: list[tuple[int, int]] = []  # layer range of each group
        self._member_ids: set[int] = set()  # id() of each cohort member

    def schedules_itself(self, seq: Sequence) -> bool:
        """Prompts advance in cohorts (a one-token prompt too), never in the running loop."""
        return seq.num_uncomputed_tokens > 1 or self.in_cohort(seq)

    def num_prefill_tokens(self, seq: Sequence, token_budget: int) -> int:
        return min(seq.num_uncomputed_tokens, token_budget)

    def in_cohort(self, seq: Sequence) -> bool:
        return id(seq) in self._member_ids

    def schedule_prompts(self, scheduler: Scheduler, out: SchedulerOutput, token_budget: int) -> None:
        """Form a cohort when none is in flight (and nothing had to be preempted), then pass its
        next group. The token budget does not apply."""
        if not self.cohort and not out.preempted:
            self._form_cohort(scheduler)
        if self.cohort:
            order = sorted(range(len(self.cohort)), key=lambda j: self.chunk[j] > 1)
            out.layered = LayeredPass([self.cohort[j] for j in order], [self.chunk[j] for j in order],
                                      self.bounds[self.group], self.group, len(self.bounds))

    def _form_cohort(self, scheduler: Scheduler) -> None:
        members, chunk, total = [], [], 0
        # Long prompts already running (their next chunk) first, then waiting prompts in order.
        candidates = [s for s in scheduler.running if s.num_uncomputed_tokens > 1]
        for seq in candidates + list(scheduler.waiting):
            waiting = seq.status is SequenceStatus.WAITING
            if waiting and scheduler.has_room:  # a cached prefix skips every layer group
                scheduler.block_manager.claim_prefix(seq)
            n = min(seq.num_uncomputed_tokens, self.chunk_tokens - total)
            # Unless cohorts fill (LayeredSettings.fill_cohorts), only the first member may be cut
            # to fit: a prompt split over two cohorts would wait for both, and a smaller cohort
            # passes its groups sooner.
            cut_later_member = members and n < seq.num_uncomputed_tokens and not self.settings.fill_cohorts
            if cut_later_member or n <= 0 or (waiting and not scheduler.has_room) \
                    or not scheduler.block_manager.can_allocate(seq, n):
                if waiting:
                    scheduler.block_manager.unclaim_prefix(seq)
                break
            if waiting:
                scheduler.admit(seq, n)
            else:
                scheduler.block_manager.allocate(seq, n)
            members.append(seq)
            chunk.append(n)
            total += n
        if members:
            self.start(members, chunk)

    def start(self, seqs: list[Sequence], chunk: list[int]) -> None:
        groups = self.settings.groups(sum(chunk))
        cuts = [round(i * self.num_layers / groups) for i in range(groups + 1)]
        self.cohort, self.chunk, self.group = list(seqs), list(chunk), 0
        self._member_ids = {id(s) for s in seqs}
        self.bounds = list(zip(cuts, cuts[1:]))

    def step_done(self, out: SchedulerOutput) -> None:
        """A step that carried the cohort moves it on to its next group."""
        if out.layered is not None:
            self.advance()

    def advance(self) -> None:
        self.group += 1
        if self.group >= len(self.bounds):
            self._clear()

    def drop(self, seq: Sequence) -> None:
        """A member left (preempted, aborted, failed); the others go on."""
        for i, s in enumerate(self.cohort):
            if s is seq:
                del self.cohort[i], self.chunk[i]
                self._member_ids.discard(id(seq))
                break
        if not self.cohort:
            self._clear()

    def layered_settings(self) -> LayeredSettings:
        return self.settings

    def _clear(self) -> None:
        self.cohort, self.chunk, self.bounds, self.group = [], [], [], 0
        self._member_ids: set[int] = set()


def make_prefill_policy(config: EngineConfig, num_layers: int = 1) -> PrefillPolicy:
    if config.prefill_policy == "layered":
        return LayeredPrefill(config.layered_settings(num_layers))
    return ChunkedPrefill()


def chunk_work(seqs: list[Sequence], num_tokens: list[int]) -> tuple[int, float, float]:
    """Tokens, attention query-key pairs and cached tokens read for chunks starting at each
    sequence's computed prefix (causal inside a chunk): what prices a step."""
    if len(seqs) > 64:  # a real step's thousands of sequences: array sums, exact in integers
        p = np.fromiter(map(COMPUTED, seqs), np.int64, len(seqs))
        n = np.asarray(num_tokens, dtype=np.int64)
        return int(n.sum()), float(int((n * p).sum()) + int((n * (n + 1) // 2).sum())), float(int((p + n).sum()))
    tokens, pairs, kv = 0, 0.0, 0.0
    for seq, n in zip(seqs, num_tokens):
        p = seq.num_computed_tokens
        tokens += n
        pairs += n * p + n * (n + 1) / 2
        kv += p + n
    return tokens, pairs, kv


class StepTimeCap(Protocol):
    """Attention balancing: how many prompt tokens may join a step that already carries the
    given decode work before its predicted time passes the target."""

    def prefill_tokens(self, tokens: int, seqs: int, kv_tokens: float) -> int:
        """Prompt tokens that fit (0 when the decodes alone fill the target)."""


def prompt_budget(cap: StepTimeCap, out: SchedulerOutput, budget: int) -> int:
    """The token budget left for prompt chunks under the step-time cap, after the decodes in
    `out`. A step with no decodes always takes some prompt: it would otherwise never run."""
    tokens, _, kv = chunk_work(out.seqs, out.num_scheduled_tokens)
    cap_tokens = cap.prefill_tokens(tokens, len(out.seqs), kv)
    return min(budget, cap_tokens if out.seqs else max(cap_tokens, 1))


def schedule_all_decodes(out: SchedulerOutput, running: deque[Sequence], blocks: BlockManager,
                         policy: PrefillPolicy, uncomputed: list[int], budget: int) -> int:
    """The running loop's common case at once: every running sequence a one-token decode
    the policy leaves to the loop, within the budget, and the blocks the ones at a block's
    end need are free. Array work, no per-sequence branch; returns how many it scheduled
    (0: the loop does it all, preempting where it must)."""
    n = len(running)
    if n > budget or uncomputed.count(1) != n or \
            (not policy.never_schedules_itself and any(map(policy.schedules_itself, running))):
        return 0
    computed = np.fromiter(map(COMPUTED, running), np.int64, n)
    room = np.fromiter(map(len, map(BLOCK_TABLE, running)), np.int64, n) * blocks.block_size
    full = np.flatnonzero(computed >= room).tolist()
    if len(full) * blocks.tables_per_sequence > blocks.num_free_blocks:  # before any window releases
        return 0
    for k in full:
        blocks.allocate(running[k], 1)
    out.seqs.extend(running)
    out.num_scheduled_tokens.extend([1] * n)
    return n


class Scheduler:
    def __init__(self, block_manager: BlockManager, policy: PrefillPolicy, *, max_num_seqs: int,
                 max_num_batched_tokens: int, max_model_len: int, eos_token_ids: Iterable[int] = (),
                 clock: Callable[[], float] = time.monotonic, step_cap: StepTimeCap | None = None) -> None:
        self.step_cap = step_cap  # None: a step is bounded by its token budget alone
        self.block_manager = block_manager
        self.clock = clock  # token timestamps; the simulator passes its virtual clock
        self.policy = policy
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens  # tokens per step
        self.max_model_len = max_model_len
        # Takes each step that ran back into its sequences (tokens, times, stop conditions).
        self.tokens = TokenRecorder(max_model_len, eos_token_ids, self._end)
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.requests: dict[str, Sequence] = {}  # every unfinished sequence by request id
        self.num_preemptions = 0
        self.num_finished = 0  # sequences finished so far, however they ended

    @classmethod
    def from_config(cls, config: EngineConfig, *, num_blocks: int, max_model_len: int,
                    eos_token_ids: Iterable[int], num_layers: int = 1, window: int = 0,
                    prefix_salt: bytes | None = None) -> "Scheduler":
        """`window`: the model's sliding window where it mixes windowed and full-attention layers
        (sequences then hold window tables, kv_cache.BlockManager). `prefix_salt`: prefix caching
        on, blocks named under this salt (prefix_hash.model_salt)."""
        return cls(BlockManager(num_blocks, config.block_size, window, prefix_salt),
                   make_prefill_policy(config, num_layers),
                   max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
                   max_model_len=max_model_len, eos_token_ids=eos_token_ids)

    # -- queue ---------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        if seq.request_id in self.requests:
            raise ValueError(f"request id {seq.request_id!r} is already in the scheduler")
        seq.status = SequenceStatus.WAITING
        self.requests[seq.request_id] = seq
        self.waiting.append(seq)

    def abort(self, request_id: str) -> Sequence | None:
        seq = self.requests.get(request_id)
        if seq is None:
            return None
        self._end(seq, FinishReason.ABORT)
        return seq

    def stop(self, seq: Sequence, stop_reason: str) -> None:
        """Finish `seq` on a stop string found in its text, freeing its blocks at once. A sequence
        that already finished on this token (its length) is stopped by the string instead."""
        if not seq.is_finished:  # advanced ahead, it may have been preempted meanwhile (`_end`)
            self._end(seq, FinishReason.STOP)
        seq.finish_reason = FinishReason.STOP
        seq.stop_reason = stop_reason

    def fail(self, seq: Sequence, error: str) -> None:
        """Finish one sequence with an error, freeing its blocks; the others go on."""
        if seq.is_finished:
            return
        seq.error = error
        self._end(seq, FinishReason.ERROR, keep_cache=False)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    # -- one step ------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        blocks = self.block_manager
        # Decodes before prefill chunks (stable): decodes never wait behind a prompt, and
        # the preemption victims taken from the tail are always not-yet-scheduled ones.
        running = self.running
        uncomputed = list(map(operator.sub, map(len, map(TOKEN_IDS, running)), map(COMPUTED, running)))
        if max(uncomputed, default=0) > 1:
            prompt = [u > 1 for u in uncomputed]
            if prompt != sorted(prompt):
                self.running = deque(sorted(running, key=lambda s: len(s.token_ids) - s.num_computed_tokens > 1))
        capped = self.step_cap is None or not self.policy.uses_token_budget
        block_size, schedules_itself = blocks.block_size, self.policy.schedules_itself
        i = schedule_all_decodes(out, self.running, blocks, self.policy, uncomputed, budget) if uncomputed else 0
        budget -= i
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if schedules_itself(seq):
                i += 1
                continue
            uncomputed = len(seq.token_ids) - seq.num_computed_tokens
            # The common case, written out (it runs for every decode of every step): one token
            # whose KV fits the sequence's last block.
            if uncomputed == 1 and seq.num_computed_tokens < len(seq.block_table) * block_size:
                out.seqs.append(seq)
                out.num_scheduled_tokens.append(1)
                budget -= 1
                i += 1
                continue
            if uncomputed > 1 and not capped:  # the decodes are in: cap the prompts
                budget, capped = prompt_budget(self.step_cap, out, budget), True
                if budget <= 0:
                    break
            n = 1 if uncomputed == 1 else self.policy.num_prefill_tokens(seq, budget)
            if n <= 0:
                break
            while not blocks.can_allocate(seq, n):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                blocks.allocate(seq, n)
                out.seqs.append(seq)
                out.num_scheduled_tokens.append(n)
                budget -= n
                i += 1
                continue
            break
        if not capped:
            budget = prompt_budget(self.step_cap, out, budget)
        self.policy.schedule_prompts(self, out, budget)
        return out.single_tokens_first()

    @property
    def has_room(self) -> bool:
        """Whether one more sequence may start running (`max_num_seqs`)."""
        return len(self.running) < self.max_num_seqs

    def admit(self, seq: Sequence, num_tokens: int) -> None:
        """A waiting prompt starts running: blocks for its first `num_tokens`, to the running set."""
        self.block_manager.count_lookup(seq)
        if seq.first_scheduled_time is None:
            seq.num_cached_tokens = seq.num_computed_tokens
        self.block_manager.allocate(seq, num_tokens)
        self.waiting.remove(seq)
        seq.status = SequenceStatus.RUNNING
        if seq.first_scheduled_time is None:
            seq.first_scheduled_time = self.clock()
        self.running.append(seq)

    def update_from_output(self, out: SchedulerOutput, sampled: list[int | None]) -> list[Sequence]:
        """Advance each scheduled sequence; `sampled[i]` is the new token of `out.seqs[i]`, or
        None where that sequence was mid-prompt. Returns the sequences that gained a token."""
        advanced = self.tokens.record(out, sampled, self.clock())
        self.block_manager.register_prompt_chunks(out)
        self.policy.step_done(out)
        return advanced

    # -- asynchronous scheduling: step n+1 scheduled before step n's tokens are known ----------
    def advance_ahead(self, out: SchedulerOutput) -> None:
        """While step `out` is still running: every sequence as if the step were done (its
        computed tokens counted, a sequence that samples holding `PLACEHOLDER` for its token),
        so `schedule` forms the next step now (vLLM's async scheduling). A sequence that stops on
        this token runs in the next step too; its token there is dropped (`settle`). Only steps
        without a layered cohort: a cohort's group advances in `update_from_output`."""
        self.tokens.advance_ahead(out)
        self.block_manager.register_prompt_chunks(out)
        self.policy.step_done(out)

    def place(self, out: SchedulerOutput, sampled: list[int | None]) -> None:
        """Step `out`'s tokens into the places `advance_ahead` held for them (what the next
        step's inputs read), nothing else."""
        self.tokens.place(out, sampled)

    def settle(self, out: SchedulerOutput, sampled: list[int | None], start: int = 0,
               stop: int | None = None) -> list[Sequence]:
        """The rest of `update_from_output` for a step advanced ahead (its sequences `start` to
        `stop`): the token times and the stop conditions; a sequence that stops is finished now
        (its token in the running step is dropped, its blocks taken only by a later schedule).
        Returns the sequences that gained a token, as `update_from_output`."""
        return self.tokens.settle(out, sampled, self.clock(), start, stop)

    # -- internals -----------------------------------------------------------------------
    def _preempt(self, seq: Sequence) -> None:
        self.policy.drop(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _end(self, seq: Sequence, reason: FinishReason, keep_cache: bool = True) -> None:
        """`seq` leaves its queue and finishes. Advanced ahead, a sequence that stops may have been
        preempted meanwhile: it waits, not runs. `keep_cache` False: a failed sequence's blocks
        are not kept for later prompts (its last step's KV may not have been written)."""
        (self.waiting if seq.status is SequenceStatus.WAITING else self.running).remove(seq)
        self.num_finished += 1
        self.policy.drop(seq)
        self.block_manager.free(seq, keep_cache)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.requests.pop(seq.request_id, None)
