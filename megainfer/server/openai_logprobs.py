"""The engine's per-position logprobs (`PositionLogprobs`: the chosen token first, then the
position's top-k by rank) in OpenAI's two shapes: the legacy completions lists (tokens,
token_logprobs, top_logprobs, text_offset) and chat's list of {token, logprob, bytes,
top_logprobs}; and vLLM's prompt_logprobs."""

from __future__ import annotations

from megainfer.messages import Logprob, PositionLogprobs
from megainfer.server.openai_protocol import (ChatTokenLogprob, ChatTopLogprob, CompletionLogprobs, PromptLogprob,
                                              PromptLogprobs)
from megainfer.tokenizer import Tokenizer

FLOOR = -9999.0  # JSON has no -inf: a token the distribution excluded reports this (as vLLM does)


def token_text(tokenizer: Tokenizer | None, token_id: int, logprob: Logprob | None = None) -> str:
    """One token's own text; `token_id:N` without a tokenizer (vLLM's return_tokens_as_token_ids form)."""
    if logprob is not None and logprob.decoded_token is not None:
        return logprob.decoded_token
    if tokenizer is None:
        return f"token_id:{token_id}"
    return tokenizer.token_text(token_id)


def _value(logprob: Logprob | None) -> float:
    return FLOOR if logprob is None else max(logprob.logprob, FLOOR)


def _top(position: PositionLogprobs, num: int) -> list[tuple[int, Logprob]]:
    """The position's `num` most likely tokens, most likely first."""
    return sorted(((t, lp) for t, lp in position.items() if lp.rank <= num), key=lambda item: item[1].rank)


def extend_completion_logprobs(out: CompletionLogprobs, token_ids: list[int],
                               positions: list[PositionLogprobs | None], num: int,
                               tokenizer: Tokenizer | None, offset: int) -> int:
    """Append tokens to `out` in the completions shape; returns the text offset after them.
    A position of None (the prompt's first token) has no logprob. top_logprobs holds the `num`
    most likely tokens and the chosen one (so up to num + 1 entries, as OpenAI documents), keyed by
    text as OpenAI's shape is, so tokens with the same text share one entry."""
    for token_id, position in zip(token_ids, positions):
        text = token_text(tokenizer, token_id, position.get(token_id) if position else None)
        out.tokens.append(text)
        out.text_offset.append(offset)
        offset += len(text)
        if position is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        out.token_logprobs.append(_value(position.get(token_id)))
        top: dict[str, float] = {}
        for t, lp in _top(position, num):  # tokens with the same text: the most likely one's value
            top.setdefault(token_text(tokenizer, t, lp), _value(lp))
        top.setdefault(text, _value(position.get(token_id)))
        out.top_logprobs.append(top)
    return offset


def chat_logprobs(token_ids: list[int], positions: list[PositionLogprobs], num: int,
                  tokenizer: Tokenizer | None) -> list[ChatTokenLogprob]:
    def entry(cls, token_id: int, logprob: Logprob | None, **more):
        text = token_text(tokenizer, token_id, logprob)
        return cls(token=text, logprob=_value(logprob), bytes=list(text.encode("utf-8")), **more)

    return [entry(ChatTokenLogprob, token_id, position.get(token_id),
                  top_logprobs=[entry(ChatTopLogprob, t, lp) for t, lp in _top(position, num)])
            for token_id, position in zip(token_ids, positions)]


def prompt_logprobs(positions: list[PositionLogprobs | None] | None,
                    tokenizer: Tokenizer | None) -> PromptLogprobs | None:
    """vLLM's prompt_logprobs: per prompt position, None for the first, else token id -> entry."""
    if positions is None:
        return None
    return [None if position is None else
            {t: PromptLogprob(logprob=_value(lp), rank=lp.rank, decoded_token=token_text(tokenizer, t, lp))
             for t, lp in position.items()}
            for position in positions]
