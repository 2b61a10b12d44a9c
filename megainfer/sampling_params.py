"""Per-request sampling parameters, validated where they are built."""

from __future__ import annotations

from dataclasses import dataclass, field

from megainfer.errors import RequestError


@dataclass
class SamplingParams:
    max_tokens: int = 16  # generated tokens at most (the prompt is not counted)
    temperature: float = 1.0  # 0 means greedy
    top_k: int = 0  # 0 or -1: no top-k filter
    top_p: float = 1.0  # nucleus mass kept, in (0, 1]
    seed: int | None = None  # per-request generator; None draws from the engine's
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False  # keep generating past the model's EOS tokens

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise RequestError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise RequestError(f"temperature must be >= 0 (0 is greedy), got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise RequestError(f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise RequestError(f"top_p must lie in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            raise RequestError(f"seed must be a non-negative integer or None, got {self.seed!r}")
        if not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
            raise RequestError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        self.stop_token_ids = list(self.stop_token_ids)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1
