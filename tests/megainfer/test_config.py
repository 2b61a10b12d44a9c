from __future__ import annotations

import json

import pytest

from megainfer.engine_config import EngineConfig
from megainfer.errors import CheckpointError, ConfigError
from megainfer.hf_config import from_hf_dict, from_pretrained, to_hf_dict
from megainfer.model_resolution import resolve_model
from megainfer.presets import PRESETS

QWEN3_30B = {
    "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048, "num_hidden_layers": 48,
    "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
    "num_experts_per_tok": 8, "moe_intermediate_size": 768, "intermediate_size": 6144, "norm_topk_prob": True,
    "rope_theta": 1000000.0, "rms_norm_eps": 1e-06, "max_position_embeddings": 40960,
    "tie_word_embeddings": False, "sliding_window": None, "use_sliding_window": False,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "eos_token_id": 151645, "bos_token_id": 151643,
}


def test_qwen3_config_parses_head_dim_and_experts():
    cfg = from_hf_dict(QWEN3_30B)
    assert cfg.head_dim == 128 and cfg.hidden_size // cfg.num_heads == 64
    assert (cfg.num_experts, cfg.top_k, cfg.expert_intermediate_size) == (128, 8, 768)
    assert cfg.qk_norm and cfg.norm_topk_prob and cfg.eos_token_ids == (151645,)
    assert cfg == PRESETS["qwen3-30b-a3b"].__class__(**{**cfg.__dict__})
    # The preset has the same shapes as the real config.
    p = PRESETS["qwen3-30b-a3b"]
    assert (p.hidden_size, p.num_layers, p.num_heads, p.num_kv_heads, p.head_dim, p.num_experts, p.top_k,
            p.expert_intermediate_size) == (2048, 48, 32, 4, 128, 128, 8, 768)


def test_rope_theta_from_rope_parameters_and_num_local_experts_spelling():
    raw = {k: v for k, v in QWEN3_30B.items() if k not in ("rope_theta", "num_experts")}
    raw["rope_parameters"] = {"rope_type": "default", "rope_theta": 5e5}
    raw["num_local_experts"] = 64
    cfg = from_hf_dict(raw)
    assert cfg.rope_theta == 5e5 and cfg.num_experts == 64


def test_mixtral_always_renormalises_and_defaults_head_dim():
    raw = {"model_type": "mixtral", "vocab_size": 32000, "hidden_size": 4096, "num_hidden_layers": 32,
           "num_attention_heads": 32, "num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2,
           "intermediate_size": 14336, "rope_theta": 1e6, "rms_norm_eps": 1e-5, "max_position_embeddings": 32768,
           "sliding_window": None}
    cfg = from_hf_dict(raw)
    assert cfg.norm_topk_prob and cfg.head_dim == 128 and not cfg.qk_norm
    assert from_hf_dict(to_hf_dict(cfg)) == cfg.__class__(**{**cfg.__dict__, "name": ""})


def test_unsupported_model_type_lists_supported_ones():
    with pytest.raises(ConfigError, match="'llama' is not supported.*mixtral, qwen3_moe"):
        from_hf_dict({"model_type": "llama"})


@pytest.mark.parametrize("change, match", [
    ({"num_key_value_heads": 5}, "multiple of"),
    ({"num_experts_per_tok": 200}, "exceeds the number of experts"),
    ({"mlp_only_layers": [0]}, "mlp_only_layers"),
    ({"sliding_window": 4096, "use_sliding_window": True}, "sliding_window"),
    ({"rope_parameters": {"rope_type": "longrope", "factor": 4.0}}, "rope type 'longrope'"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "yarn need 'factor' and 'original_max_position"),
    ({"hidden_size": None}, "'hidden_size' is missing"),
])
def test_bad_configs_name_the_field(change, match):
    with pytest.raises(ConfigError, match=match):
        from_hf_dict({**QWEN3_30B, **change})


def test_paper_presets_have_their_shapes():
    dbrx, scaled = PRESETS["dbrx"], PRESETS["scaled-moe"]
    assert (dbrx.num_experts, dbrx.top_k, dbrx.num_layers, dbrx.hidden_size, dbrx.expert_intermediate_size) == \
        (16, 4, 40, 6144, 10752)
    assert (scaled.num_layers, scaled.hidden_size, scaled.num_experts, scaled.top_k,
            scaled.expert_intermediate_size) == (48, 8192, 32, 4, 8192)
    assert 300e9 < scaled.num_params < 330e9  # MegaScale-Infer's 317B Scaled-MoE
    assert 45e9 < PRESETS["mixtral-8x7b"].num_params < 48e9
    assert 29e9 < PRESETS["qwen3-30b-a3b"].num_params < 32e9
    assert 3e9 < PRESETS["qwen3-30b-a3b"].num_active_params < 4e9
    assert PRESETS["tiny-mixtral"].runnable_with_random_weights
    assert not PRESETS["mixtral-8x22b"].runnable_with_random_weights


