"""What an engine's clients see of their requests (vLLM's output processor): each unfinished
request's `OutputStream` (its text so far, its stop strings, its prompt logprobs), and the
deltas each step makes from them once the scheduler has advanced its sequences.

The deltas are made for every sequence of every step (2,290 a step at the shipped plan's
scale), so `deltas` is written for that loop: names bound to locals, and a fast path, straight
into the columns, for a running request that asked for nothing but text.
"""

from __future__ import annotations

from megainfer.engine.output_stream import OutputStream
from megainfer.messages import DeltaColumns, ErrorCode, PositionLogprobs, RequestDelta, RequestMetrics
from megainfer.runner.model_runner import StepResult
from megainfer.runner.sampler import Sampler
from megainfer.scheduling.scheduler import Scheduler
from megainfer.scheduling.scheduler_output import SchedulerOutput
from megainfer.scheduling.sequence import Sequence, SequenceStatus
from megainfer.tokenizer import Tokenizer


class OutputProcessor:
    """The output streams of one engine's requests, by request id, and the deltas made from them.

    A request's stream opens when it joins the scheduler and is forgotten when it ends (finished,
    failed or aborted), together with what the sampler keeps for it (its seeded generator)."""

    def __init__(self, scheduler: Scheduler, tokenizer: Tokenizer | None, sampler: Sampler) -> None:
        self.scheduler = scheduler  # stops a request at its stop string, fails one, tells the time
        self.tokenizer = tokenizer
        self.sampler = sampler
        self._streams: dict[str, OutputStream] = {}  # by request id: what its client has seen

    def open(self, seq: Sequence) -> None:
        """A stream for a request the scheduler has just taken."""
        self._streams[seq.request_id] = OutputStream(self.tokenizer, seq)

    def forget(self, request_id: str) -> None:
        """Drop what is kept for a request that ended (or was never known: nothing happens)."""
        self._streams.pop(request_id, None)
        self.sampler.forget(request_id)

    def deltas(self, out: SchedulerOutput, result: StepResult, advanced: list[Sequence],
               prompt_logprobs: bool = True) -> DeltaColumns:
        """The step's deltas: one per sequence of `advanced` that gained a token. Prompt logprobs
        computed this step are kept until the request's first delta (`prompt_logprobs` False: a
        later piece of a step made in pieces, whose first piece took them)."""
        seqs = out.all_seqs
        for i, (first_position, entries) in (result.prompt_logprobs.items() if prompt_logprobs else ()):
            stream = self._streams.get(seqs[i].request_id)
            if stream is not None and not seqs[i].is_finished:
                stream.add_prompt_logprobs(first_position, entries)
        logprobs = {seqs[i].request_id: entry for i, entry in result.logprobs.items()}
        columns = DeltaColumns()
        ids, tokens, texts, others = columns.request_ids, columns.token_ids, columns.texts, columns.others
        streams, running = self._streams, SequenceStatus.RUNNING
        for seq in advanced:
            # Runs for every sequence of every step. A request that asked for nothing but text
            # (no stop strings, no logprobs) and runs on gives its token and the text it completes
            # straight into the columns; any other goes through `_delta`.
            stream = streams[seq.request_id]
            if stream.plain and seq.status is running:
                token = seq.token_ids[-1]
                try:
                    text = stream.detokenizer.add_one(token)
                except Exception as exc:  # a token the tokenizer cannot decode: this request alone fails
                    others.append((len(ids), self._undecodable(seq, token, exc)))
                    continue
                ids.append(seq.request_id)
                tokens.append(token)
                texts.append(text)
            else:
                others.append((len(ids), self._delta(seq, logprobs.get(seq.request_id))))
        return columns

    def _delta(self, seq: Sequence, logprobs: PositionLogprobs | None) -> RequestDelta:
        # Runs for every sequence of every step: no property calls, prompt logprobs looked at
        # only where the request asked for them.
        token = seq.token_ids[-1]
        stream = self._streams[seq.request_id]
        try:
            text = stream.next_text(seq)
            token_logprobs = stream.with_text([logprobs]) if logprobs is not None else None
            prompt_logprobs = stream.take_prompt_logprobs() if stream.prompt_logprobs is not None and \
                len(seq.token_ids) - len(seq.prompt_token_ids) == 1 else None
        except Exception as exc:  # e.g. a token the tokenizer cannot decode: this request alone fails
            return self._undecodable(seq, token, exc)
        stops = stream.stops
        if stops is not None and stops.stop_string is not None:  # finished now: blocks freed before the next step
            self.scheduler.stop(seq, stops.stop_string)
        finished = seq.status is SequenceStatus.FINISHED
        delta = RequestDelta(seq.request_id, [token], text, finished, seq.finish_reason, None, None, token_logprobs,
                             prompt_logprobs, seq.stop_reason)
        if finished:
            delta.metrics = self.metrics(seq)
            self.forget(seq.request_id)
        return delta

    def _undecodable(self, seq: Sequence, token: int, exc: Exception) -> RequestDelta:
        """The last delta of a request whose text could not be made: it alone fails."""
        return self.fail(seq, f"detokenization failed: {exc!r}", new_token_ids=[token])

    def fail(self, seq: Sequence, error: str, new_token_ids: list[int] | None = None,
             code: ErrorCode = ErrorCode.INTERNAL) -> RequestDelta:
        """Fail a request (the scheduler frees its blocks) and make its last delta."""
        self.scheduler.fail(seq, error)
        self.forget(seq.request_id)
        delta = RequestDelta.failure(seq.request_id, error, code, new_token_ids)
        delta.metrics = self.metrics(seq)
        return delta

    def metrics(self, seq: Sequence) -> RequestMetrics | None:
        """How the request's time was spent, as it ends; None if it was never scheduled. One that
        ends before its first token counts its time since being scheduled as prefill."""
        scheduled = seq.first_scheduled_time
        if scheduled is None:
            return None
        now = self.scheduler.clock()
        first_token = seq.first_token_time
        return RequestMetrics(
            prompt_tokens=seq.num_prompt_tokens, generation_tokens=seq.num_output_tokens,
            queued_s=scheduled - seq.arrival_time,
            prefill_s=(now if first_token is None else first_token) - scheduled,
            decode_s=0.0 if first_token is None else seq.last_token_time - first_token,
            e2e_s=now - seq.arrival_time, num_preemptions=seq.num_preemptions, cached_tokens=seq.num_cached_tokens)
