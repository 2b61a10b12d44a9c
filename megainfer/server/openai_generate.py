"""/v1/completions and /v1/chat/completions: a request turned into engine requests (prompts
tokenized here, each prompt times n), and their deltas turned into OpenAI's response, whole or
as server-sent events."""

from __future__ import annotations

from collections.abc import AsyncIterator
from http import HTTPStatus

from pydantic import BaseModel

from megainfer.errors import RequestError
from megainfer.messages import FinishReason, RequestDelta
from megainfer.request_group import Completion, GroupPrompt, RequestGroup
from megainfer.server.choice_streams import ChoiceStreams
from megainfer.server.openai_errors import ApiError, failed_request
from megainfer.server.openai_logprobs import chat_logprobs, extend_completion_logprobs, prompt_logprobs
from megainfer.server.openai_protocol import (COMPLETION_MAX_TOKENS, AssistantMessage, ChatChoice, ChatChunkChoice,
                                              ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse,
                                              ChatLogprobs, CompletionChoice, CompletionLogprobs, CompletionRequest,
                                              CompletionResponse, DeltaMessage, Usage)
from megainfer.server.served_model import ServedModel
from megainfer.tokenizer import Tokenizer

DONE = "data: [DONE]\n\n"


def sse(payload: BaseModel) -> str:
    return f"data: {payload.model_dump_json()}\n\n"


def max_tokens_for(served: ServedModel, prompt_tokens: int, requested: int | None, default: int | None,
                   param: str, prompt_param: str, where: str = "") -> int:
    """The request's max_tokens, or the default cut to what the context has room for."""
    room = served.max_model_len - prompt_tokens
    if room < 1:
        raise ApiError(HTTPStatus.BAD_REQUEST, f"{where}this model's maximum context length is {served.max_model_len} "
                       f"tokens and the prompt has {prompt_tokens} (one more must be generated); shorten the prompt",
                       param=prompt_param, code="context_length_exceeded")
    if requested is None:
        return min(default, room) if default else room
    if requested > room:
        raise ApiError(HTTPStatus.BAD_REQUEST, f"{where}this model's maximum context length is {served.max_model_len} "
                       f"tokens; {prompt_tokens + requested} were requested ({prompt_tokens} in the prompt, "
                       f"{requested} for the completion); lower {param} or shorten the prompt",
                       param=param, code="context_length_exceeded")
    return requested


def _encode(tokenizer: Tokenizer, text: str, what: str, param: str, add_special_tokens: bool = True) -> list[int]:
    """`text`'s token ids; text no tokenizer takes is a 400 naming `what` (the field it came from)."""
    try:
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)
    except RequestError as exc:
        raise ApiError(HTTPStatus.BAD_REQUEST, f"{what}: {exc}", param=param) from None


def _finish(delta: RequestDelta) -> str | None:
    return delta.finish_reason.value if delta.finished and delta.finish_reason is not None else None


def _usage(group: RequestGroup) -> Usage:
    return Usage.of(group.prompt_tokens, group.completion_tokens, group.cached_tokens)


# -- /v1/completions --------------------------------------------------------------------------
def completion_group(served: ServedModel, body: CompletionRequest, request_id: str) -> RequestGroup:
    body.check_supported()
    prompts = body.prompts()
    tokenizer = served.tokenizer
    group = []
    for p, prompt in enumerate(prompts):
        where = f"prompt {p}: " if len(prompts) > 1 else ""
        if isinstance(prompt, str):
            if tokenizer is None:
                raise RequestError(f"{where}model {served.name} has no tokenizer; send the prompt as token ids")
            ids, text = _encode(tokenizer, prompt, f"prompt {p}" if where else "prompt", "prompt"), prompt
        else:
            ids, text = list(prompt), ""
            if body.echo and tokenizer is not None:
                try:
                    text = tokenizer.decode(ids, skip_special_tokens=False)
                except Exception as exc:  # an id the tokenizer does not know
                    raise RequestError(f"{where}prompt token ids cannot be decoded ({exc})") from None
        if not ids:
            raise RequestError(f"{where}prompt is empty")
        max_tokens = max_tokens_for(served, len(ids), body.max_tokens,
                                    served.defaults.get("max_tokens", COMPLETION_MAX_TOKENS), "max_tokens", "prompt",
                                    where)
        params = body.sampling_params(served.defaults, max_tokens, body.logprobs)
        if body.echo and body.logprobs is not None:  # the echoed prompt's tokens carry logprobs too
            params = params.replace(prompt_logprobs=max(body.logprobs, params.prompt_logprobs or 0))
        group.append(GroupPrompt(ids, params, text if body.echo else ""))
    return RequestGroup(request_id, group)


