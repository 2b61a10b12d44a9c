"""What the offline API (`LLM.generate`, `LLM.chat`) returns, in vLLM's shape: one `RequestOutput`
per prompt holding its n `CompletionOutput`s. (Servers stream `RequestDelta`s instead.)"""

from __future__ import annotations

from dataclasses import dataclass, field

from megainfer.messages import PositionLogprobs, RequestMetrics


@dataclass
class CompletionOutput:
    """One of a prompt's n completions (vLLM's fields, plus `error`)."""

    index: int  # which of the n, 0-based
    text: str
    token_ids: list[int]  # generated ids only
    cumulative_logprob: float | None  # sum of the generated tokens' logprobs; None unless logprobs were asked
    logprobs: list[PositionLogprobs] | None  # one per generated token, when SamplingParams.logprobs is set
    finish_reason: str | None  # "stop" | "length" | "abort" (vLLM's); "error" when it failed; None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    error: str | None = None  # why it failed, when finish_reason is "error" (its text is what came before)

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class OutputMetrics:
    """How one prompt's request went, on the LLM's clock (time.monotonic, seconds) and the engine's."""

    arrival_time: float  # when generate() queued it
    first_token_time: float | None = None  # the first token of any completion
    finished_time: float | None = None  # the last completion's end
    tbt_s: list[float] = field(default_factory=list)  # every gap between two tokens of one completion, seconds
    engine: list[RequestMetrics | None] = field(default_factory=list)  # per completion, from its last delta

    @property
    def ttft_s(self) -> float | None:
        """Arrival to the first generated token, seconds."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def latency_s(self) -> float | None:
        """Arrival to the end of the last completion, seconds."""
        return None if self.finished_time is None else self.finished_time - self.arrival_time

    @property
    def num_preemptions(self) -> int:
        return sum(m.num_preemptions for m in self.engine if m is not None)


@dataclass
class RequestOutput:
    """A prompt's request (vLLM's fields)."""

    request_id: str
    prompt: str | None  # the text generated from (a chat's rendered template); None for token ids
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobs | None] | None  # per prompt token (None for the first), when asked
    outputs: list[CompletionOutput]  # the n completions, by index
    finished: bool
    metrics: OutputMetrics | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (vLLM's field)
