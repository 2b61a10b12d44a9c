"""Hugging Face checkpoints' configuration files, read into a `ModelConfig` and written back.

`from_hf_dict` parses a `config.json` (model types `mixtral` and `qwen3_moe`), refusing what
megainfer does not run (quantized weights, scaled RoPE, sliding windows, dense layers);
`from_pretrained` reads a checkpoint directory's config.json and its generation_config.json's
EOS tokens; `to_hf_dict` is the config.json a checkpoint of a model carries. Torch-free.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from megainfer.config import SUPPORTED_MODEL_TYPES, ModelConfig
from megainfer.errors import CheckpointError, ConfigError
from megainfer.presets import PRESETS

# Spellings of a dtype config.json files use, as megainfer names it.
_DTYPE_ALIASES = {"float": "float32", "half": "float16", "bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def _rope_theta(cfg: dict[str, Any], name: str, model_type: str, fallback: float | None = None) -> float:
    """The checkpoint's RoPE theta (`fallback` where the file names none at the top level),
    refusing what megainfer does not run (scaled RoPE, sliding windows)."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ConfigError(f"{name}: rope type {rope_type!r} (rope_parameters.rope_type) is not "
                          "supported; only the default RoPE is")
    rope_theta = cfg.get("rope_theta", rope.get("rope_theta", fallback))
    if rope_theta is None:
        raise ConfigError(f"{name}: no rope theta: neither 'rope_theta' nor 'rope_parameters.rope_theta' is set")
    sliding = cfg.get("sliding_window")
    if sliding is not None and cfg.get("use_sliding_window", model_type == "mixtral"):
        raise ConfigError(f"{name}: sliding_window={sliding} is not supported; set it to null")
    return rope_theta


def _checkpoint_dtype(cfg: dict[str, Any]) -> str | None:
    """config.json's weights dtype (`torch_dtype`, or `dtype` as transformers 5 writes it)."""
    value = cfg.get("torch_dtype", cfg.get("dtype"))
    if not isinstance(value, str) or value == "auto":  # "auto": the checkpoint names none
        return None
    value = value.removeprefix("torch.")
    return _DTYPE_ALIASES.get(value, value)


