"""One API request's completions, as every frontend serves them: the gRPC service
(`server/service.py`), the OpenAI HTTP API (`server/choice_streams.py`), the offline `LLM`
(`llm.py`) and `megainfer generate` (`cli/generate.py`).

A request of p prompts with n completions each is p × n engine requests (an engine request is
one sequence): completion `index` = prompt × n + choice, its engine id `"<request id>-<index>"`
(one rule, whatever n), its parameters `SamplingParams.for_choice(choice)`. What the group
settles once for all of them:

- **starting**: all or none (one refused aborts those started, then the refusal is raised);
- **the prompt's logprobs** are computed once per prompt, by its choice 0, and shared; a
  prompt's other choices' deltas are held back until choice 0's first delta brought them, so
  a stream shows them first (gRPC's first response, HTTP's echoed prompt);
- **the abort race**: a completion's first last delta counts — its own, or the "abort" one an
  abort puts in its place — and any delta after it is passed over;
- **timing**: each completion's first and latest token, the gaps between tokens.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from megainfer.messages import FinishReason, PositionLogprobs, RequestDelta
from megainfer.sampling_params import SamplingParams


def engine_request_id(request_id: str, index: int) -> str:
    """The engine's id of completion `index` of API request `request_id`."""
    return f"{request_id}-{index}"


@dataclass
class GroupPrompt:
    """One prompt of the request: what the engine takes (text or token ids) and its token ids
    where the frontend tokenized it; `text` is what an echo prepends."""

    prompt: str | list[int]
    params: SamplingParams  # the request's, n included
    text: str = ""
    token_ids: list[int] = field(default_factory=list)  # once known: given, or as the engine tokenized it
    num_tokens: int = 0  # its length, once known (a server's backend counts a text prompt's)
    logprobs: list[PositionLogprobs | None] | None = None  # its prompt logprobs, once choice 0 brought them
    logprobs_arrived: bool = False

    def __post_init__(self) -> None:
        if not self.token_ids and isinstance(self.prompt, list):
            self.token_ids = self.prompt
        self.num_tokens = self.num_tokens or len(self.token_ids)


@dataclass
class Completion:
    """One engine request of the group and what its deltas brought."""

    index: int  # in the response: prompt × n + choice
    engine_id: str
    params: SamplingParams  # one sequence's (`for_choice`)
    source: GroupPrompt
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    last: RequestDelta | None = None  # the final delta, once it came (or the abort in its place)
    started_at: float = 0.0  # time.monotonic() when it was handed to the engine
    first_token_at: float | None = None
    last_token_at: float | None = None

    @property
    def ended(self) -> bool:
        return self.last is not None

    @property
    def finish_reason(self) -> FinishReason | None:
        return None if self.last is None else self.last.finish_reason

    @property
    def stop_reason(self) -> int | str | None:
        return None if self.last is None else self.last.stop_reason

    @property
    def prompt_logprobs(self) -> list[PositionLogprobs | None] | None:
        return self.source.logprobs

    def add(self, delta: RequestDelta, now: float) -> float | None:
        """Take a delta; returns the gap since this completion's previous token, if it brought
        tokens after one."""
        self.text.append(delta.new_text)
        self.token_ids += delta.new_token_ids
        self.logprobs += delta.logprobs or []
        if delta.prompt_logprobs is not None:
            self.source.logprobs = delta.prompt_logprobs
        if delta.finished:
            self.last = delta
        if not delta.new_token_ids:
            return None
        gap = None if self.last_token_at is None else now - self.last_token_at
        self.first_token_at = self.first_token_at or now
        self.last_token_at = now
        return gap

    def ttft_s(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.started_at

    def tpot_s(self) -> float | None:
        tokens = len(self.token_ids)
        return (self.last_token_at - self.first_token_at) / (tokens - 1) if tokens > 1 else None


class RequestGroup:
    def __init__(self, request_id: str, prompts: list[GroupPrompt]) -> None:
        self.request_id = request_id
        self.prompts = prompts
        self.completions: list[Completion] = []
        for p, prompt in enumerate(prompts):
            n = prompt.params.n
            prompt.logprobs_arrived = prompt.params.prompt_logprobs is None
            for choice in range(n):
                params = prompt.params.for_choice(choice)
                if choice:  # the prompt's logprobs are computed once, by its choice 0
                    params = params.replace(prompt_logprobs=None)
                index = p * n + choice
                self.completions.append(Completion(index, engine_request_id(request_id, index), params, prompt))
        self._held: list[tuple[Completion, RequestDelta]] = []

    @classmethod
    def of(cls, request_id: str, prompt: str | list[int], params: SamplingParams, text: str = "") -> "RequestGroup":
        """A request of one prompt."""
        return cls(request_id, [GroupPrompt(prompt, params, text)])

    # -- starting and stopping ------------------------------------------------------------------
    def start(self, submit: Callable, abort: Callable[[str], bool]) -> list:
        """`submit(engine id, prompt, params)` each completion, returning what each returned; if
        one raises, `abort` those started and re-raise."""
        started = []
        try:
            for c in self.completions:
                c.started_at = time.monotonic()
                started.append(submit(c.engine_id, c.source.prompt, c.params))
        except BaseException:
            for c in self.completions[:len(started)]:
                abort(c.engine_id)
            raise
        return started

    def abort_deltas(self) -> list[tuple[Completion, RequestDelta]]:
        """For every completion still running, the "abort" last delta that ends it (any thread).
        The caller aborts its engine request and delivers the delta where the completion's own
        would have come: the engine forgets an aborted request either way, so one whose own last
        delta was not yet handed over would never end otherwise; one whose own came first keeps
        it, and the abort is passed over (`arrived`)."""
        return [(c, RequestDelta(c.engine_id, [], "", True, FinishReason.ABORT))
                for c in list(self.completions) if not c.ended]

    # -- deltas -----------------------------------------------------------------------------------
    def arrived(self, c: Completion, delta: RequestDelta, now: float | None = None
                ) -> tuple[list[tuple[Completion, RequestDelta]], float | None]:
        """Take completion `c`'s delta: returns the (completion, delta) pairs to show now, in
        order (none while held back for the prompt's logprobs; several when the wait ends), and
        the gap since `c`'s previous token (None without one)."""
        if c.ended:  # an abort raced its own last delta: the first one counts
            return [], None
        gap = c.add(delta, time.monotonic() if now is None else now)
        source = c.source
        if source.logprobs_arrived:
            return [(c, delta)], gap
        if c.index % source.params.n:  # not the prompt's choice 0, which brings its logprobs
            self._held.append((c, delta))
            return [], gap
        source.logprobs_arrived = True
        released = [(h, d) for h, d in self._held if h.source is source]
        self._held = [(h, d) for h, d in self._held if h.source is not source]
        return [(c, delta), *released], gap

    # -- what it came to ------------------------------------------------------------------------
    @property
    def finished(self) -> bool:
        return all(c.ended for c in self.completions)

    @property
    def prompt_tokens(self) -> int:
        """Each prompt's tokens once, however many completions it had."""
        return sum(p.num_tokens for p in self.prompts)

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens served from the prefix cache: each prompt's, as its completions that ran
        report them (the most of them: a prompt's n completions may find different amounts)."""
        cached = {}
        for c in self.completions:
            metrics = c.last.metrics if c.last is not None else None
            if metrics is not None:
                key = id(c.source)
                cached[key] = max(cached.get(key, 0), metrics.cached_tokens)
        return sum(cached.values())

    @property
    def completion_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.completions)
