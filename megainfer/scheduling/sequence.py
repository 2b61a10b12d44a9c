"""One request's state inside an engine: its tokens, how far its KV is computed, its blocks."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from operator import attrgetter

from megainfer.messages import FinishReason
from megainfer.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued, or preempted and waiting to be recomputed
    RUNNING = "running"  # holds KV blocks, scheduled step by step
    FINISHED = "finished"


@dataclass(eq=False, slots=True)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    # Every token of the sequence: the prompt, then what was generated. After a preemption
    # all of them are recomputed as one long prompt.
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose KV sits in the cache
    block_table: list[int] = field(default_factory=list)  # KV-cache block ids, in order
    # The windowed layers' blocks, by position like `block_table`; its first `window_released`
    # entries were released (kv_cache.BlockManager). Empty for models without windowed layers.
    window_table: list[int] = field(default_factory=list)
    window_released: int = 0
    # Prefix caching (kv_cache.BlockManager): the names of its full blocks so far (they depend on
    # its tokens alone, so they outlive a preemption), how many leading blocks of `block_table`
    # were named or found named, and the prompt tokens its first admission found cached.
    block_hashes: list[bytes] = field(default_factory=list)
    hashed_blocks: int = 0
    num_cached_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    error: str | None = None
    num_preemptions: int = 0
    # The stop token id or stop string that finished it (vLLM's stop_reason); None for EOS,
    # length, or while it runs.
    stop_reason: int | str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None  # when the scheduler first admitted it (not reset by preemption)
    first_token_time: float | None = None  # when the first generated token was sampled
    last_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)  # when each generated token was sampled

    @property
    def tbt_s(self) -> list[float]:
        """Every time between tokens, seconds (one fewer than the generated tokens)."""
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]

    # Sampled by a bare argmax: greedy, no penalties, no min_tokens mask, no logprobs (what the
    # sampler's one-argmax path serves when every row of a step is so).
    greedy_only: bool = field(init=False, default=False)
    # Its step's sampling reads its tokens or counters so far (penalties, the min_tokens mask,
    # prompt logprobs): the next step may not be scheduled ahead of that sampling, since the
    # look-ahead advances them (`Scheduler.advance_ahead`).
    reads_history: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        params = self.params
        self.reads_history = params.has_penalties or params.min_tokens > 0 or params.prompt_logprobs is not None
        self.greedy_only = params.greedy and not self.reads_history and params.logprobs is None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED


# A sequence's fields as functions, for the C-level maps (`map(TOKEN_IDS, seqs)`) of the loops
# that run over every sequence of every step: no Python frame per sequence.
TOKEN_IDS = attrgetter("token_ids")
COMPUTED = attrgetter("num_computed_tokens")
BLOCK_TABLE = attrgetter("block_table")
REQUEST_ID = attrgetter("request_id")
STATUS = attrgetter("status")
