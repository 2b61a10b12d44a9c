"""What the engine hands back: per-step deltas for streaming, whole outputs for the offline API."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestOutput:
    """A finished request (LLM.generate)."""

    request_id: str
    prompt: str | None  # None when the prompt was given as token ids
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated ids only
    text: str
    finish_reason: str
    error: str | None = None
    ttft_s: float | None = None  # arrival to first generated token, seconds
    tbt_s: list[float] = field(default_factory=list)  # every time between tokens, seconds
    latency_s: float | None = None  # arrival to last token, seconds
    num_preemptions: int = 0