def read_json_object(path: Path) -> dict[str, Any]:
    """A checkpoint's optional JSON file that holds one object (generation_config.json,
    tokenizer_config.json): {} when absent, a CheckpointError naming the file when malformed."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: must hold a JSON object, got {type(data).__name__}")
    return data


def refuse_quantized(cfg: dict[str, Any], name: str = "") -> None:
    """A quantized checkpoint is a CheckpointError naming its method: the engine has no
    quantized kernels, and running such weights as floats would produce garbage."""
    for key in ("quantization_config", "compression_config"):
        spec = cfg.get(key)
        if spec:
            method = (spec.get("quant_method") if isinstance(spec, dict) else None) or (
                "compressed-tensors" if key == "compression_config" else "unknown")
            raise CheckpointError(
                f"{name or 'config.json'}: the checkpoint is quantized ({key}.quant_method = {method!r}); "
                "megainfer runs unquantized float32, bfloat16 or float16 weights only. Use the model's "
                "unquantized release (the repo without an -FP8/-AWQ/-GPTQ/-Int4 suffix)")



def from_hf_dict(cfg: dict[str, Any], name: str = "") -> ModelConfig:
    """A `ModelConfig` from a parsed config.json; `name` (its directory or hub id) is for messages."""
    refuse_quantized(cfg, name)
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(
            f"{name or 'config.json'}: model_type {model_type!r} is not supported; "
            f"supported model types: {', '.join(SUPPORTED_MODEL_TYPES)}")

    def need(key: str, *alternatives: str) -> Any:
        for k in (key, *alternatives):
            if cfg.get(k) is not None:
                return cfg[k]
        raise ConfigError(f"{name or 'config.json'}: required field '{key}' is missing")

    if model_type == "dbrx":
        return ModelConfig(**_dbrx_fields(cfg, name, need), name=name, eos_token_ids=_eos_ids(cfg),
                           bos_token_id=cfg.get("bos_token_id"), torch_dtype=_checkpoint_dtype(cfg))
    rope_theta = _rope_theta(cfg, name, model_type)
    if model_type == "qwen3_moe":
        if cfg.get("mlp_only_layers") or cfg.get("decoder_sparse_step", 1) != 1:
            raise ConfigError(f"{name}: dense (mlp_only_layers / decoder_sparse_step) layers are not "
                              "supported; every layer must be an MoE layer")
        num_experts = need("num_experts", "num_local_experts")
        intermediate = need("moe_intermediate_size")
        norm_topk = bool(cfg.get("norm_topk_prob", False))
    else:
        num_experts = need("num_local_experts")
        intermediate = need("intermediate_size")
        norm_topk = True  # Mixtral always renormalises its top-k weights
    hidden = need("hidden_size")
    heads = need("num_attention_heads")
    eos_ids = _eos_ids(cfg)
    return ModelConfig(
        model_type=model_type,
        vocab_size=need("vocab_size"),
        hidden_size=hidden,
        num_layers=need("num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or hidden // heads,
        num_experts=num_experts,
        top_k=need("num_experts_per_tok"),
        expert_intermediate_size=intermediate,
        norm_topk_prob=norm_topk,
        rope_theta=float(rope_theta),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=need("max_position_embeddings"),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", False)),
        qk_norm=model_type == "qwen3_moe",
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos_ids,
        name=name,
        torch_dtype=_checkpoint_dtype(cfg),
    )


def _eos_ids(cfg: dict[str, Any]) -> tuple[int, ...]:
    eos = cfg.get("eos_token_id")
    return tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))


def _dbrx_fields(cfg: dict[str, Any], name: str, need) -> dict[str, Any]:
    """DBRX's config.json (its attention and FFN settings in nested `attn_config`, `ffn_config`)
    as `ModelConfig` fields; what megainfer does not run is refused by name."""
    attn, ffn = cfg.get("attn_config") or {}, cfg.get("ffn_config") or {}
    where = name or "config.json"
    act = (ffn.get("ffn_act_fn") or {}).get("name", "silu")
    if act != "silu":
        raise ConfigError(f"{where}: ffn_config.ffn_act_fn {act!r} is not supported; DBRX's experts run SiLU")
    p = ffn.get("moe_normalize_expert_weights", 1.0)
    if p not in (None, 1, 1.0):
        raise ConfigError(f"{where}: ffn_config.moe_normalize_expert_weights {p!r} is not supported: the top-k "
                          "weights are renormalised by their sum (1) or not at all (null)")
    if attn.get("qk_ln"):
        raise ConfigError(f"{where}: attn_config.qk_ln (LayerNorm on q and k) is not supported")
    # transformers 5 writes `rope_parameters` (and reads only it); DBRX's own config.json gives
    # attn_config.rope_theta, which transformers 5 ignores: megainfer follows the file.
    theta = _rope_theta(cfg, where, "dbrx", fallback=attn.get("rope_theta", 10000.0))
    hidden, heads = need("d_model", "hidden_size"), need("n_heads", "num_attention_heads")
    for key in ("moe_num_experts", "moe_top_k", "ffn_hidden_size"):
        if ffn.get(key) is None:
            raise ConfigError(f"{where}: required field 'ffn_config.{key}' is missing")
    return dict(model_type="dbrx", vocab_size=need("vocab_size"), hidden_size=hidden,
                num_layers=need("n_layers", "num_hidden_layers"), num_heads=heads,
                num_kv_heads=attn.get("kv_n_heads") or heads, head_dim=hidden // heads,
                num_experts=ffn["moe_num_experts"], top_k=ffn["moe_top_k"],
                expert_intermediate_size=ffn["ffn_hidden_size"], norm_topk_prob=p is not None,
                rope_theta=float(theta), rms_norm_eps=1e-5,  # torch's LayerNorm default, which DBRX keeps
                max_position_embeddings=need("max_seq_len", "max_position_embeddings"),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)), norm="layer",
                clip_qkv=attn.get("clip_qkv"))


def from_pretrained(path: str | os.PathLike) -> ModelConfig:
    """The `ModelConfig` of a local checkpoint directory (config.json, and generation_config.json's EOS ids)."""
    directory = Path(path)
    config_file = directory / "config.json"
    if not directory.is_dir():
        raise CheckpointError(f"checkpoint directory {str(directory)!r} does not exist; pass a local "
                              f"directory with config.json and *.safetensors, or a preset ({', '.join(PRESETS)})")
    if not config_file.is_file():
        raise CheckpointError(f"{directory}: no config.json; a checkpoint directory needs config.json "
                              "and *.safetensors")
    try:
        raw = json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{config_file}: not valid JSON ({exc})") from None
    cfg = from_hf_dict(raw, name=str(directory))
    # generation_config.json may name further EOS tokens (chat models' end-of-turn).
    eos = read_json_object(directory / "generation_config.json").get("eos_token_id")
    if eos is not None:
        extra = eos if isinstance(eos, list) else [eos]
        merged = tuple(dict.fromkeys([*cfg.eos_token_ids, *map(int, extra)]))
        cfg = dataclasses.replace(cfg, eos_token_ids=merged)
    return cfg


def to_hf_dict(model: ModelConfig) -> dict[str, Any]:
    """The config.json a checkpoint of this model carries (inverse of `from_hf_dict`)."""
    if model.model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(f"preset {model.name!r} ({model.model_type}) is shape-only and has no checkpoint form")
    if model.model_type == "dbrx":
        raise ConfigError(f"{model.name!r}: megainfer writes no DBRX checkpoints; build one with transformers' "
                          "DbrxConfig and save_pretrained")
    if model.router_logit_bias:
        raise ConfigError(f"preset {model.name!r} biases its router by a fixed vector, which no config.json of "
                          f"{model.model_type} can hold: serve the preset itself, not a checkpoint of it")
    cfg: dict[str, Any] = {
        "model_type": model.model_type,
        "architectures": ["MixtralForCausalLM" if model.model_type == "mixtral" else "Qwen3MoeForCausalLM"],
        "vocab_size": model.vocab_size,
        "hidden_size": model.hidden_size,
        "num_hidden_layers": model.num_layers,
        "num_attention_heads": model.num_heads,
        "num_key_value_heads": model.num_kv_heads,
        "head_dim": model.head_dim,
        "num_experts_per_tok": model.top_k,
        "rope_theta": model.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": model.rope_theta},
        "rms_norm_eps": model.rms_norm_eps,
        "max_position_embeddings": model.max_position_embeddings,
        "tie_word_embeddings": model.tie_word_embeddings,
        "hidden_act": "silu",
        "sliding_window": None,
        "bos_token_id": model.bos_token_id,
        "eos_token_id": list(model.eos_token_ids) if len(model.eos_token_ids) != 1 else model.eos_token_ids[0],
    }
    if model.model_type == "mixtral":
        cfg.update(num_local_experts=model.num_experts, intermediate_size=model.expert_intermediate_size)
    else:
        cfg.update(num_experts=model.num_experts, moe_intermediate_size=model.expert_intermediate_size,
                   intermediate_size=model.expert_intermediate_size, norm_topk_prob=model.norm_topk_prob,
                   attention_bias=model.attention_bias, decoder_sparse_step=1, mlp_only_layers=[],
                   use_sliding_window=False)
    return cfg
