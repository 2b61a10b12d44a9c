"""DeepSeek-V2/V3: config.json read, the grouped routing as transformers' routers route, a
block-scaled FP8 checkpoint served as its dequantized weights, and MLA's attention through the
latent kernels, which decode graphs capture."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from kernels import PagedAttentionBatch
from megainfer import LLM, SamplingParams
from megainfer.hf_config import from_hf_dict
from megainfer.model.grouped_routing import grouped_choice, grouped_weights
from megainfer.model.weights import dequantize_fp8
from megainfer.presets import PRESETS

V3 = {"model_type": "deepseek_v3", "vocab_size": 300, "hidden_size": 64, "num_hidden_layers": 3,
      "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 24, "kv_lora_rank": 16,
      "qk_rope_head_dim": 8, "qk_nope_head_dim": 12, "v_head_dim": 10, "n_routed_experts": 8,
      "num_experts_per_tok": 3, "moe_intermediate_size": 32, "intermediate_size": 96, "n_shared_experts": 1,
      "first_k_dense_replace": 1, "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5,
      "norm_topk_prob": True, "max_position_embeddings": 512}


def test_v3_config():
    cfg = from_hf_dict(dict(V3), "tiny")
    assert cfg.mla and cfg.kv_cache_width == 24 and cfg.kv_cache_heads == (1, 24) and cfg.head_dim == 20
    assert (cfg.scoring, cfg.n_group, cfg.topk_group, cfg.score_correction_bias) == ("sigmoid", 4, 2, True)
    assert cfg.num_moe_layers == 2 and not cfg.is_moe_layer(0) and cfg.rope_interleave
    v2 = from_hf_dict({**V3, "model_type": "deepseek_v2", "topk_method": "greedy", "q_lora_rank": None}, "tiny")
    assert (v2.scoring, v2.n_group, v2.q_lora_rank, v2.score_correction_bias) == ("softmax", 1, None, False)


@pytest.mark.parametrize("change, words", [
    ({"attention_bias": True}, "attention_bias"),
    ({"topk_method": "group_limited_greedy"}, "topk_method 'group_limited_greedy'"),
    ({"n_group": 3}, "n_group"),
    ({"first_k_dense_replace": 3}, "first_k_dense_replace"),
    ({"quantization_config": {"quant_method": "fp8"}}, "quantized"),  # FP8 without its block size
])
def test_config_refuses_what_it_cannot_serve_by_name(change, words):
    with pytest.raises(Exception, match=words):
        from_hf_dict({**V3, **change}, "tiny")


@pytest.mark.parametrize("version", ["v2", "v3"])
def test_grouped_routing_chooses_and_weighs_as_transformers(version):
    """Ids (as a set per token) and weights against transformers' own router on random logits."""
    import transformers
    from transformers.models.deepseek_v2 import modeling_deepseek_v2 as m2
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as m3

    torch.manual_seed(0)
    common = dict(hidden_size=32, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2)
    if version == "v3":
        hf = transformers.DeepseekV3Config(routed_scaling_factor=2.5, norm_topk_prob=True, **common)
        router = m3.DeepseekV3TopkRouter(hf)
        router.e_score_correction_bias.normal_(0, 0.2)
        cfg = from_hf_dict({**V3, "hidden_size": 32, "n_routed_experts": 16, "num_experts_per_tok": 4}, "t")
    else:
        hf = transformers.DeepseekV2Config(topk_method="group_limited_greedy", routed_scaling_factor=1.5,
                                           norm_topk_prob=False, **common)
        router = m2.DeepseekV2TopkRouter(hf)
        cfg = from_hf_dict({**V3, "model_type": "deepseek_v2", "hidden_size": 32, "n_routed_experts": 16,
                            "num_experts_per_tok": 4, "topk_method": "group_limited_greedy",
                            "routed_scaling_factor": 1.5, "norm_topk_prob": False}, "t")
    router.weight.data.normal_(0, 1.0)
    x = torch.randn(64, 32)
    _, want_weights, want_ids = router(x)
    logits = x @ router.weight.T
    bias = getattr(router, "e_score_correction_bias", None)
    choice, scores = grouped_choice(logits, cfg, bias)
    ids = choice.topk(cfg.top_k, dim=-1).indices
    weights = grouped_weights(scores, ids, cfg)
    order_ours, order_theirs = ids.argsort(dim=-1), want_ids.argsort(dim=-1)
    assert torch.equal(ids.gather(1, order_ours), want_ids.gather(1, order_theirs))
    torch.testing.assert_close(weights.gather(1, order_ours), want_weights.gather(1, order_theirs))