def _completion_logprobs(choice: Completion, body: CompletionRequest, served: ServedModel, token_ids: list[int],
                         positions: list, offset: int, with_prompt: bool) -> tuple[CompletionLogprobs, int]:
    out = CompletionLogprobs()
    if with_prompt:
        prompt_ids = choice.source.token_ids
        prompt_positions = choice.prompt_logprobs or [None] * len(prompt_ids)
        offset = extend_completion_logprobs(out, prompt_ids, prompt_positions, body.logprobs,
                                            served.tokenizer, offset)
    offset = extend_completion_logprobs(out, token_ids, positions, body.logprobs, served.tokenizer, offset)
    return out, offset


async def completion_response(streams: ChoiceStreams, body: CompletionRequest, served: ServedModel,
                              request_id: str) -> CompletionResponse:
    async for _, delta in streams.deltas():
        if delta.finish_reason is FinishReason.ERROR:
            raise failed_request(delta)
    choices = []
    for c in streams.completions:
        logprobs = None
        if body.logprobs is not None:
            logprobs, _ = _completion_logprobs(c, body, served, c.token_ids, c.logprobs, 0, body.echo)
        choices.append(CompletionChoice(
            index=c.index, text=c.source.text + "".join(c.text), logprobs=logprobs,
            finish_reason=c.finish_reason.value, stop_reason=c.stop_reason,
            prompt_logprobs=prompt_logprobs(c.prompt_logprobs, served.tokenizer) if body.prompt_logprobs is not None
            else None))
    return CompletionResponse(id=request_id, model=served.name, choices=choices, usage=_usage(streams.group))


async def completion_events(streams: ChoiceStreams, body: CompletionRequest, served: ServedModel,
                            request_id: str) -> AsyncIterator[str]:
    offsets: dict[int, int] = {}  # per choice: characters streamed so far (logprobs' text_offset)
    async for choice, delta in streams.deltas():
        if delta.finish_reason is FinishReason.ERROR:
            yield sse(failed_request(delta).body)
            break
        first = choice.index not in offsets
        text = (choice.source.text if first else "") + delta.new_text
        logprobs = None
        if body.logprobs is not None:
            logprobs, offsets[choice.index] = _completion_logprobs(
                choice, body, served, delta.new_token_ids, delta.logprobs or [], offsets.get(choice.index, 0),
                first and body.echo)
        else:
            offsets[choice.index] = offsets.get(choice.index, 0) + len(text)
        if not (text or delta.finished or (logprobs is not None and logprobs.tokens)):
            continue  # tokens whose text is held back (an incomplete character, a possible stop string)
        usage = _usage(streams.group) if body.continuous_usage else None
        yield sse(CompletionResponse(id=request_id, model=served.name, usage=usage, choices=[CompletionChoice(
            index=choice.index, text=text, logprobs=logprobs, finish_reason=_finish(delta),
            stop_reason=delta.stop_reason)]))
    else:
        if body.include_usage:
            yield sse(CompletionResponse(id=request_id, model=served.name, choices=[],
                                         usage=_usage(streams.group)))
    yield DONE


