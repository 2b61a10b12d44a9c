"""Tiny random Mixtral, Qwen3-MoE and DBRX checkpoints written by transformers' own `save_pretrained`
(the GPU check's engine comparisons and the test suite's fixtures), with the prompts they are
compared on."""

from __future__ import annotations

from pathlib import Path

import torch

KINDS = ("mixtral", "qwen3_moe", "dbrx")
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
    else:
        raise ValueError(f"kind {kind!r}: choose one of {', '.join(KINDS)}")
    model.eval()
    model.save_pretrained(directory)
    return model


def tiny_prompts() -> list[list[int]]:
    """The prompts every comparison uses: seeded token ids of PROMPT_LENGTHS."""
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]