def test_resolve_model_errors(tmp_path):
    with pytest.raises(ConfigError, match="neither a checkpoint directory, a Hugging Face repo id .* nor a preset.*"
                                          "tiny-mixtral"):
        resolve_model("no-such-model")
    with pytest.raises(CheckpointError, match="no config.json"):
        resolve_model(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        resolve_model(tmp_path)


def test_generation_config_adds_eos_tokens(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_30B))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [151645, 151643]}))
    cfg, path = resolve_model(tmp_path)
    assert path == tmp_path and cfg.eos_token_ids == (151645, 151643)


@pytest.mark.parametrize("kwargs, match", [
    (dict(dtype="int8"), "dtype 'int8'"), (dict(block_size=0), "block_size"),
    (dict(prefill_policy="magic"), "prefill_policy 'magic'"), (dict(num_kv_blocks=-1), "num_kv_blocks"),
    (dict(device="tpu"), "device 'tpu'"),
])
def test_engine_config_validation(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        EngineConfig(**kwargs)


def test_config_modules_do_not_import_torch():
    import subprocess
    import sys
    code = ("import megainfer.config, megainfer.hf_config, megainfer.presets, megainfer.model_resolution, "
            "megainfer.engine_config, megainfer.settings, megainfer, sys; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("extra, method", [
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}, "'fp8'"),
    ({"quantization_config": {"quant_method": "awq", "bits": 4}}, "'awq'"),
    ({"quantization_config": {"quant_method": "gptq", "bits": 4}}, "'gptq'"),
    ({"quantization_config": {"quant_method": "compressed-tensors"}}, "'compressed-tensors'"),
    ({"compression_config": {"format": "float-quantized"}}, "'compressed-tensors'"),
])
def test_quantized_checkpoints_are_refused_naming_the_method(tmp_path, extra, method):
    (tmp_path / "config.json").write_text(json.dumps({**QWEN3_30B, **extra}))
    with pytest.raises(CheckpointError, match=f"quant_method = {method}.*unquantized float32, bfloat16 or "
                                              "float16 weights only.*unquantized release"):
        from_pretrained(tmp_path)


@pytest.mark.parametrize("written, parsed", [({"torch_dtype": "bfloat16"}, "bfloat16"),
                                             ({"dtype": "float16"}, "float16"),
                                             ({"torch_dtype": "float32"}, "float32"), ({}, None)])
def test_checkpoint_dtype_is_read_from_torch_dtype_or_dtype(written, parsed):
    assert from_hf_dict({**QWEN3_30B, **written}).torch_dtype == parsed


def test_auto_dtype_follows_the_checkpoint_and_presets_run_float32():
    bf16 = from_hf_dict({**QWEN3_30B, "torch_dtype": "bfloat16"})
    f32 = from_hf_dict({**QWEN3_30B, "torch_dtype": "float32"})
    auto = EngineConfig(dtype="auto", device="cpu")
    assert auto.resolve(bf16).dtype == "bfloat16"  # on the CPU too, as vLLM
    assert auto.resolve(f32).dtype == "float32"
    assert auto.resolve(PRESETS["tiny-mixtral"]).dtype == "float32"
    assert EngineConfig(dtype="float16").resolve(bf16).dtype == "float16"  # an explicit dtype wins
    odd = from_hf_dict({**QWEN3_30B, "torch_dtype": "float8_e4m3fn"})
    with pytest.raises(ConfigError, match="dtype 'float8_e4m3fn'.*pass --dtype"):
        auto.resolve(odd)


def test_sizing_refuses_an_unresolved_dtype():
    with pytest.raises(ConfigError, match="resolved against the model first"):
        EngineConfig(dtype="auto").resolved_num_kv_blocks(PRESETS["tiny-mixtral"], 4096, None)


@pytest.mark.parametrize("cuda, device", [(True, "cuda"), (False, "cpu")])
def test_auto_device_is_cuda_where_torch_sees_a_gpu(monkeypatch, cuda, device):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    resolved = EngineConfig(device="auto").resolve(PRESETS["tiny-mixtral"])
    assert resolved.device == device and EngineConfig(device="cuda:1").device == "cuda:1"
    with pytest.raises(ConfigError, match="device 'cuda:x'"):
        EngineConfig(device="cuda:x")


def test_engine_resolves_auto_before_anything_reads_the_config(monkeypatch):
    import torch

    from megainfer.engine.engine import Engine

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    engine = Engine("tiny-mixtral", EngineConfig(dtype="auto", device="auto", num_kv_blocks=16))
    assert (engine.config.dtype, engine.config.device) == ("float32", "cpu")
    assert engine.runner.dtype == torch.float32 and engine.runner.device == torch.device("cpu")
