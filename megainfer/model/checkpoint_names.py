"""Tensor names and shapes of a Hugging Face MoE checkpoint: the hub's per-expert naming
(Mixtral, Qwen3-MoE), DBRX's fused tensors (q, k and v in one `Wqkv`; every expert's gate, up
and down projections stacked in `w1`, `v1`, `w2`) and gpt-oss's (every expert's gate and up
projections interleaved in one `gate_up_proj` [E, H, 2I], its down projection in `down_proj`
[E, I, H], with their biases), read as slices.

Torch-free, so writing and validating checkpoints shares one table with loading.
"""

from __future__ import annotations

from typing import NamedTuple

from megainfer.config import ModelConfig


class TensorRef(NamedTuple):
    """Where a role's weights lie: a checkpoint tensor of `shape`, or its `rows` (a fused tensor's
    part), `transposed` where the checkpoint stores it the other way round (DBRX's w2)."""

    name: str
    shape: tuple[int, ...]
    rows: tuple[int, int] | None = None
    transposed: bool = False


def read(source, ref: TensorRef):
    """The role's tensor from a `WeightSource`."""
    tensor = source.get(ref.name, ref.shape, ref.rows)
    return tensor.T if ref.transposed else tensor


def layer_prefix(layer: int) -> str:
    return f"model.layers.{layer}."


def _dbrx_attention(cfg: ModelConfig, layer: int) -> dict[str, TensorRef]:
    p, h = f"transformer.blocks.{layer}.", cfg.hidden_size
    return {"input_norm": TensorRef(p + "norm_attn_norm.norm_1.weight", (h,)),
            "qkv": TensorRef(p + "norm_attn_norm.attn.Wqkv.weight", (cfg.q_size + 2 * cfg.kv_size, h)),
            "o": TensorRef(p + "norm_attn_norm.attn.out_proj.weight", (h, cfg.q_size)),
            "post_norm": TensorRef(p + "norm_attn_norm.norm_2.weight", (h,)),
            "router": TensorRef(p + "ffn.router.layer.weight", (cfg.num_experts, h))}


def _dbrx_expert(cfg: ModelConfig, layer: int, expert: int) -> dict[str, TensorRef]:
    p, h, i = f"transformer.blocks.{layer}.ffn.experts.mlp.", cfg.hidden_size, cfg.expert_intermediate_size
    shape, rows = (cfg.num_experts * i, h), (expert * i, (expert + 1) * i)
    return {"gate": TensorRef(p + "w1", shape, rows), "up": TensorRef(p + "v1", shape, rows),
            "down": TensorRef(p + "w2", shape, rows, transposed=True)}


def _gpt_oss_expert(cfg: ModelConfig, layer: int, expert: int) -> dict[str, TensorRef]:
    """Expert `expert`'s part of the stacked tensors: [1, H, 2I] gate_up (gate and up interleaved
    by column), [1, I, H] down, their biases [1, 2I] and [1, H]: `expert_weights` unpacks them."""
    p, h, i, e = f"{layer_prefix(layer)}mlp.experts.", cfg.hidden_size, cfg.expert_intermediate_size, cfg.num_experts
    rows = (expert, expert + 1)
    return {"gate_up": TensorRef(p + "gate_up_proj", (e, h, 2 * i), rows),
            "gate_up_bias": TensorRef(p + "gate_up_proj_bias", (e, 2 * i), rows),
            "down": TensorRef(p + "down_proj", (e, i, h), rows),
            "down_bias": TensorRef(p + "down_proj_bias", (e, h), rows)}


def expert_weights(t: dict):
    """An expert's tensors as read (`expert_tensors` roles) -> gate [I, H], up [I, H], down [H, I]
    and, for gpt-oss, the gate's, up's and down's biases (else None)."""
    if "gate_up" not in t:
        return t["gate"], t["up"], t["down"], None, None, None
    gate_up, bias = t["gate_up"][0], t["gate_up_bias"][0]
    # gpt-oss interleaves them: column 2j is the gate's output j, column 2j + 1 the up's.
    return gate_up[:, 0::2].T, gate_up[:, 1::2].T, t["down"][0].T, bias[0::2], bias[1::2], t["down_bias"][0]


def _ffn(prefix: str, h: int, i: int, role: str) -> dict[str, TensorRef]:
    return {f"{role}_{part}": TensorRef(f"{prefix}{part}_proj.weight", (h, i) if part == "down" else (i, h))
            for part in ("gate", "up", "down")}


def _latent_attention(cfg: ModelConfig, layer: int) -> dict[str, TensorRef]:
    """DeepSeek's MLA, its router (MoE layers) and the FFNs the attention side runs: the shared
    experts of an MoE layer, a dense layer's whole FFN."""
    p, h, heads, rank = f"{layer_prefix(layer)}self_attn.", cfg.hidden_size, cfg.num_heads, cfg.kv_lora_rank
    q_out = heads * cfg.head_dim
    t = {"input_norm": TensorRef(layer_prefix(layer) + "input_layernorm.weight", (h,)),
         "post_norm": TensorRef(layer_prefix(layer) + "post_attention_layernorm.weight", (h,)),
         "kv_a": TensorRef(p + "kv_a_proj_with_mqa.weight", (rank + cfg.qk_rope_head_dim, h)),
         "kv_a_norm": TensorRef(p + "kv_a_layernorm.weight", (rank,)),
         "kv_b": TensorRef(p + "kv_b_proj.weight", (heads * (cfg.head_dim - cfg.qk_rope_head_dim + cfg.v_head_dim),
                                                    rank)),
         "o": TensorRef(p + "o_proj.weight", (h, heads * cfg.v_head_dim))}
    if cfg.q_lora_rank:
        t.update(q_a=TensorRef(p + "q_a_proj.weight", (cfg.q_lora_rank, h)),
                 q_a_norm=TensorRef(p + "q_a_layernorm.weight", (cfg.q_lora_rank,)),
                 q_b=TensorRef(p + "q_b_proj.weight", (q_out, cfg.q_lora_rank)))
    else:
        t["q_b"] = TensorRef(p + "q_proj.weight", (q_out, h))
    mlp = f"{layer_prefix(layer)}mlp."
    if not cfg.is_moe_layer(layer):
        return {**t, **_ffn(mlp, h, cfg.dense_intermediate_size, "dense")}
    t["router"] = TensorRef(mlp + "gate.weight", (cfg.num_experts, h))
    if cfg.score_correction_bias:
        t["score_bias"] = TensorRef(mlp + "gate.e_score_correction_bias", (cfg.num_experts,))
    if cfg.n_shared_experts:
        t.update(_ffn(mlp + "shared_experts.", h, cfg.shared_expert_intermediate_size, "shared"))
    return t


