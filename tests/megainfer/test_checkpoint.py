"""Loading checkpoints: sharded with an index, dtypes, missing or mis-shaped tensors, tokenizers."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from megainfer import LLM, SamplingParams
from megainfer.errors import CheckpointError, RequestError

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def copy_ckpt(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_sharded_checkpoint_with_index_loads_the_same(mixtral_ref, tmp_path):
    ckpt = copy_ckpt(mixtral_ref.path, tmp_path / "sharded")
    tensors = load_file(ckpt / "model.safetensors")
    (ckpt / "model.safetensors").unlink()
    names = sorted(tensors)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    for fname, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, ckpt / fname)
    weight_map = {k: f for f, keys in shards.items() for k in keys}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    out = LLM(str(ckpt)).generate([mixtral_ref.prompts[0]], GREEDY)[0].outputs[0]
    assert out.token_ids == mixtral_ref.tokens[0][:12]


def test_missing_tensor_names_tensor_and_shape(mixtral_ref, tmp_path):
    ckpt = copy_ckpt(mixtral_ref.path, tmp_path / "missing")
    tensors = load_file(ckpt / "model.safetensors")
    del tensors["model.layers.1.block_sparse_moe.experts.3.w2.weight"]
    save_file(tensors, ckpt / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"experts\.3\.w2\.weight' is missing \(expected shape \[64, 96\]\)"):
        LLM(str(ckpt))


def test_misshaped_tensor_names_both_shapes(qwen3_ref, tmp_path):
    ckpt = copy_ckpt(qwen3_ref.path, tmp_path / "misshaped")
    tensors = load_file(ckpt / "model.safetensors")
    tensors["model.layers.0.self_attn.q_norm.weight"] = torch.ones(16)
    save_file(tensors, ckpt / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"q_norm\.weight' has shape \[16\], expected \[24\]"):
        LLM(str(ckpt))


def test_directory_without_safetensors(mixtral_ref, tmp_path):
    ckpt = tmp_path / "empty"
    ckpt.mkdir()
    shutil.copy(mixtral_ref.path / "config.json", ckpt)
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors"):
        LLM(str(ckpt))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_loads_and_runs(mixtral_ref, dtype):
    llm = LLM(str(mixtral_ref.path), dtype=dtype)
    model = llm.engine.runner.model
    assert model.expert_layers["0"].w_gate_up.dtype == getattr(torch, dtype)
    assert llm.engine.runner.kv_caches[0][0].dtype == getattr(torch, dtype)
    out = llm.generate([mixtral_ref.prompts[1]], GREEDY)[0].outputs[0]
    assert len(out.token_ids) == 12
    # Half-precision rounding may flip later greedy choices, not the first.
    assert out.token_ids[0] == mixtral_ref.tokens[1][0]


def test_tokenizer_json_is_used(mixtral_ref, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    ckpt = copy_ckpt(mixtral_ref.path, tmp_path / "with-tokenizer")
    vocab = {f"w{i}": i for i in range(300)}
    vocab["[UNK]"] = 300
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(ckpt / "tokenizer.json"))
    llm = LLM(str(ckpt))
    out = llm.generate("w5 w17 w250", GREEDY)[0]
    assert out.prompt_token_ids == [5, 17, 250]
    assert out.outputs[0].text == tok.decode(out.outputs[0].token_ids)


def test_text_prompt_without_tokenizer_is_a_request_error(mixtral_ref):
    # vocab 320 with no tokenizer.json: the byte tokenizer applies (ids 0..257)
    llm = LLM(str(mixtral_ref.path))
    assert llm.generate("hi", GREEDY)[0].prompt_token_ids == [256, 104, 105]
    with pytest.raises(RequestError, match=r"token ids must be integers in \[0, 320\)"):
        llm.generate([[1, 2, 320]], GREEDY)


def test_quantized_config_is_refused_before_weights_load(mixtral_ref, tmp_path):
    ckpt = copy_ckpt(mixtral_ref.path, tmp_path / "fp8-config")
    config = json.loads((ckpt / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="quant_method = 'fp8'.*unquantized release"):
        LLM(str(ckpt))


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.int8, torch.uint8])
def test_quantized_weights_without_a_quantization_config_are_refused(mixtral_ref, tmp_path, dtype):
    ckpt = copy_ckpt(mixtral_ref.path, tmp_path / "packed")
    tensors = load_file(ckpt / "model.safetensors")
    name = "model.layers.0.self_attn.q_proj.weight"
    tensors[name] = tensors[name].to(dtype)
    save_file(tensors, ckpt / "model.safetensors")
    kind = str(dtype).removeprefix("torch.")
    with pytest.raises(CheckpointError, match=rf"q_proj\.weight' is {kind}: the checkpoint is quantized"):
        LLM(str(ckpt))


@pytest.mark.parametrize("suffix", ["weight_scale_inv", "weight_scale", "input_scale", "qzeros"])
def test_scale_tensors_mark_a_quantized_checkpoint(mixtral_ref, tmp_path, suffix):
    ckpt = copy_ckpt(mixtral_ref.path, tmp_path / "scales")
    tensors = load_file(ckpt / "model.safetensors")
    tensors[f"model.layers.0.self_attn.q_proj.{suffix}"] = torch.ones(1)
    save_file(tensors, ckpt / "model.safetensors")
    with pytest.raises(CheckpointError, match=rf"1 quantization tensors, e\.g\. .*q_proj\.{suffix}'"):
        LLM(str(ckpt))
