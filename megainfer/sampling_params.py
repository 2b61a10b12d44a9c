"""Per-request sampling parameters (vLLM's names and meanings), validated where they are built."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from megainfer.errors import RequestError

MAX_LOGPROBS = 20  # OpenAI's top_logprobs limit; vLLM's default max_logprobs is 20 too
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
MAX_CACHE_SALT_CHARS = 1024
MAX_CHOICES = 128  # n
# top_k's largest value: the gRPC field's int32 range (the sampler builds an int64 tensor of it; any
# value at or above the vocabulary keeps every token).
MAX_TOP_K = 2**31 - 1


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class SamplingParams:
    max_tokens: int = 16  # generated tokens at most (the prompt is not counted)
    temperature: float = 1.0  # 0 means greedy
    top_k: int = 0  # 0 or -1: no top-k filter
    top_p: float = 1.0  # nucleus mass kept, in (0, 1]
    min_p: float = 0.0  # drop tokens less likely than min_p times the most likely one
    seed: int | None = None  # per-request generator; None draws from the engine's
    n: int = 1  # completions per prompt (the API layers fan a request out into n sequences)
    presence_penalty: float = 0.0  # subtracted from the logit of every token generated so far
    frequency_penalty: float = 0.0  # subtracted once per occurrence in the generated tokens
    repetition_penalty: float = 1.0  # CTRL's: logits of prompt and generated tokens divided (>0) or multiplied (<0) by it
    min_tokens: int = 0  # EOS and stop tokens are masked until this many tokens were generated
    stop: list[str] = field(default_factory=list)  # stop strings; the text ends before them
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False  # keep generating past the model's EOS tokens
    logprobs: int | None = None  # per generated token: its logprob and the top-`logprobs` (0: the token's alone)
    prompt_logprobs: int | None = None  # the same for every prompt token
    skip_special_tokens: bool = True  # leave special tokens out of the text
    # vLLM's request field: salts the names of the request's cached KV blocks, so it shares
    # cached prefixes only with requests of the same salt (tenants; or caching off per request).
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop) if self.stop is not None else []
        self.stop_token_ids = list(self.stop_token_ids) if self.stop_token_ids is not None else []
        self._check()

    def _check(self) -> None:
        def bad(name: str, rule: str) -> RequestError:
            return RequestError(f"{name} must be {rule}, got {getattr(self, name)!r}")

        if not _is_int(self.max_tokens) or self.max_tokens <= 0:
            raise bad("max_tokens", "a positive integer")
        if not _is_number(self.temperature) or self.temperature < 0:
            raise bad("temperature", "a number >= 0 (0 is greedy)")
        if not _is_int(self.top_k) or not -1 <= self.top_k <= MAX_TOP_K:
            raise bad("top_k", f"-1, 0 (disabled) or an integer in [1, {MAX_TOP_K}]")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", "a number in (0, 1]")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise bad("min_p", "a number in [0, 1]")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**63):
            raise bad("seed", "a non-negative 63-bit integer or None")
        if not _is_int(self.n) or not 1 <= self.n <= MAX_CHOICES:
            raise bad("n", f"an integer in [1, {MAX_CHOICES}]")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2 <= value <= 2:
                raise bad(name, "a number in [-2, 2]")
        if not _is_number(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise bad("repetition_penalty", "a number > 0 (1 disables it)")
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or
                                            not 0 < len(self.cache_salt) <= MAX_CACHE_SALT_CHARS):
            raise bad("cache_salt", f"a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters, or None")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise bad("min_tokens", f"an integer in [0, max_tokens={self.max_tokens}]")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop", "a list of non-empty strings")
        if len(self.stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_STRING_CHARS for s in self.stop):
            raise RequestError(f"stop takes at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_STRING_CHARS} "
                               f"characters, got {len(self.stop)} (longest {max(map(len, self.stop))})")
        if not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "a list of non-negative integers")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise bad(name, f"None or an integer in [0, {MAX_LOGPROBS}]")
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "true or false")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    def replace(self, **changes) -> "SamplingParams":
        """A copy with `changes` applied (and checked)."""
        return dataclasses.replace(self, **changes)

    def for_choice(self, index: int) -> "SamplingParams":
        """The parameters of the `index`-th of n completions: one sequence each, their seeds
        distinct and reproducible when the request gave one (vLLM seeds its children the same way)."""
        seed = None if self.seed is None else (self.seed + index) % 2**63
        return dataclasses.replace(self, n=1, seed=seed)
