"""Named models: small runnable presets (random weights, byte-level vocabulary) for demos and tests,
and shape-only presets of paper-scale models for the planner and the simulator. Torch-free."""

from __future__ import annotations

from typing import Any

from megainfer.config import ModelConfig, RopeScaling


def _mixtral(name: str, **kw: Any) -> ModelConfig:
    base = dict(model_type="mixtral", norm_topk_prob=True, rope_theta=1e6, rms_norm_eps=1e-5, name=name,
                bos_token_id=1, eos_token_ids=(2,))
    return ModelConfig(**{**base, **kw})


def _gpt_oss(name: str, **kw: Any) -> ModelConfig:
    """openai/gpt-oss-20b and -120b's config.json: alternating windowed (128, the even layers) and
    full-attention layers, sinks, router and expert biases, the clamped SwiGLU, YaRN over 4,096
    trained positions; experts stored in MXFP4 (served dequantized)."""
    layers = kw.pop("num_layers")
    base = dict(model_type="gpt_oss", name=name, vocab_size=201088, hidden_size=2880, num_layers=layers, num_heads=64,
                num_kv_heads=8, head_dim=64, top_k=4, expert_intermediate_size=2880, norm_topk_prob=True,
                rope_theta=150000.0, rms_norm_eps=1e-5, max_position_embeddings=131072, attention_bias=True,
                sliding_window=128, window_layers=tuple(range(0, layers, 2)), attention_sinks=True,
                router_bias=True, expert_bias=True, swiglu_alpha=1.702, swiglu_limit=7.0,
                rope_scaling=RopeScaling(factor=32.0, original_max_position_embeddings=4096, truncate=False),
                bos_token_id=199998, eos_token_ids=(200002, 199999, 200012))
    return ModelConfig(**{**base, **kw})


def _deepseek(name: str, **kw: Any) -> ModelConfig:
    """DeepSeek's MLA (kv_lora_rank 512, 64 rotary dims, 128 + 64 q/k and 128 v per head), shared
    experts beside the routed ones, dense first layers, YaRN over 4,096 trained positions."""
    base = dict(model_type="deepseek_v3", name=name, head_dim=192, kv_lora_rank=512, qk_rope_head_dim=64,
                v_head_dim=128, rope_theta=10000.0, rms_norm_eps=1e-6, max_position_embeddings=163840,
                norm_topk_prob=True)
    return ModelConfig(**{**base, **kw})


def _qwen3(name: str, **kw: Any) -> ModelConfig:
    base = dict(model_type="qwen3_moe", norm_topk_prob=True, rope_theta=1e6, rms_norm_eps=1e-6, qk_norm=True,
                name=name, bos_token_id=151643, eos_token_ids=(151645,), max_position_embeddings=40960)
    return ModelConfig(**{**base, **kw})


# Byte-level presets: ids 0..255 are bytes, 256 is BOS, 257 is EOS (see tokenizer.ByteTokenizer).
_BYTE_VOCAB = dict(vocab_size=258, bos_token_id=256, eos_token_ids=(257,))

