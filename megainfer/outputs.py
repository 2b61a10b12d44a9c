"""What the engine hands back: per-step deltas for streaming, whole outputs for the offline API."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestDelta:
    """One request's progress in one engine step."""

    request_id: str
    new_token_ids: list[int]
    new_text: str  # text completed by these tokens ("" while a character is incomplete)
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" once finished
    error: str | None = None  # why it failed, when finish_reason is "error"
    error_code: str | None = None  # "unavailable" (retry later) or "internal", when it failed


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


@dataclass
class ExpertLoad:
    """Experts one step activated and the expert-weight bytes that step had to read."""

    activated: list[list[int]]  # per layer, the expert ids that received at least one token
    bytes_read: int  # activated (layer, expert) pairs x bytes of one expert's weights


@dataclass
class EngineStats:
    num_steps: int = 0
    num_computed_tokens: int = 0  # prompt, recomputed and decode tokens run through the model
    num_generated_tokens: int = 0
    num_preemptions: int = 0
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # fraction of KV blocks in use, 0..1
    num_kv_blocks: int = 0
    expert_tokens: list[list[int]] = field(default_factory=list)  # cumulative [layer][expert] routed tokens
    expert_activations: int = 0  # cumulative activated (layer, expert) pairs over steps
    expert_bytes_read: int = 0  # cumulative expert-weight bytes read
    last_step_expert_load: ExpertLoad | None = None
    energy_j: float | None = None  # GPU energy since the engine started (None: unavailable, see below)
    energy_per_token_j: float | None = None
    energy_unavailable: str = ""  # why energy is unavailable, where it is