def attention_tensors(cfg: ModelConfig, layer: int) -> dict[str, TensorRef]:
    """Role -> where it lies, for the attention half of one layer, router included (DBRX: q, k
    and v as one role, "qkv"; DeepSeek: MLA's roles and the FFNs the attention side runs)."""
    if cfg.model_type == "dbrx":
        return _dbrx_attention(cfg, layer)
    if cfg.mla:
        return _latent_attention(cfg, layer)
    p = layer_prefix(layer)
    h = cfg.hidden_size
    router = {"mixtral": "block_sparse_moe.gate", "gpt_oss": "mlp.router"}.get(cfg.model_type, "mlp.gate")
    t = {
        "input_norm": TensorRef(p + "input_layernorm.weight", (h,)),
        "q": TensorRef(p + "self_attn.q_proj.weight", (cfg.q_size, h)),
        "k": TensorRef(p + "self_attn.k_proj.weight", (cfg.kv_size, h)),
        "v": TensorRef(p + "self_attn.v_proj.weight", (cfg.kv_size, h)),
        "o": TensorRef(p + "self_attn.o_proj.weight", (h, cfg.q_size)),
        "post_norm": TensorRef(p + "post_attention_layernorm.weight", (h,)),
        "router": TensorRef(f"{p}{router}.weight", (cfg.num_experts, h)),
    }
    if cfg.router_bias:
        t["router_bias"] = TensorRef(f"{p}{router}.bias", (cfg.num_experts,))
    if cfg.attention_sinks:
        t["sinks"] = TensorRef(p + "self_attn.sinks", (cfg.num_heads,))
    if cfg.attention_bias:
        t.update({
            "q_bias": TensorRef(p + "self_attn.q_proj.bias", (cfg.q_size,)),
            "k_bias": TensorRef(p + "self_attn.k_proj.bias", (cfg.kv_size,)),
            "v_bias": TensorRef(p + "self_attn.v_proj.bias", (cfg.kv_size,)),
            "o_bias": TensorRef(p + "self_attn.o_proj.bias", (h,)),
        })
    if cfg.qk_norm:
        t["q_norm"] = TensorRef(p + "self_attn.q_norm.weight", (cfg.head_dim,))
        t["k_norm"] = TensorRef(p + "self_attn.k_norm.weight", (cfg.head_dim,))
    return t


def expert_tensors(cfg: ModelConfig, layer: int, expert: int) -> dict[str, TensorRef]:
    """Role (gate, up, down) -> where it lies, for one expert of one layer (gate and up [I, H],
    down [H, I] once read)."""
    if cfg.model_type == "dbrx":
        return _dbrx_expert(cfg, layer, expert)
    if cfg.model_type == "gpt_oss":
        return _gpt_oss_expert(cfg, layer, expert)
    h, i = cfg.hidden_size, cfg.expert_intermediate_size
    if cfg.model_type == "mixtral":
        p = f"{layer_prefix(layer)}block_sparse_moe.experts.{expert}."
        names = {"gate": "w1", "up": "w3", "down": "w2"}
    else:
        p = f"{layer_prefix(layer)}mlp.experts.{expert}."
        names = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
    shapes = {"gate": (i, h), "up": (i, h), "down": (h, i)}
    return {role: TensorRef(f"{p}{names[role]}.weight", shapes[role]) for role in names}


def head_tensors(cfg: ModelConfig) -> dict[str, TensorRef]:
    """Embedding, final norm and LM head (absent when tied to the embedding)."""
    dbrx = cfg.model_type == "dbrx"
    t = {
        "embed": TensorRef("transformer.wte.weight" if dbrx else "model.embed_tokens.weight",
                           (cfg.vocab_size, cfg.hidden_size)),
        "norm": TensorRef("transformer.norm_f.weight" if dbrx else "model.norm.weight", (cfg.hidden_size,)),
    }
    if not cfg.tie_word_embeddings:
        t["lm_head"] = TensorRef("lm_head.weight", (cfg.vocab_size, cfg.hidden_size))
    return t


def all_tensors(cfg: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor of a full checkpoint (name, shape), each once, in load order."""
    refs = list(head_tensors(cfg).values())
    for layer in range(cfg.num_layers):
        refs += attention_tensors(cfg, layer).values()
        for e in range(cfg.num_experts if cfg.is_moe_layer(layer) else 0):
            refs += expert_tensors(cfg, layer, e).values()
    return list(dict.fromkeys((ref.name, ref.shape) for ref in refs))
