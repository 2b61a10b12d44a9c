"""A node's kernels warmed up at start, from its model and limits (`kernels.startup` does the
work on tensors): the colocated engine's and an attention rank's attention and gating, an
expert node's (and the engine's) grouped expert GEMM. Returns the frozen `Warmup`, whose
`finish()` (after the memory profile) gives the `KernelReport` the node logs and reports; on
the CPU nothing compiles and the report says which implementation runs.

It runs after the weights load and before the memory profile (megainfer/runner/memory_profile.py):
the profile's largest step then runs the implementations serving will run (timing both here
could otherwise leave the reference's gathered pages in the profile's peak), and the attention
warm-up reads a small scratch cache of its own (pages alias: it only reads them), not the KV
cache sized after the profile."""

from __future__ import annotations

import torch

from kernels.startup import (Warmup, attention_grid, warm_up_attention, warm_up_experts, warm_up_gating,
                             warm_up_norm_rope)
from megainfer.config import ModelConfig
from megainfer.engine_config import EngineConfig
from megainfer.model.expert_layer import ExpertLayer


SCRATCH_BLOCKS = 64  # pages of the warm-up's scratch cache (sequences read them round-robin)


def _attention(layers, rotary, config: EngineConfig, max_model_len: int, cfg: ModelConfig) -> None:
    """Attention once per kind of layer the model has (gpt-oss: windowed and full, both with
    sinks: different kernel variants), then the norm, rotary and gating kernels."""
    tokens = config.max_step_tokens
    layer = layers[0]
    weight = layer.o_proj.weight
    _, width = cfg.kv_cache_heads
    shape = (SCRATCH_BLOCKS, config.block_size, 1 if cfg.mla else layer.num_kv_heads, width)
    key_cache = torch.randn(shape, device=weight.device, dtype=weight.dtype)
    value_cache = key_cache if cfg.mla else torch.randn(shape, device=weight.device, dtype=weight.dtype)
    kinds = {layer.window: layer for layer in reversed(list(layers))}  # one layer of each window
    for kind in kinds.values():
        scale = kind.latent.scale if cfg.mla else kind.scale
        warm_up_attention(key_cache, value_cache, kind.num_heads, scale,
                          attention_grid(config.max_num_seqs, tokens, max_model_len), kind.sinks, kind.window)
    warm_up_norm_rope(layer.num_heads, layer.num_kv_heads, layer.post_norm.weight, layer.post_norm.eps, rotary.cos,
                      rotary.sin, key_cache, value_cache, layer.add_norm, rotary=not cfg.mla)
    routed = next((a for a in layers if a.router is not None))
    warm_up_gating(routed.route, cfg.hidden_size, tokens, key_cache.dtype, key_cache.device)


@torch.inference_mode()
def warm_up_engine(model, config: EngineConfig, max_model_len: int) -> Warmup:
    """The colocated engine (both halves) or an attention rank (no expert layers): every
    operator it runs, at the shapes its config lets a step reach. Frozen, not finished: the
    caller finishes it after its memory profile."""
    warmup = Warmup(torch.device(config.device))
    if warmup.active:
        cfg = model.cfg
        _attention(model.attention_layers, model.rotary, config, max_model_len, cfg)
        if getattr(model, "expert_layers", None):
            experts = next(iter(model.expert_layers.values()))
            warm_up_experts(experts.w_gate_up, experts.w_down, cfg.top_k, config.max_step_tokens * cfg.top_k,
                            experts.activation, experts.b_gate_up, experts.b_down)
    warmup.freeze()
    return warmup


@torch.inference_mode()
def warm_up_expert_node(layer: ExpertLayer, top_k: int, max_tokens: int | None) -> Warmup:
    """An expert node: its grouped GEMM with its own weights, up to `max_tokens` per (layer,
    micro-batch) from all attention nodes. Frozen, not finished (as `warm_up_engine`)."""
    warmup = Warmup(layer.w_gate_up.device)
    if warmup.active:
        if max_tokens is None:
            raise ValueError("max_tokens: an expert node on CUDA needs the most tokens one (layer, micro-batch) "
                             "brings, to build and decide its kernels before serving")
        warm_up_experts(layer.w_gate_up, layer.w_down, top_k, max_tokens * top_k, layer.activation,
                        layer.b_gate_up, layer.b_down)
    warmup.freeze()
    return warmup