def quantize_fp8(weight: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] float -> (float8_e4m3fn weight, float32 scale_inv per block), DeepSeek's layout."""
    rows, cols = weight.shape
    tiles = torch.nn.functional.pad(weight, (0, -cols % block, 0, -rows % block)).unfold(0, block, block) \
        .unfold(1, block, block)
    scale_inv = tiles.abs().amax((-1, -2)).clamp(min=1e-12) / 448.0
    expanded = scale_inv.repeat_interleave(block, 0)[:rows].repeat_interleave(block, 1)[:, :cols]
    return (weight / expanded).to(torch.float8_e4m3fn), scale_inv


def test_fp8_checkpoint_serves_the_tokens_of_its_dequantized_weights(tmp_path):
    """A DeepSeek-V3 checkpoint in block-scaled FP8 (as deepseek-ai/DeepSeek-V3 is published, its
    weight_block_size here 16): the tokens transformers gives for the dequantized weights."""
    import transformers

    torch.manual_seed(0)
    hf = transformers.DeepseekV3Config(**{k: v for k, v in V3.items() if k != "model_type"}, initializer_range=0.2)
    model = transformers.DeepseekV3ForCausalLM(hf).eval()
    float_dir, fp8_dir = tmp_path / "float", tmp_path / "fp8"
    quantized = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 2 and "layers." in name and "norm" not in name and ".gate." not in name:
                weight, scale_inv = quantize_fp8(param.data, 16)
                param.copy_(dequantize_fp8(weight, scale_inv, (16, 16)))  # transformers runs the dequantized
                quantized[name] = (weight, scale_inv)
    model.save_pretrained(float_dir)
    shutil.copytree(float_dir, fp8_dir)
    tensors = load_file(fp8_dir / "model.safetensors")
    for name, (weight, scale_inv) in quantized.items():
        tensors[name], tensors[name + "_scale_inv"] = weight.contiguous(), scale_inv.contiguous()
    save_file(tensors, fp8_dir / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((fp8_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [16, 16],
                                     "activation_scheme": "dynamic"}
    (fp8_dir / "config.json").write_text(json.dumps(config))
    assert len(quantized) > 20

    prompt = torch.randint(0, 300, (12,), generator=torch.Generator().manual_seed(3)).tolist()
    want = model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(prompt):].tolist()
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    assert LLM(str(fp8_dir), dtype="float32").generate([prompt], params)[0].outputs[0].token_ids == want


def test_mla_takes_the_latent_kernels_and_decode_captures_its_graphs(monkeypatch):
    """MLA's 576-wide heads no longer keep a GPU's decode eager: they run kernels.latent_attention
    (tests/kernels/test_kernels.py), which the graphs capture."""
    from megainfer.disagg.decode_graphs import eager_reason
    from megainfer.model import latent_attention

    monkeypatch.delenv("MEGAINFER_KERNELS", raising=False)
    assert eager_reason(torch.device("cuda"), False) == ""
    assert eager_reason(torch.device("cuda"), True) == "eager (--enforce-eager)"
    calls = []
    monkeypatch.setattr(latent_attention.kernels, "latent_attention",
                        lambda query, cache, batch, scale, rank: calls.append(rank) or query[..., :rank])
    cfg = from_hf_dict(V3)
    layer = latent_attention.LatentAttention(cfg, cfg.num_heads, torch.float32, "cpu")
    cache = torch.zeros(2, 16, 1, cfg.kv_cache_width)
    batch = PagedAttentionBatch.of(torch.tensor([[0]], dtype=torch.int32), [3], [3])
    cos = sin = torch.ones(8, cfg.qk_rope_head_dim)
    layer(torch.randn(3, cfg.hidden_size), torch.arange(3), cos, sin, cache, batch)
    assert calls == [cfg.kv_lora_rank]


def test_presets_have_the_published_sizes():
    v3, lite = PRESETS["deepseek-v3"], PRESETS["deepseek-v2-lite"]
    assert round(v3.num_params / 1e9) == 671 and round(v3.num_active_params / 1e9) == 38
    assert round(lite.num_params / 1e9, 1) == 15.7
    assert v3.kv_bytes_per_token("bfloat16") == 61 * 576 * 2  # the latent and rotary key, not 128 heads
