"""Admitting a request into an engine: its prompt tokenized (or its token ids checked), its
sampling parameters and its length checked against the model and the KV cache, and the result
made a `Sequence` the scheduler can take. A bad request raises `RequestError` here, before it
reaches the scheduler, so it leaves the engine untouched.

It reads only what never changes while the engine serves (the tokenizer, the vocabulary, the
maximum length, the cache's size), so any thread may admit a request while a step runs: the
`QueuedEngine` (`queued_engine.py`) prepares requests in its callers' threads and hands the
sequences to the step loop's.
"""

from __future__ import annotations

from megainfer.config import ModelConfig
from megainfer.errors import RequestError
from megainfer.sampling_params import SamplingParams
from megainfer.scheduling.kv_cache import BlockManager
from megainfer.scheduling.sequence import Sequence
from megainfer.tokenizer import Tokenizer

Prompt = str | list[int]


class RequestAdmission:
    """The checks a request passes before it is queued, against one engine's model and cache."""

    def __init__(self, model_config: ModelConfig, tokenizer: Tokenizer | None, max_model_len: int,
                 blocks: BlockManager) -> None:
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.blocks = blocks  # read for its size only, which is fixed: its free blocks change every step

    def prepare(self, request_id: str, prompt: Prompt, params: SamplingParams | None = None) -> Sequence:
        """Check and tokenize a request into a sequence the scheduler can take, raising
        RequestError for a bad one; the caller keeps request ids unique."""
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise RequestError(f"request {request_id!r}: params must be SamplingParams, got {type(params).__name__}")
        if params.n != 1:
            raise RequestError(f"request {request_id!r}: n={params.n}, but an engine request is one sequence; the "
                               "API layer fans a request out into n, each with params.for_choice(i) "
                               "(megainfer/request_group.py)")
        token_ids = self.encode_prompt(prompt, request_id)
        vocab = self.model_config.vocab_size
        unknown = [t for t in params.stop_token_ids if t >= vocab]
        if unknown:  # it could never be sampled, so never stop the request: a mistake, said at once
            raise RequestError(f"request {request_id!r}: stop_token_ids must be token ids in [0, {vocab}); "
                               f"got {unknown[:5]}")
        if len(token_ids) >= self.max_model_len:
            raise RequestError(f"request {request_id!r}: prompt has {len(token_ids)} tokens; the model's max "
                               f"length is {self.max_model_len} (prompt plus at least one generated token)")
        blocks = self.blocks
        needed = blocks.blocks_for_sequence(min(len(token_ids) + params.max_tokens, self.max_model_len))
        if needed > blocks.num_blocks:  # it could never be scheduled: refused now rather than left waiting
            raise RequestError(f"request {request_id!r}: needs {needed} KV blocks for its prompt and max_tokens, "
                               f"the cache holds {blocks.num_blocks}; lower max_tokens or raise num_kv_blocks")
        return Sequence(request_id, token_ids, params)

    def encode_prompt(self, prompt: Prompt, request_id: str = "") -> list[int]:
        """A prompt's token ids: text through the tokenizer, token ids checked against the
        vocabulary. `request_id`, when given, names the request in the error."""
        where = f"request {request_id!r}: " if request_id else ""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError(f"{where}model {self.model_config.name} has no tokenizer.json; "
                                   "pass the prompt as a list of token ids")
            try:
                token_ids = self.tokenizer.encode(prompt)
            except RequestError as exc:  # text no tokenizer takes (a lone surrogate)
                raise RequestError(f"{where}prompt: {exc}") from None
        elif isinstance(prompt, (list, tuple)):
            token_ids = list(prompt)
            vocab = self.model_config.vocab_size
            bad = [t for t in token_ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab]
            if bad:
                raise RequestError(f"{where}prompt token ids must be integers in [0, {vocab}); got {bad[:5]}")
        else:
            raise RequestError(f"{where}prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if not token_ids:
            raise RequestError(f"{where}prompt is empty")
        return token_ids
