"""gpt-oss (GptOssForCausalLM): its config.json read, YaRN's tables and MXFP4's values as
transformers computes them, the windowed layers' KV blocks released as a sequence passes them,
and greedy tokens equal to transformers colocated (whole, chunked, preempted, layered) and cut
into halves over two expert nodes."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from megainfer import LLM, SamplingParams
from megainfer.config import RopeScaling
from megainfer.hf_config import from_hf_dict
from megainfer.model import mxfp4
from megainfer.model.rotary import yarn_inv_freq
from megainfer.presets import PRESETS
from megainfer.scheduling.kv_cache import RELEASED, BlockManager
from megainfer.scheduling.sequence import Sequence

GPT_OSS_CONFIG = {
    "model_type": "gpt_oss", "vocab_size": 300, "hidden_size": 64, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_local_experts": 4,
    "num_experts_per_tok": 2, "intermediate_size": 32, "max_position_embeddings": 1024, "sliding_window": 8,
    "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                        "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096},
}


def test_config_reads_windows_sinks_biases_clamp_and_yarn():
    cfg = from_hf_dict(dict(GPT_OSS_CONFIG), "tiny")
    assert cfg.window_layers == (0, 2) and cfg.sliding_window == 8 and cfg.kv_window == 8
    assert cfg.attention_sinks and cfg.router_bias and cfg.expert_bias and cfg.attention_bias
    assert (cfg.swiglu_alpha, cfg.swiglu_limit) == (1.702, 7.0)
    assert cfg.rope_scaling == RopeScaling(32.0, 4096, truncate=False)
    assert cfg.kv_cache_layers == 2  # two windowed layers share their tensors with two full ones
    assert [cfg.window_of(i) for i in range(4)] == [8, 0, 8, 0]
    explicit = from_hf_dict({**GPT_OSS_CONFIG, "layer_types": ["full_attention"] * 3 + ["sliding_attention"]}, "t")
    assert explicit.window_layers == (3,) and explicit.kv_cache_layers == 3
    # A window of a sequence's table: its blocks past the window released, the one being written.
    assert cfg.kv_blocks_per_sequence(100, 4) == 25 + 3


@pytest.mark.parametrize("change, words", [
    ({"layer_types": ["sliding_attention"] * 4}, "every layer is a sliding_attention layer"),
    ({"layer_types": ["full_attention", "chunked_attention", "full_attention", "full_attention"]}, "layer_types"),
    ({"sliding_window": 0}, "sliding_window must be a positive integer"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "'longrope'"),
    ({"quantization_config": {"quant_method": "fp8"}}, "'fp8'"),
])
def test_config_refuses_what_it_cannot_serve_by_name(change, words):
    with pytest.raises(Exception, match=words):
        from_hf_dict({**GPT_OSS_CONFIG, **change}, "tiny")


def test_mxfp4_config_is_accepted():
    cfg = from_hf_dict({**GPT_OSS_CONFIG, "quantization_config": {"quant_method": "mxfp4"}}, "tiny")
    assert cfg.model_type == "gpt_oss"


@pytest.mark.parametrize("scaling", [RopeScaling(32.0, 4096, truncate=False), RopeScaling(4.0, 64),
                                     RopeScaling(40.0, 4096, mscale=1.0, mscale_all_dim=1.0)])
def test_yarn_tables_are_transformers_bit_for_bit(scaling):
    from transformers import GptOssConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": scaling.factor,
              "original_max_position_embeddings": scaling.original_max_position_embeddings,
              "truncate": scaling.truncate, "mscale": scaling.mscale, "mscale_all_dim": scaling.mscale_all_dim}
    hf = GptOssConfig(head_dim=64, max_position_embeddings=131072, rope_parameters=params)
    want, want_factor = ROPE_INIT_FUNCTIONS["yarn"](hf)
    got, factor = yarn_inv_freq(64, 150000.0, scaling, 131072)
    assert torch.equal(got, want) and factor == want_factor


def test_mxfp4_dequantization_equals_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 10, 2, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(115, 135, (3, 10, 2), dtype=torch.uint8, generator=g)
    assert torch.equal(mxfp4.dequantize(blocks, scales), convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, in, out] -> MXFP4 blocks [E, out, in / 32, 16] and scales (the published layout): each
    32 inputs of an output share a power of two, each weight its nearest E2M1 value."""
    rows = weight.transpose(1, 2).float()  # [E, out, in]
    groups = rows.reshape(*rows.shape[:2], -1, mxfp4.GROUP)
    exponent = torch.ceil(torch.log2(groups.abs().amax(-1).clamp(min=1e-30) / 6.0)).clamp(-127, 127)
    lut = torch.tensor(mxfp4.FP4_VALUES)
    scaled = groups / torch.exp2(exponent)[..., None]
    codes = (scaled[..., None] - lut).abs().argmin(-1).to(torch.uint8)  # nearest of the sixteen values
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    return blocks, (exponent + mxfp4.SCALE_BIAS).to(torch.uint8)


