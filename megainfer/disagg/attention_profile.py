"""An attention rank's memory profile (megainfer/runner/memory_profile.py): the largest step it runs,
with nothing sent, and the KV budget that leaves the node's ranks."""

from __future__ import annotations

from typing import Callable

import torch

from megainfer.config import ModelConfig
from megainfer.disagg.attention_dispatch import attend_and_pack
from megainfer.disagg.staging_sizes import answer_rows
from megainfer.engine_config import EngineConfig
from megainfer.model.moe_model import MoEModel
from megainfer.runner import memory_profile
from megainfer.runner.memory_profile import MemorySnapshot
from megainfer.runner.model_runner import profile_inputs, profile_sampling
from megainfer.tensor_parallel import TensorParallelGroup


def attention_kv_budget(device: torch.device, model_config: ModelConfig, config: EngineConfig,
                        tp_group: TensorParallelGroup | None, before: MemorySnapshot, max_model_len: int,
                        profile_step: Callable[[], None]) -> int:
    """The KV budget gpu_memory_utilization leaves this rank after `profile_step`, the least
    over the node's ranks (bytes)."""
    tp_size = 1 if tp_group is None else tp_group.size
    found = memory_profile.profile(memory_profile.CudaMemory(device), before, profile_step,
                                   config.gpu_memory_utilization)
    agreed = None if tp_size == 1 else tp_group.min_over_ranks(memory_profile.offered_budget(found))
    need = config.min_kv_cache_bytes(model_config, max_model_len, tp_size)
    return memory_profile.kv_budget_bytes(found, need, agreed)


@torch.inference_mode()
def profile_attention_step(model: MoEModel, cfg: ModelConfig, config: EngineConfig, device: torch.device,
                           dtype: torch.dtype, tp_group: TensorParallelGroup | None, num_expert_nodes: int) -> None:
    """The largest micro-batch through every layer's attention half, as a step runs it but with
    nothing sent: config.max_step_tokens tokens (one micro-batch may carry a whole step), its
    dispatch records packed, the most answer rows this rank can receive added back (zeros;
    all-reduced over a tensor-parallel node, as a step does), then the sampler on the leader.
    Writes a scratch KV cache only; keeps nothing; runs on every rank of a node at once."""
    tp_rank, tp_size = (0, 1) if tp_group is None else (tp_group.rank, tp_group.size)
    (ids, positions, batch), cache, last_rows = profile_inputs(cfg, config, device, dtype, tp_size)
    hidden = model.embed(ids)
    rows = answer_rows(hidden.shape[0], cfg.top_k, num_expert_nodes, tp_size)
    counts = torch.zeros(cfg.num_experts, dtype=torch.int64, device=device)
    for layer in model.attention_layers:
        parts = attend_and_pack(layer, model.rotary, cache, hidden, positions, batch, counts, tp_size)
        answered = parts.token_ids[:rows]
        answers = torch.zeros(answered.numel(), cfg.hidden_size, dtype=dtype, device=device)
        y = torch.zeros_like(parts.residual).index_add_(0, answered, answers)
        if tp_size > 1:
            tp_group.all_reduce(y)
        hidden = parts.residual + y
        del parts, answers, y  # freed before the next layer's, as the step's outbox drains
    if tp_rank == 0:
        profile_sampling(model.compute_logits(model.norm(hidden[last_rows])), config.seed, cfg.eos_token_ids)
