"""What a node actor derives from the plan: its engine configuration, weights and slot sizes."""

from __future__ import annotations

from megainfer.config import EngineConfig, ModelConfig, resolve_model
from megainfer.disagg.link import dispatch_bytes
from megainfer.model.weights import RandomWeights, SafetensorsCheckpoint, WeightSource
from megainfer.plan import Plan

# Seconds a node waits on a peer before declaring it gone.
PEER_TIMEOUT_S = 20.0


def engine_config(plan: Plan, num_threads: int | None) -> EngineConfig:
    return EngineConfig(dtype=plan.dtype, device="cpu" if plan.attention.gpu == "cpu" else "cuda",
                        max_num_seqs=plan.scheduler.max_num_seqs,
                        max_num_batched_tokens=plan.scheduler.max_num_batched_tokens,
                        prefill_policy=plan.scheduler.prefill_policy, num_threads=num_threads)


def weights_of(plan: Plan) -> tuple[ModelConfig, WeightSource]:
    model, checkpoint = resolve_model(plan.model)
    return model, SafetensorsCheckpoint(checkpoint) if checkpoint else RandomWeights(0)


def slot_sizes(plan: Plan, model: ModelConfig) -> tuple[int, int]:
    """(attention node's receive slot, expert node's receive slot) in bytes: one micro-batch
    may carry the whole step's tokens."""
    import torch

    tokens = plan.scheduler.max_num_batched_tokens
    dtype = getattr(torch, plan.dtype)
    return (tokens * model.hidden_size * torch.empty(0, dtype=dtype).element_size(),
            dispatch_bytes(tokens, model.hidden_size, model.top_k, dtype))


def node_names(plan: Plan) -> tuple[list[str], list[str]]:
    return ([f"attention{i}" for i in range(plan.attention.nodes)],
            [f"expert{k}" for k in range(plan.experts.nodes)])
