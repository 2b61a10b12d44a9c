"""OpenAI's request and response shapes for /v1/completions, /v1/chat/completions (whole and
streamed in chunks), /v1/models and errors, as pydantic models; vLLM's extra sampling fields
(top_k, min_p, repetition_penalty, min_tokens, stop_token_ids, ignore_eos, ...) beside OpenAI's.

A request field left unset takes the served model's generation_config default, then OpenAI's.
Fields OpenAI does not define are ignored with a warning, as vLLM does, except those known to
change the answer (structured output, beam search, function calling: ANSWER_CHANGING_EXTRAS);
those and the OpenAI fields megainfer cannot honour (logit_bias, tools, response_format other
than text, suffix, best_of > n) are refused rather than silently dropped.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from megainfer.errors import RequestError
from megainfer.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

COMPLETION_MAX_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions
# OpenAI's defaults for the fields generation_config.json may also set (temperature, top_p) and
# vLLM's neutral values for its own (top_k, min_p, repetition_penalty).
API_DEFAULTS: dict[str, Any] = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0,
                                "repetition_penalty": 1.0}


# Fields of vLLM's or OpenAI's older APIs that megainfer does not implement and that would change
# the answer if honoured: refused, where other unknown fields are only logged.
ANSWER_CHANGING_EXTRAS = frozenset({
    "guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend",
    "structured_outputs", "use_beam_search", "length_penalty", "functions", "function_call",
    "logits_processors", "allowed_token_ids", "bad_words"})


class OpenAIModel(BaseModel):
    """Requests keep unknown fields (to warn about them); responses are built, never parsed."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data: Any) -> Any:
        """OpenAI reads an explicit null as the field left out: it takes the default."""
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data

    def warn_ignored(self, where: str) -> list[str]:
        """Log the fields megainfer does not know; refuse those known to change the answer."""
        refused = sorted(set(self.model_extra or {}) & ANSWER_CHANGING_EXTRAS)
        if refused:
            raise RequestError(f"{', '.join(refused)}: not supported by megainfer (no structured output, beam "
                               "search, function calling or logits processors); leave these fields out")
        ignored = sorted(self.model_extra or {})
        if ignored:
            logger.warning("%s: ignoring fields megainfer does not know: %s", where, ", ".join(ignored))
        return ignored


class StreamOptions(OpenAIModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage on every chunk


class SamplingRequest(OpenAIModel):
    """Fields /v1/completions and /v1/chat/completions share."""

    model: str | None = None  # None: the first served model (vLLM allows it; OpenAI requires it)
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's extra sampling fields
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    prompt_logprobs: int | None = None
    cache_salt: str | None = None  # vLLM's: cached prefixes are shared only with requests of the same salt

    def check_supported(self) -> None:
        if self.logit_bias:
            raise RequestError("logit_bias is not supported by megainfer; leave it out")
        if self.stream_options is not None and not self.stream:
            raise RequestError("stream_options can only be given with stream=true")

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def sampling_params(self, defaults: dict[str, Any], max_tokens: int, logprobs: int | None) -> SamplingParams:
        """SamplingParams for this request: set fields, else the model's `defaults`, else OpenAI's.
        `max_tokens` is already resolved against the prompt's length (the caller knows it)."""
        def pick(name: str):
            value = getattr(self, name)
            if value is not None:
                return value
            return defaults.get(name, API_DEFAULTS[name])

        return SamplingParams(
            max_tokens=max_tokens, temperature=pick("temperature"), top_p=pick("top_p"), top_k=pick("top_k"),
            min_p=pick("min_p"), repetition_penalty=pick("repetition_penalty"), seed=self.seed, n=self.n,
            presence_penalty=self.presence_penalty or 0.0, frequency_penalty=self.frequency_penalty or 0.0,
            min_tokens=self.min_tokens, stop=self.stop or [], stop_token_ids=self.stop_token_ids or [],
            include_stop_str_in_output=self.include_stop_str_in_output, ignore_eos=self.ignore_eos,
            logprobs=logprobs, prompt_logprobs=self.prompt_logprobs, skip_special_tokens=self.skip_special_tokens,
            cache_salt=self.cache_salt)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats


Prompt = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(SamplingRequest):
    prompt: Prompt
    echo: bool = False
    logprobs: int | None = None  # the top-`logprobs` of each position, and the chosen token's
    suffix: str | None = None
    best_of: int | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.suffix:
            raise RequestError("suffix is not supported by megainfer; leave it out")
        if self.best_of is not None and self.best_of != self.n:
            raise RequestError(f"best_of={self.best_of} is not supported (only best_of == n, here {self.n}); "
                               "leave it out")

    def prompts(self) -> list[str | list[int]]:
        """One prompt or a batch, normalised to a list of text or token-id prompts."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        if not p:
            raise RequestError("prompt is empty: give a string, a list of strings, token ids or lists of token ids")
        return list(p)


class ChatMessage(OpenAIModel):
    """One message; fields beyond role and content (name, tool_calls, ...) reach the template,
    which checks them (`megainfer.chat_template.check_messages`)."""

    role: str
    content: str | list[dict[str, Any]] | None = None

    def for_template(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True)


class ResponseFormat(OpenAIModel):
    type: str = "text"


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens; wins when both are set
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: ResponseFormat | None = None
    # OpenAI's reasoning models' knob; reaches the chat template as `reasoning_effort` (gpt-oss's
    # harmony template writes it into the system message), unless chat_template_kwargs sets it.
    reasoning_effort: Literal["low", "medium", "high"] | None = None
    # vLLM's chat extras
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.tools and self.tool_choice != "none":
            raise RequestError("tools are not supported by megainfer (no tool-call parser); leave tools out or "
                               "set tool_choice to 'none'")
        if self.response_format is not None and self.response_format.type != "text":
            raise RequestError(f"response_format {self.response_format.type!r} is not supported (only 'text')")
        if self.top_logprobs is not None and not self.logprobs:
            raise RequestError("top_logprobs needs logprobs=true")

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def num_logprobs(self) -> int | None:
        """Top alternatives per position the engine must compute (None: no logprobs)."""
        return (self.top_logprobs or 0) if self.logprobs else None


# -- responses --------------------------------------------------------------------------------
class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> "Usage":
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens))


class CompletionLogprobs(BaseModel):
    """The legacy completions shape: one entry per token in each list."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)  # None: the prompt's first token
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)  # characters into the choice's text


class PromptLogprob(BaseModel):
    """vLLM's prompt_logprobs entry for one token id."""

    logprob: float
    rank: int
    decoded_token: str | None = None


PromptLogprobs = list[dict[int, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM: the stop token id or string that ended it
    prompt_logprobs: PromptLogprobs | None = None


def _now() -> int:
    return int(time.time())


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None
    prompt_logprobs: PromptLogprobs | None = None  # vLLM puts chat prompt logprobs here


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "megainfer"
    root: str | None = None  # the checkpoint directory, preset or hub id behind the served name
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
