"""A node's kernels warmed up at start, from its model and limits (`kernels.startup` does the
work on tensors): the colocated engine's and an attention rank's attention and gating, an
expert node's (and the engine's) grouped expert GEMM. Returns the `KernelReport` the node logs
and reports; on the CPU nothing compiles and the report says which implementation runs."""

from __future__ import annotations

import torch

from kernels.startup import KernelReport, Warmup, attention_grid, warm_up_attention, warm_up_experts, warm_up_gating
from megainfer.config import EngineConfig, ModelConfig
from megainfer.model.attention_layer import AttentionLayer
from megainfer.model.expert_layer import ExpertLayer


def _attention(warmup: Warmup, layer: AttentionLayer, kv_cache: tuple[torch.Tensor, torch.Tensor],
               config: EngineConfig, max_model_len: int, cfg: ModelConfig) -> None:
    tokens = config.max_step_tokens
    key_cache, value_cache = kv_cache
    warm_up_attention(key_cache, value_cache, layer.num_heads, layer.scale,
                      attention_grid(config.max_num_seqs, tokens, max_model_len))
    warm_up_gating(cfg.num_experts, cfg.top_k, cfg.norm_topk_prob, layer.expert_node,
                   0 if layer.expert_node is None else layer.num_expert_nodes, tokens, key_cache.dtype,
                   key_cache.device)


@torch.inference_mode()
def warm_up_engine(model, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], config: EngineConfig,
                   max_model_len: int) -> KernelReport:
    """The colocated engine (both halves) or an attention rank (no expert layers): every
    operator it runs, at the shapes its config lets a step reach."""
    warmup = Warmup(torch.device(config.device))
    if warmup.active:
        cfg = model.cfg
        _attention(warmup, model.attention_layers[0], kv_caches[0], config, max_model_len, cfg)
        if getattr(model, "expert_layers", None):
            experts = model.expert_layers[0]
            warm_up_experts(experts.w_gate_up, experts.w_down, cfg.top_k, config.max_step_tokens * cfg.top_k)
    return warmup.finish()


@torch.inference_mode()
def warm_up_expert_node(layer: ExpertLayer, top_k: int, max_tokens: int | None) -> KernelReport:
    """An expert node: its grouped GEMM with its own weights, up to `max_tokens` per (layer,
    micro-batch) from all attention nodes."""
    warmup = Warmup(layer.w_gate_up.device)
    if warmup.active:
        if max_tokens is None:
            raise ValueError("max_tokens: an expert node on CUDA needs the most tokens one (layer, micro-batch) "
                             "brings, to build and decide its kernels before serving")
        warm_up_experts(layer.w_gate_up, layer.w_down, top_k, max_tokens * top_k)
    return warmup.finish()