PRESETS: dict[str, ModelConfig] = {
    "tiny-mixtral": _mixtral(
        "tiny-mixtral", hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4, head_dim=32,
        num_experts=8, top_k=2, expert_intermediate_size=512, max_position_embeddings=4096, **_BYTE_VOCAB),
    # tiny-mixtral's blocks with twice the layers and half the experts (a little wider): on a
    # 2-core CPU one micro-batch of its attention and of its experts cost about the same, so
    # the ping-pong has something to overlap (how it was balanced: deploy/plans/balanced-cpu.yaml).
    "balanced-mixtral": _mixtral(
        "balanced-mixtral", hidden_size=256, num_layers=8, num_heads=8, num_kv_heads=4, head_dim=32,
        num_experts=4, top_k=2, expert_intermediate_size=576, max_position_embeddings=4096, **_BYTE_VOCAB),
    # tiny-mixtral's attention with a skewed gate and 8x wider experts: experts 0-3 get +0.9,
    # +0.7, +0.5, +0.3 on their router logits (random weights give logits of std ~0.3), so they
    # take ~92% of the (token, expert) pairs (37, 32, 19 and 4%), and two expert nodes of four
    # experts each stand at 1.7-2.0x their mean load. The wide experts make the expert side the
    # bottleneck on a 2-core CPU, as it is where skew hurts; what experts.rebalance and
    # `megainfer bench eplb` even out (deploy/plans/skewed-cpu.yaml).
    "skewed-mixtral": _mixtral(
        "skewed-mixtral", hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4, head_dim=32,
        num_experts=8, top_k=2, expert_intermediate_size=4096, max_position_embeddings=4096,
        router_logit_bias=(0.9, 0.7, 0.5, 0.3, 0.0, 0.0, 0.0, 0.0), **_BYTE_VOCAB),
    "tiny-qwen3-moe": _qwen3(
        "tiny-qwen3-moe", hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=2, head_dim=64,
        num_experts=16, top_k=4, expert_intermediate_size=256, max_position_embeddings=4096, **_BYTE_VOCAB),
    "mixtral-8x7b": _mixtral(
        "mixtral-8x7b", vocab_size=32000, hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8,
        head_dim=128, num_experts=8, top_k=2, expert_intermediate_size=14336, max_position_embeddings=32768),
    "mixtral-8x22b": _mixtral(
        "mixtral-8x22b", vocab_size=32768, hidden_size=6144, num_layers=56, num_heads=48, num_kv_heads=8,
        head_dim=128, num_experts=8, top_k=2, expert_intermediate_size=16384, max_position_embeddings=65536),
    # DBRX (databricks/dbrx-base's config.json): LayerNorm without bias, q/k/v clipped at 8.
    "dbrx": ModelConfig(
        model_type="dbrx", name="dbrx", vocab_size=100352, hidden_size=6144, num_layers=40, num_heads=48,
        num_kv_heads=8, head_dim=128, num_experts=16, top_k=4, expert_intermediate_size=10752,
        norm_topk_prob=True, rope_theta=5e5, rms_norm_eps=1e-5, max_position_embeddings=32768, norm="layer",
        clip_qkv=8.0),
    "gpt-oss-20b": _gpt_oss("gpt-oss-20b", num_layers=24, num_experts=32),
    "gpt-oss-120b": _gpt_oss("gpt-oss-120b", num_layers=36, num_experts=128),
    # deepseek-ai/DeepSeek-V2-Lite's config.json: no q bottleneck, softmax routing over 64 experts
    # (greedy top-6, not renormalised), 2 shared experts, layer 0 dense.
    "deepseek-v2-lite": _deepseek(
        "deepseek-v2-lite", model_type="deepseek_v2", vocab_size=102400, hidden_size=2048, num_layers=27, num_heads=16,
        num_kv_heads=16, num_experts=64, top_k=6, expert_intermediate_size=1408, n_shared_experts=2,
        first_k_dense=1, dense_intermediate_size=10944, norm_topk_prob=False,
        rope_scaling=RopeScaling(factor=40.0, original_max_position_embeddings=4096, mscale=0.707,
                                 mscale_all_dim=0.707),
        bos_token_id=100000, eos_token_ids=(100001,)),
    # deepseek-ai/DeepSeek-V3's config.json: q through a 1,536 bottleneck, sigmoid routing with a
    # correction bias, top-8 within the best 4 of 8 groups, weights x 2.5; 1 shared expert; 3
    # dense layers. Published in FP8 with 128 x 128 block scales.
    "deepseek-v3": _deepseek(
        "deepseek-v3", vocab_size=129280, hidden_size=7168, num_layers=61, num_heads=128, num_kv_heads=128,
        q_lora_rank=1536, num_experts=256, top_k=8, expert_intermediate_size=2048, n_shared_experts=1,
        first_k_dense=3, dense_intermediate_size=18432, scoring="sigmoid", n_group=8, topk_group=4,
        score_correction_bias=True, routed_scaling_factor=2.5,
        rope_scaling=RopeScaling(factor=40.0, original_max_position_embeddings=4096, mscale=1.0, mscale_all_dim=1.0),
        bos_token_id=0, eos_token_ids=(1,)),
    # MegaScale-Infer's Scaled-MoE (317B): Mixtral-style blocks; vocabulary and heads assumed.
    "scaled-moe": _mixtral(
        "scaled-moe", vocab_size=32000, hidden_size=8192, num_layers=48, num_heads=64, num_kv_heads=8,
        head_dim=128, num_experts=32, top_k=4, expert_intermediate_size=8192, max_position_embeddings=32768),
    "qwen3-30b-a3b": _qwen3(
        "qwen3-30b-a3b", vocab_size=151936, hidden_size=2048, num_layers=48, num_heads=32, num_kv_heads=4,
        head_dim=128, num_experts=128, top_k=8, expert_intermediate_size=768),
    "qwen3-235b-a22b": _qwen3(
        "qwen3-235b-a22b", vocab_size=151936, hidden_size=4096, num_layers=94, num_heads=64, num_kv_heads=4,
        head_dim=128, num_experts=128, top_k=8, expert_intermediate_size=1536),
}
