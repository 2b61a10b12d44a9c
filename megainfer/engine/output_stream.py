"""One request's output as its client sees it, built step by step by the engine: the text of
its tokens (detokenized, cut at a stop string, held back while it may still start one), the
logprobs with their tokens' text, and the prompt logprobs gathered over the steps that
computed the prompt (chunked or layered prefill may take several)."""

from __future__ import annotations

from megainfer.engine.stop_strings import StopStrings
from megainfer.messages import FinishReason, PositionLogprobs
from megainfer.scheduling.sequence import Sequence
from megainfer.tokenizer import IncrementalDetokenizer, Tokenizer


class OutputStream:
    def __init__(self, tokenizer: Tokenizer | None, seq: Sequence) -> None:
        params = seq.params
        self.tokenizer = tokenizer
        self.detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=params.skip_special_tokens)
        self.stops = StopStrings(params.stop, params.include_stop_str_in_output) if params.stop else None
        # One entry per prompt position, None at position 0 (nothing predicts it), as vLLM.
        self.prompt_logprobs: list[PositionLogprobs | None] | None = \
            [None] * seq.num_prompt_tokens if params.prompt_logprobs is not None else None
        # Asks for nothing but text: while it runs, a step's delta is its token and the text the
        # detokenizer completes (the engine's column fast path).
        self.plain = self.stops is None and params.logprobs is None and params.prompt_logprobs is None

    @property
    def stop_string(self) -> str | None:
        """The stop string found in the text, once found."""
        return self.stops.stop_string if self.stops is not None else None

    def next_text(self, seq: Sequence) -> str:
        """The text `seq`'s newest token lets the client see (maybe ""); at the end, all that was
        held back. Afterwards `stop_string` says whether the text reached a stop string."""
        params = seq.params
        # A stop token (EOS or a stop_token_id) that ended the request is no part of its text,
        # unless the stop is to be included (vLLM).
        stopped_by_token = seq.finish_reason is FinishReason.STOP
        new = "" if stopped_by_token and not params.include_stop_str_in_output else self.detokenizer.add(
            [seq.token_ids[-1]])
        if seq.is_finished:
            new += self.detokenizer.flush()
        if self.stops is None:
            return new
        # vLLM's min_tokens: no stop string may end in the text of the first min_tokens tokens.
        return self.stops.add(new, search=seq.num_output_tokens > params.min_tokens, final=seq.is_finished)

    def add_prompt_logprobs(self, first_position: int, entries: list[PositionLogprobs]) -> None:
        """Entries for the prompt positions from `first_position` on (a prompt recomputed after a
        preemption overwrites its own, equal, entries)."""
        if self.prompt_logprobs is not None:
            self.prompt_logprobs[first_position:first_position + len(entries)] = entries

    def take_prompt_logprobs(self) -> list[PositionLogprobs | None] | None:
        """The prompt logprobs with their text, once (for the first delta); None if not asked."""
        entries, self.prompt_logprobs = self.prompt_logprobs, None
        return self.with_text(entries) if entries is not None else None

    def with_text(self, entries: list[PositionLogprobs | None]) -> list[PositionLogprobs | None]:
        """`entries` with each token's own text filled in (None without a tokenizer)."""
        if self.tokenizer is None:
            return entries
        texts: dict[int, str] = {}
        for entry in entries:
            for token, logprob in (entry or {}).items():
                text = texts.get(token)
                if text is None:
                    text = texts[token] = self.tokenizer.token_text(token)
                logprob.decoded_token = text
        return entries
