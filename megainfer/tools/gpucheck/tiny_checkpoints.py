"""Tiny random Mixtral, Qwen3-MoE, DBRX and gpt-oss checkpoints written by transformers' own `save_pretrained`
(the GPU check's engine comparisons and the test suite's fixtures), with the prompts they are
compared on."""

from __future__ import annotations

from pathlib import Path

import torch

KINDS = ("mixtral", "qwen3_moe", "dbrx", "gpt_oss", "gpt_oss_gqa4", "deepseek_v3", "deepseek_v3_noq", "deepseek_v2")
VOCAB = 320
PROMPT_LENGTHS = (5, 17, 33, 1, 24)


def write_tiny_checkpoint(kind: str, directory: Path):
    """Writes a seeded tiny `kind` checkpoint to `directory`; returns transformers' model (eval)."""
    import transformers

    torch.manual_seed(0)
    # initializer_range 0.2 keeps random logits well separated, so greedy choices are
    # decided by the model, not by float rounding.
    common = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, num_experts_per_tok=2, max_position_embeddings=512,
                  initializer_range=0.2)
    if kind == "mixtral":
        cfg = transformers.MixtralConfig(intermediate_size=96, num_local_experts=6, **common)
        model = transformers.MixtralForCausalLM(cfg)
    elif kind == "qwen3_moe":
        # head_dim (24) differs from hidden/heads (16), and top-k weights are not renormalised.
        cfg = transformers.Qwen3MoeConfig(intermediate_size=96, moe_intermediate_size=48, head_dim=24,
                                          num_experts=6, norm_topk_prob=False,
                                          **{**common, "num_experts_per_tok": 3})
        model = transformers.Qwen3MoeForCausalLM(cfg)
    elif kind == "dbrx":
        # Fused Wqkv and expert tensors, bias-free LayerNorms; clip_qkv 2 clips some of q, k and v
        # at this initialisation (their std is ~1.6), so the clamp is exercised.
        cfg = transformers.DbrxConfig(
            vocab_size=VOCAB, d_model=64, n_heads=4, n_layers=3, max_seq_len=512, initializer_range=0.2,
            attn_config={"kv_n_heads": 2, "clip_qkv": 2.0, "rope_theta": 10000.0},
            ffn_config={"ffn_hidden_size": 96, "moe_num_experts": 6, "moe_top_k": 2, "moe_normalize_expert_weights": 1.0})
        model = transformers.DbrxForCausalLM(cfg)
    elif kind.startswith("gpt_oss"):
        model = _gpt_oss(kind)
    elif kind.startswith("deepseek"):
        model = _deepseek(kind)
    else:
        raise ValueError(f"kind {kind!r}: choose one of {', '.join(KINDS)}")
    model.eval()
    model.save_pretrained(directory)
    return model


def _gpt_oss(kind: str):
    """gpt-oss at shapes no other family's tiny checkpoint uses. "gpt_oss": 6 query heads over 2 KV
    heads, 8 experts top-3, windowed layers 0 and 2 (window 8, shorter than most prompts), YaRN
    (factor 4 over 128 original positions); "gpt_oss_gqa4": 8 over 2 heads (head size 8), 6 experts top-2,
    four layers full/windowed/full/windowed (window 16), plain RoPE. Both: the experts' gate/up
    weights drawn 3x wider than the rest, so the clamp (at gpt-oss's own limit, 7: transformers
    before 5.2x hardcodes it, whatever config.json says) binds on some gates, and the sinks and
    the router's and experts' biases (which transformers initialises to zero) drawn at random so
    they count."""
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=64, max_position_embeddings=512, initializer_range=0.2)
    if kind == "gpt_oss":
        cfg = transformers.GptOssConfig(
            num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2, head_dim=16, intermediate_size=40,
            num_local_experts=8, num_experts_per_tok=3, sliding_window=8,
            rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                             "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 128},
            **common)
    else:
        cfg = transformers.GptOssConfig(
            num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, head_dim=8, intermediate_size=48,
            num_local_experts=6, num_experts_per_tok=2, sliding_window=16,
            layer_types=["full_attention", "sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, **common)
    model = transformers.GptOssForCausalLM(cfg)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 1.0)
            layer.mlp.experts.gate_up_proj.normal_(0.0, 0.6)
            layer.mlp.router.bias.normal_(0.0, 0.5)
            layer.mlp.experts.gate_up_proj_bias.normal_(0.0, 0.5)
            layer.mlp.experts.down_proj_bias.normal_(0.0, 0.5)
    return model


def _deepseek(kind: str):
    """DeepSeek at three shapes. "deepseek_v3": q through a 24-wide bottleneck, 8 experts in 4
    groups (the best 2 kept), top-3, sigmoid scores with a random correction bias, weights x 2.5,
    one shared expert, layer 0 dense, YaRN with mscale; "deepseek_v3_noq": no q bottleneck, 6
    heads, 6 experts in 2 groups (1 kept), top-2, rotary dims rotated by halves
    (rope_interleave off), two dense layers; "deepseek_v2": softmax, group-limited greedy over 4
    groups of 3 (2 kept), top-4 not renormalised, two shared experts, YaRN with V2's mscale."""
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                  max_position_embeddings=512, initializer_range=0.2, kv_lora_rank=16, qk_rope_head_dim=8,
                  qk_nope_head_dim=12, v_head_dim=10)
    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128,
            "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
    if kind == "deepseek_v3":
        cfg = transformers.DeepseekV3Config(
            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24, n_routed_experts=8,
            num_experts_per_tok=3, n_group=4, topk_group=2, n_shared_experts=1, first_k_dense_replace=1,
            routed_scaling_factor=2.5, rope_parameters=yarn, **common)
        model = transformers.DeepseekV3ForCausalLM(cfg)
    elif kind == "deepseek_v3_noq":
        cfg = transformers.DeepseekV3Config(
            num_hidden_layers=4, num_attention_heads=6, num_key_value_heads=6, q_lora_rank=None, n_routed_experts=6,
            num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1, first_k_dense_replace=2,
            routed_scaling_factor=1.5, rope_interleave=False, **common)
        model = transformers.DeepseekV3ForCausalLM(cfg)
    else:
        cfg = transformers.DeepseekV2Config(
            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None, n_routed_experts=12,
            num_experts_per_tok=4, topk_method="group_limited_greedy", n_group=4, topk_group=2, n_shared_experts=2,
            first_k_dense_replace=1, norm_topk_prob=False, routed_scaling_factor=1.0,
            rope_parameters={**yarn, "mscale": 0.707, "mscale_all_dim": 0.707}, **common)
        model = transformers.DeepseekV2ForCausalLM(cfg)
    with torch.no_grad():
        for layer in model.model.layers:
            bias = getattr(getattr(layer.mlp, "gate", None), "e_score_correction_bias", None)
            if bias is not None:
                bias.normal_(0.0, 0.1)
    return model


def tiny_prompts() -> list[list[int]]:
    """The prompts every comparison uses: seeded token ids of PROMPT_LENGTHS, then two that share
    a prefix with earlier ones (so prefix caching finds blocks whenever they are admitted after
    those are computed): the 33-token prompt's first 21 tokens with 12 of their own, and the
    24-token prompt followed by the 17-token one's first 9 (a conversation's next turn)."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]
    own = torch.randint(0, VOCAB, (12,), generator=g).tolist()
    return prompts + [prompts[2][:21] + own, prompts[4] + prompts[1][:9]]
