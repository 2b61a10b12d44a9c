"""Taking a step's tokens back into its sequences: the other half of the scheduler.

`Scheduler` forms steps (queues, blocks, budget, preemption); `TokenRecorder` takes a step that
ran back into its sequences: each scheduled sequence's computed prefix moves on, a sequence that
sampled gains its token and the token's time, and one that meets a stop condition (EOS, a stop
token, `max_tokens`, the model's length) is handed to the scheduler to finish. Its loops run for
every sequence of every step: attributes are read once, nothing is called that need not be.
"""

from __future__ import annotations

from typing import Callable, Iterable

from megainfer.scheduling.scheduler_output import SchedulerOutput
from megainfer.scheduling.sequence import FinishReason, Sequence, SequenceStatus

# The token of a sequence whose step is still running while the next one is scheduled
# (`Scheduler.advance_ahead`); `Scheduler.place` writes the sampled token over it.
PLACEHOLDER = -1


class TokenRecorder:
    """Steps' sampled tokens into their sequences, timed at `now`, with the stop conditions.
    `finish(seq, reason)`: the scheduler ends a sequence that stopped (out of its queue, blocks
    freed)."""

    def __init__(self, max_model_len: int, eos_token_ids: Iterable[int],
                 finish: Callable[[Sequence, FinishReason], None]) -> None:
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self._finish = finish

    def record(self, out: SchedulerOutput, sampled: list[int | None], now: float) -> list[Sequence]:
        """Advance each sequence of step `out`; `sampled[i]` is the new token of `out.seqs[i]`, or
        None where that sequence was mid-prompt. Returns the sequences that gained a token."""
        advanced = []
        advance = self._advance
        for seq, n, token in zip(out.seqs, out.num_scheduled_tokens, sampled):
            advance(seq, n, token, now, advanced)
        if out.layered is not None:
            if out.layered.last:  # the chunks are now complete in every layer
                for seq, n, token in zip(out.layered.seqs, out.layered.num_tokens, sampled[len(out.seqs):]):
                    advance(seq, n, token, now, advanced)
        return advanced

    # -- asynchronous scheduling: step n+1 scheduled before step n's tokens are known ----------
    def advance_ahead(self, out: SchedulerOutput) -> None:
        """Every sequence of the still-running step `out` as if it were done: its computed
        tokens counted, a sequence that samples holding `PLACEHOLDER` for its token."""
        for seq, n in zip(out.seqs, out.num_scheduled_tokens):
            if seq.status is SequenceStatus.FINISHED:
                continue
            token_ids = seq.token_ids
            if seq.num_computed_tokens + n == len(token_ids):
                token_ids.append(PLACEHOLDER)
            seq.num_computed_tokens += n

    def place(self, out: SchedulerOutput, sampled: list[int | None]) -> None:
        """Step `out`'s tokens into the places `advance_ahead` held for them, nothing else."""
        self.place_rows(out.seqs, range(len(out.seqs)), sampled)

    def place_rows(self, seqs: list[Sequence], rows: Iterable[int], tokens: list[int | None]) -> None:
        """`place` for some of a step's sequences (as their micro-batch is sampled): `tokens[k]`
        is the token of `seqs[rows[k]]`, None for one that sampled none."""
        for i, token in zip(rows, tokens):
            if token is not None:
                token_ids = seqs[i].token_ids
                if token_ids and token_ids[-1] == PLACEHOLDER:
                    token_ids[-1] = token

    def settle(self, out: SchedulerOutput, sampled: list[int | None], now: float, start: int = 0,
               stop: int | None = None) -> list[Sequence]:
        """The rest of `record` for a step advanced ahead, its sequences `start` to `stop`: the
        token times and the stop conditions. Returns the sequences that gained a token."""
        advanced = []
        seqs = out.seqs
        if start or (stop is not None and stop < len(seqs)):
            seqs, sampled = seqs[start:stop], sampled[start:stop]
        for seq, token in zip(seqs, sampled):
            if token is not None and seq.status is not SequenceStatus.FINISHED:
                self._gained(seq, token, len(seq.token_ids), now, advanced)  # its token is the last one
        return advanced

    # -- one sequence --------------------------------------------------------------------------
    def _advance(self, seq: Sequence, n: int, token: int | None, now: float, advanced: list[Sequence]) -> None:
        # Runs for every sequence of every step: attributes read once, no property calls.
        if seq.status is SequenceStatus.FINISHED:  # aborted or failed while the step ran
            return
        seq.num_computed_tokens += n
        if token is None:
            return
        seq.token_ids.append(token)
        self._gained(seq, token, len(seq.token_ids), now, advanced)

    def _gained(self, seq: Sequence, token: int, num_tokens: int, now: float, advanced: list[Sequence]) -> None:
        """`seq` gained `token`, its `num_tokens`-th: timed, and finished if it stops there."""
        if seq.first_token_time is None:
            seq.first_token_time = now
        seq.last_token_time = now
        seq.token_times.append(now)
        advanced.append(seq)
        params = seq.params
        # The stop conditions asked only where one could hold (most decodes of a step: none).
        if num_tokens - len(seq.prompt_token_ids) >= params.max_tokens or num_tokens >= self.max_model_len \
                or token in self.eos_token_ids or params.stop_token_ids or params.min_tokens:
            reason = self.stop_reason(seq, token, num_tokens)
            if reason is not None:
                self._finish(seq, reason)

    def stop_reason(self, seq: Sequence, token: int, num_tokens: int) -> FinishReason | None:
        """Why `seq` stops at `token`, its `num_tokens`-th (None: it goes on). Sets the stop
        token as `seq.stop_reason`."""
        params = seq.params
        generated = num_tokens - len(seq.prompt_token_ids)
        # The sampler masks EOS and stop tokens while fewer than min_tokens were generated before
        # this one, so a stop token counts only past min_tokens: the two agree.
        if generated > params.min_tokens:
            if not params.ignore_eos and token in self.eos_token_ids:
                return FinishReason.STOP  # stop_reason stays None for EOS, as vLLM's
            if params.stop_token_ids and token in params.stop_token_ids:
                seq.stop_reason = token
                return FinishReason.STOP
        if generated >= params.max_tokens or num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None
