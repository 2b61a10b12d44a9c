"""Tensor names and shapes of a Hugging Face MoE checkpoint (the hub's per-expert naming).

Torch-free, so writing and validating checkpoints shares one table with loading.
"""

from __future__ import annotations

from megainfer.config import ModelConfig


def layer_prefix(layer: int) -> str:
    return f"model.layers.{layer}."


def attention_tensors(cfg: ModelConfig, layer: int) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Role -> (checkpoint name, shape) for the attention half of one layer, router included."""
    p = layer_prefix(layer)
    h = cfg.hidden_size
    t = {
        "input_norm": (p + "input_layernorm.weight", (h,)),
        "q": (p + "self_attn.q_proj.weight", (cfg.q_size, h)),
        "k": (p + "self_attn.k_proj.weight", (cfg.kv_size, h)),
        "v": (p + "self_attn.v_proj.weight", (cfg.kv_size, h)),
        "o": (p + "self_attn.o_proj.weight", (h, cfg.q_size)),
        "post_norm": (p + "post_attention_layernorm.weight", (h,)),
        "router": (p + ("block_sparse_moe.gate.weight" if cfg.model_type == "mixtral" else "mlp.gate.weight"),
                   (cfg.num_experts, h)),
    }
    if cfg.attention_bias:
        t.update({
            "q_bias": (p + "self_attn.q_proj.bias", (cfg.q_size,)),
            "k_bias": (p + "self_attn.k_proj.bias", (cfg.kv_size,)),
            "v_bias": (p + "self_attn.v_proj.bias", (cfg.kv_size,)),
            "o_bias": (p + "self_attn.o_proj.bias", (h,)),
        })
    if cfg.qk_norm:
        t["q_norm"] = (p + "self_attn.q_norm.weight", (cfg.head_dim,))
        t["k_norm"] = (p + "self_attn.k_norm.weight", (cfg.head_dim,))
    return t


def expert_tensors(cfg: ModelConfig, layer: int, expert: int) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Role (gate, up, down) -> (checkpoint name, shape) for one expert of one layer."""
    h, i = cfg.hidden_size, cfg.expert_intermediate_size
    if cfg.model_type == "mixtral":
        p = f"{layer_prefix(layer)}block_sparse_moe.experts.{expert}."
        names = {"gate": "w1", "up": "w3", "down": "w2"}
    else:
        p = f"{layer_prefix(layer)}mlp.experts.{expert}."
        names = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
    shapes = {"gate": (i, h), "up": (i, h), "down": (h, i)}
    return {role: (f"{p}{names[role]}.weight", shapes[role]) for role in names}


def head_tensors(cfg: ModelConfig) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Embedding, final norm and LM head (absent when tied to the embedding)."""
    t = {
        "embed": ("model.embed_tokens.weight", (cfg.vocab_size, cfg.hidden_size)),
        "norm": ("model.norm.weight", (cfg.hidden_size,)),
    }
    if not cfg.tie_word_embeddings:
        t["lm_head"] = ("lm_head.weight", (cfg.vocab_size, cfg.hidden_size))
    return t


def all_tensors(cfg: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor of a full checkpoint, in load order."""
    out = list(head_tensors(cfg).values())
    for layer in range(cfg.num_layers):
        out += attention_tensors(cfg, layer).values()
        for e in range(cfg.num_experts):
            out += expert_tensors(cfg, layer, e).values()
    return out