# -- /v1/chat/completions ---------------------------------------------------------------------
def _render_chat(served: ServedModel, body: ChatCompletionRequest) -> str:
    if served.chat_template is None:
        raise ApiError(HTTPStatus.BAD_REQUEST, f"model {served.name} has no chat template (none in its "
                       "tokenizer_config.json); start the server with --chat-template FILE, or use /v1/completions",
                       param="messages")
    kwargs = dict(body.chat_template_kwargs or {})
    if "messages" in kwargs:
        raise RequestError("chat_template_kwargs cannot set 'messages'")
    if body.reasoning_effort is not None:
        kwargs.setdefault("reasoning_effort", body.reasoning_effort)
    kwargs.setdefault("add_generation_prompt", body.add_generation_prompt)
    kwargs.setdefault("continue_final_message", body.continue_final_message)
    return served.chat_template.render([m.for_template() for m in body.messages], **kwargs)


def chat_group(served: ServedModel, body: ChatCompletionRequest, request_id: str) -> RequestGroup:
    body.check_supported()
    text = _render_chat(served, body)
    if served.tokenizer is None:
        raise RequestError(f"model {served.name} has no tokenizer; chat needs one")
    # The template wrote BOS itself.
    ids = _encode(served.tokenizer, text, "messages (the prompt the chat template rendered from them)", "messages",
                  add_special_tokens=False)
    param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    max_tokens = max_tokens_for(served, len(ids), body.requested_max_tokens(), served.defaults.get("max_tokens"),
                                param, "messages")
    params = body.sampling_params(served.defaults, max_tokens, body.num_logprobs())
    return RequestGroup.of(request_id, ids, params)


def _chat_logprobs(body: ChatCompletionRequest, served: ServedModel, token_ids: list[int],
                   positions: list) -> ChatLogprobs | None:
    if not body.logprobs:
        return None
    return ChatLogprobs(content=chat_logprobs(token_ids, positions, body.top_logprobs or 0, served.tokenizer))


async def chat_response(streams: ChoiceStreams, body: ChatCompletionRequest, served: ServedModel,
                        request_id: str) -> ChatCompletionResponse:
    async for _, delta in streams.deltas():
        if delta.finish_reason is FinishReason.ERROR:
            raise failed_request(delta)
    choices = streams.completions
    return ChatCompletionResponse(
        id=request_id, model=served.name, usage=_usage(streams.group),
        choices=[ChatChoice(index=c.index, message=AssistantMessage(content="".join(c.text)),
                            logprobs=_chat_logprobs(body, served, c.token_ids, c.logprobs),
                            finish_reason=c.finish_reason.value, stop_reason=c.stop_reason) for c in choices],
        prompt_logprobs=prompt_logprobs(choices[0].prompt_logprobs, served.tokenizer)
        if body.prompt_logprobs is not None else None)


async def chat_events(streams: ChoiceStreams, body: ChatCompletionRequest, served: ServedModel,
                      request_id: str) -> AsyncIterator[str]:
    def chunk(choice: ChatChunkChoice) -> str:
        usage = _usage(streams.group) if body.continuous_usage else None
        return sse(ChatCompletionChunk(id=request_id, model=served.name, choices=[choice], usage=usage))

    started: set[int] = set()
    async for choice, delta in streams.deltas():
        if delta.finish_reason is FinishReason.ERROR:
            yield sse(failed_request(delta).body)
            break
        if choice.index not in started:
            # Each choice's role chunk comes before its first token but not before the engine produced
            # it (as vLLM sends it): load generators time the first token from the first chunk.
            started.add(choice.index)
            yield chunk(ChatChunkChoice(index=choice.index, delta=DeltaMessage(role="assistant", content="")))
        logprobs = _chat_logprobs(body, served, delta.new_token_ids, delta.logprobs or [])
        if not (delta.new_text or delta.finished or (logprobs is not None and logprobs.content)):
            continue
        yield chunk(ChatChunkChoice(index=choice.index, delta=DeltaMessage(content=delta.new_text or None),
                                    logprobs=logprobs, finish_reason=_finish(delta), stop_reason=delta.stop_reason))
    else:
        if body.include_usage:
            yield sse(ChatCompletionChunk(id=request_id, model=served.name, choices=[],
                                          usage=_usage(streams.group)))
    yield DONE