def test_mxfp4_checkpoint_serves_the_tokens_of_its_dequantized_weights(tmp_path):
    """A gpt-oss checkpoint whose experts are stored in MXFP4 (as openai/gpt-oss-* are) gives the
    tokens transformers gives for the same weights dequantized."""
    import transformers

    torch.manual_seed(0)
    hf = transformers.GptOssConfig(vocab_size=200, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=16, intermediate_size=32, num_local_experts=4,
                                   num_experts_per_tok=2, sliding_window=8, max_position_embeddings=256,
                                   initializer_range=0.2)
    model = transformers.GptOssForCausalLM(hf).eval()
    quantized = {}
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            for proj in ("gate_up_proj", "down_proj"):
                param = getattr(layer.mlp.experts, proj)
                blocks, scales = quantize_mxfp4(param.data)
                param.copy_(mxfp4.dequantize(blocks, scales))  # transformers runs the dequantized values
                quantized[f"model.layers.{i}.mlp.experts.{proj}"] = (blocks, scales)
    float_dir, mx_dir = tmp_path / "float", tmp_path / "mxfp4"
    model.save_pretrained(float_dir)
    shutil.copytree(float_dir, mx_dir)
    tensors = load_file(mx_dir / "model.safetensors")
    for name, (blocks, scales) in quantized.items():
        del tensors[name]
        tensors[name + "_blocks"], tensors[name + "_scales"] = blocks.contiguous(), scales.contiguous()
    save_file(tensors, mx_dir / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((mx_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (mx_dir / "config.json").write_text(json.dumps(config))

    prompt = torch.randint(0, 200, (12,), generator=torch.Generator().manual_seed(3)).tolist()
    want = model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(prompt):].tolist()
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    got = LLM(str(mx_dir), dtype="float32").generate([prompt], params)[0].outputs[0].token_ids
    assert got == want


def test_window_blocks_are_released_as_a_sequence_passes_them():
    blocks = BlockManager(64, 4, window=6)
    seq = Sequence("a", [1] * 10, SamplingParams())
    blocks.allocate(seq, 10)
    seq.num_computed_tokens = 10
    held = []
    for _ in range(40):
        assert blocks.can_allocate(seq, 1)
        blocks.allocate(seq, 1)
        seq.num_computed_tokens += 1
        held.append(len(seq.window_table) - seq.window_released)
        first_visible = (seq.num_computed_tokens - 1 - 6 + 1) // 4  # the block of the last query's first key
        assert seq.window_table[:seq.window_released] == [RELEASED] * seq.window_released
        assert seq.window_released <= first_visible  # nothing a query still reads was released
    assert max(held) <= 3 and len(seq.block_table) == -(-50 // 4)  # flat, while the full table grows
    blocks.free(seq)
    assert blocks.num_free_blocks == 64 and len(set(blocks.free_block_ids)) == 64


def test_prompt_longer_than_the_window_keeps_its_window_blocks_flat(gpt_oss_ref):
    """A 120-token prompt decoding 64 more: token-equal to transformers, and the windowed layers'
    blocks stay within a window's worth while the full-attention layers' blocks grow."""
    import transformers

    model = transformers.GptOssForCausalLM.from_pretrained(gpt_oss_ref.path).eval()
    prompt = torch.randint(0, 320, (120,), generator=torch.Generator().manual_seed(7)).tolist()
    want = model.generate(torch.tensor([prompt]), max_new_tokens=64, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(prompt):].tolist()
    llm = LLM(str(gpt_oss_ref.path), dtype="float32", block_size=4, max_num_batched_tokens=32)
    engine = llm.engine
    window = engine.model_config.sliding_window
    engine.add_request("long", prompt, SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True))
    held, tokens = [], []
    while engine.has_unfinished_requests():
        for delta in engine.step():
            tokens += delta.new_token_ids
        for seq in engine.scheduler.running:
            held.append((seq.num_computed_tokens, len(seq.block_table), len(seq.window_table) - seq.window_released))
    assert tokens == want
    limit = -(-(window - 1) // 4) + 1 + -(-32 // 4)  # a window's blocks, the one written, a chunk's
    assert max(w for _, _, w in held) <= limit
    assert held[-1][1] >= (120 + 63) // 4  # the full-attention layers kept every block
    assert engine.stats().kv_cache_usage == 0.0


def test_presets_have_the_published_sizes():
    small, large = PRESETS["gpt-oss-20b"], PRESETS["gpt-oss-120b"]
    assert round(small.num_params / 1e9, 1) == 20.9 and round(large.num_params / 1e9, 1) == 116.8
    assert small.window_layers == tuple(range(0, 24, 2)) and small.kv_cache_layers == 12
    # 8K-token sequences: the windowed half holds 9 blocks each instead of 512.
    assert small.kv_blocks_per_sequence(8192, 16) == 512 + 9


def test_tiny_checkpoints_bind_the_clamp(gpt_oss_ref):
    """The tiny checkpoints' experts see gate values past gpt-oss's limit (7), so the equality
    tests cover the clamp (at the limit every transformers version applies)."""
    import transformers

    model = transformers.GptOssForCausalLM.from_pretrained(gpt_oss_ref.path).eval()
    seen = []

    def gates(module, args):
        x = args[0].reshape(-1, args[0].shape[-1])
        seen.append((torch.einsum("th,ehi->eti", x, module.gate_up_proj) + module.gate_up_proj_bias[:, None])[..., ::2])

    for layer in model.model.layers:
        layer.mlp.experts.register_forward_pre_hook(gates)
    with torch.no_grad():
        model(torch.tensor([gpt_oss_ref.prompts[2]]))
    # 7.0: gpt-oss's limit (transformers 5.17's GptOssConfig, the GPU machine's, has no swiglu_limit)
    assert max(float(g.max()) for g in seen) > 7.0
