"""Continuous batching over the paged KV cache. Plain Python, no model inside.

`schedule()` picks the sequences of the next step and how many tokens of each to
compute; `update_from_output()` takes the sampled tokens back, applies stop conditions and
frees finished sequences' blocks. The simulator drives this same class with a
performance model in place of a model.

Policy (Sarathi-style): running decodes first, one token each, then the prefill chunks of
running and newly admitted sequences until the step's token budget is spent. When the
KV cache runs out, the most recently admitted running sequence is preempted by
recompute: its blocks are freed, it returns to the front of the waiting queue, and later
recomputes its prompt and generated tokens as one prompt. Nothing is lost or repeated.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Iterable, Protocol

from megainfer.config import EngineConfig
from megainfer.kv_cache import BlockManager
from megainfer.sequence import FinishReason, Sequence, SequenceStatus


class PrefillPolicy(Protocol):
    """Decides how many not-yet-computed tokens of a prefilling sequence run this step."""

    name: str

    def num_prefill_tokens(self, seq: Sequence, token_budget: int) -> int:
        """Tokens of `seq` to compute now; at most `token_budget`, at least 1 if the budget allows."""


class ChunkedPrefill:
    """Sarathi chunked prefill: a prompt takes whatever the step's token budget has left."""

    name = "chunked"

    def num_prefill_tokens(self, seq: Sequence, token_budget: int) -> int:
        return min(seq.num_uncomputed_tokens, token_budget)


def make_prefill_policy(config: EngineConfig) -> PrefillPolicy:
    # EngineConfig validated the name; this table grows with the policies.
    return {"chunked": ChunkedPrefill}[config.prefill_policy]()


@dataclass
class SchedulerOutput:
    """What one step computes. Sequences with one query token come first (decodes, and
    one-token prefill chunks), then multi-token prefill chunks: attention kernels rely on
    that order."""

    seqs: list[Sequence] = field(default_factory=list)
    # Tokens computed this step for each entry of `seqs` (same order): the tokens from
    # seq.num_computed_tokens up to num_computed_tokens + n.
    num_scheduled_tokens: list[int] = field(default_factory=list)
    # Leading entries of `seqs` with exactly one scheduled token.
    num_single_token: int = 0
    # Sequences preempted (blocks freed, back to waiting) while forming this step.
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.seqs

    def samples(self) -> list[bool]:
        """Whether each sequence reaches its last token this step (and so samples a new one)."""
        return [s.num_computed_tokens + n == s.num_tokens for s, n in zip(self.seqs, self.num_scheduled_tokens)]


class Scheduler:
    def __init__(self, block_manager: BlockManager, policy: PrefillPolicy, *, max_num_seqs: int,
                 max_num_batched_tokens: int, max_model_len: int, eos_token_ids: Iterable[int] = ()) -> None:
        self.block_manager = block_manager
        self.policy = policy
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens  # tokens per step
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.requests: dict[str, Sequence] = {}  # every unfinished sequence by request id
        self.num_preemptions = 0

    @classmethod
    def from_config(cls, config: EngineConfig, *, num_blocks: int, max_model_len: int,
                    eos_token_ids: Iterable[int]) -> "Scheduler":
        return cls(BlockManager(num_blocks, config.block_size), make_prefill_policy(config),
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
        if seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        else:
            self.running.remove(seq)
        self._finish(seq, FinishReason.ABORT)
        return seq

    def fail(self, seq: Sequence, error: str) -> None:
        """Finish one sequence with an error, freeing its blocks; the others go on."""
        if seq.is_finished:
            return
        (self.waiting if seq.status is SequenceStatus.WAITING else self.running).remove(seq)
        seq.error = error
        self._finish(seq, FinishReason.ERROR)

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
        bm = self.block_manager
        # Decodes before prefill chunks (stable): decodes never wait behind a prompt, and
        # the preemption victims taken from the tail are always not-yet-scheduled ones.
        self.running = deque(sorted(self.running, key=lambda s: s.num_uncomputed_tokens > 1))
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = 1 if seq.num_uncomputed_tokens == 1 else self.policy.num_prefill_tokens(seq, budget)
            if n <= 0:
                break
            while not bm.can_allocate(seq, n):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                bm.allocate(seq, n)
                out.seqs.append(seq)
                out.num_scheduled_tokens.append(n)
                budget -= n
                i += 1
                continue
            break
        # New prompts only when nothing had to be preempted: they would evict each other.
        while not out.preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            n = self.policy.num_prefill_tokens(seq, budget)
            if n <= 0 or not bm.can_allocate(seq, n):
                break
            self.waiting.popleft()
            bm.allocate(seq, n)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.seqs.append(seq)
            out.num_scheduled_tokens.append(n)
            budget -= n
        order = sorted(range(len(out.seqs)), key=lambda j: out.num_scheduled_tokens[j] > 1)
        out.seqs = [out.seqs[j] for j in order]
        out.num_scheduled_tokens = [out.num_scheduled_tokens[j] for j in order]
        out.num_single_token = sum(1 for n in out.num_scheduled_tokens if n == 1)
        return out

    def update_from_output(self, out: SchedulerOutput, sampled: list[int | None]) -> list[Sequence]:
        """Advance each scheduled sequence; `sampled[i]` is the new token of `out.seqs[i]`, or
        None where that sequence was mid-prompt. Returns the sequences that gained a token."""
        advanced = []
        now = time.monotonic()
        for seq, n, token in zip(out.seqs, out.num_scheduled_tokens, sampled):
            if seq.is_finished:  # aborted or failed while the step ran
                continue
            seq.num_computed_tokens += n
            if token is None:
                continue
            seq.token_ids.append(token)
            if seq.first_token_time is None:
                seq.first_token_time = now
            seq.last_token_time = now
            advanced.append(seq)
            reason = self._stop_reason(seq, token)
            if reason is not None:
                self.running.remove(seq)
                self._finish(seq, reason)
        return advanced

    # -- internals -----------------------------------------------------------------------
    def _stop_reason(self, seq: Sequence, token: int) -> FinishReason | None:
        if token in seq.params.stop_token_ids or (not seq.params.ignore_eos and token in self.eos_token_ids):
            return FinishReason.STOP
        if seq.num_output_tokens >= seq.params.max_tokens or seq.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.requests.pop(seq.request_id, None)
