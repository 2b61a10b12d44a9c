"""Hugging Face checkpoints' configuration files, read into a `ModelConfig` and written back.

`from_hf_dict` parses a `config.json` (model types `mixtral`, `qwen3_moe`, `dbrx`, `gpt_oss`),
refusing what megainfer does not run (quantized weights other than gpt-oss's MXFP4 experts,
scaled RoPE other than YaRN, sliding windows outside gpt-oss, dense layers);
`from_pretrained` reads a checkpoint directory's config.json and its generation_config.json's
EOS tokens; `to_hf_dict` is the config.json a checkpoint of a model carries. Torch-free.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from megainfer.config import SUPPORTED_MODEL_TYPES, ModelConfig, RopeScaling
from megainfer.errors import CheckpointError, ConfigError
from megainfer.presets import PRESETS

# Spellings of a dtype config.json files use, as megainfer names it.
_DTYPE_ALIASES = {"float": "float32", "half": "float16", "bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def _rope(cfg: dict[str, Any], name: str, model_type: str,
          fallback: float | None = None) -> tuple[float, RopeScaling | None]:
    """The checkpoint's RoPE theta (`fallback` where the file names none) and its YaRN scaling
    (None for the default RoPE), refusing what megainfer does not run (other scaled RoPEs,
    sliding windows outside gpt-oss's per-layer form)."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "yarn"):
        raise ConfigError(f"{name}: rope type {rope_type!r} (rope_parameters.rope_type) is not "
                          "supported; the default RoPE and YaRN are")
    rope_theta = cfg.get("rope_theta", rope.get("rope_theta", fallback))
    if rope_theta is None:
        raise ConfigError(f"{name}: no rope theta: neither 'rope_theta' nor 'rope_parameters.rope_theta' is set")
    sliding = cfg.get("sliding_window")
    if model_type != "gpt_oss" and sliding is not None and cfg.get("use_sliding_window", model_type == "mixtral"):
        raise ConfigError(f"{name}: sliding_window={sliding} is not supported for {model_type}; set it to null")
    scaling = None
    if rope_type == "yarn":
        original = rope.get("original_max_position_embeddings")
        factor = rope.get("factor")
        if factor is None and original:  # DeepSeek-V3's form: the ratio of the two lengths
            factor = need_positive(cfg.get("max_position_embeddings"), name, "max_position_embeddings") / original
        if original is None or factor is None:
            raise ConfigError(f"{name}: rope_parameters of type yarn need 'factor' and "
                              "'original_max_position_embeddings'")
        scaling = RopeScaling(factor=float(factor), original_max_position_embeddings=int(original),
                              beta_fast=float(rope.get("beta_fast") or 32), beta_slow=float(rope.get("beta_slow") or 1),
                              truncate=bool(rope.get("truncate", True)), attention_factor=rope.get("attention_factor"),
                              mscale=rope.get("mscale"), mscale_all_dim=rope.get("mscale_all_dim"))
    return float(rope_theta), scaling


def need_positive(value: Any, name: str, field: str) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"{name}: '{field}' must be a positive number, got {value!r}")
    return float(value)


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
    quantized kernels, and running such weights as floats would produce garbage. Two are served,
    dequantized to the serving dtype as they load: gpt-oss's MXFP4 experts (megainfer/model/mxfp4.py)
    and DeepSeek-V3's block-scaled FP8 (megainfer/model/weights.py)."""
    for key in ("quantization_config", "compression_config"):
        spec = cfg.get(key)
        if spec and key == "quantization_config" and isinstance(spec, dict) and (
                (cfg.get("model_type") == "gpt_oss" and spec.get("quant_method") == "mxfp4") or
                (cfg.get("model_type") == "deepseek_v3" and spec.get("quant_method") == "fp8"
                 and spec.get("weight_block_size"))):
            continue
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

    family_fields = {"dbrx": _dbrx_fields, "gpt_oss": _gpt_oss_fields, "deepseek_v2": _deepseek_fields,
                     "deepseek_v3": _deepseek_fields}.get(model_type)
    if family_fields is not None:
        return ModelConfig(**family_fields(cfg, name, need), name=name, eos_token_ids=_eos_ids(cfg),
                           bos_token_id=cfg.get("bos_token_id"), torch_dtype=_checkpoint_dtype(cfg))
    rope_theta, rope_scaling = _rope(cfg, name, model_type)
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
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
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
    theta, scaling = _rope(cfg, where, "dbrx", fallback=attn.get("rope_theta", 10000.0))
    hidden, heads = need("d_model", "hidden_size"), need("n_heads", "num_attention_heads")
    for key in ("moe_num_experts", "moe_top_k", "ffn_hidden_size"):
        if ffn.get(key) is None:
            raise ConfigError(f"{where}: required field 'ffn_config.{key}' is missing")
    return dict(model_type="dbrx", vocab_size=need("vocab_size"), hidden_size=hidden,
                num_layers=need("n_layers", "num_hidden_layers"), num_heads=heads,
                num_kv_heads=attn.get("kv_n_heads") or heads, head_dim=hidden // heads,
                num_experts=ffn["moe_num_experts"], top_k=ffn["moe_top_k"],
                expert_intermediate_size=ffn["ffn_hidden_size"], norm_topk_prob=p is not None,
                rope_theta=theta, rope_scaling=scaling, rms_norm_eps=1e-5,  # torch's LayerNorm default, which DBRX keeps
                max_position_embeddings=need("max_seq_len", "max_position_embeddings"),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)), norm="layer",
                clip_qkv=attn.get("clip_qkv"))


def _gpt_oss_fields(cfg: dict[str, Any], name: str, need) -> dict[str, Any]:
    """gpt-oss's config.json as `ModelConfig` fields: per-layer sliding windows (`layer_types`,
    transformers' default alternating from a windowed layer 0), attention sinks, router and
    expert biases, the clamped SwiGLU, YaRN. Its router takes the softmax of the top-k logits,
    the same weights as the full softmax's top k renormalised (norm_topk_prob)."""
    where = name or "config.json"
    layers = need("num_hidden_layers")
    types = cfg.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
    if len(types) != layers or unknown:
        raise ConfigError(f"{where}: layer_types must name one of 'sliding_attention', 'full_attention' for each "
                          f"of the {layers} layers, got {types!r}")
    window_layers = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    window = cfg.get("sliding_window") or 0
    if window_layers and not (isinstance(window, int) and window > 0):
        raise ConfigError(f"{where}: sliding_window must be a positive integer for its sliding_attention layers, "
                          f"got {window!r}")
    if window_layers and len(window_layers) == layers:
        raise ConfigError(f"{where}: every layer is a sliding_attention layer; megainfer serves gpt-oss's mix of "
                          "windowed and full-attention layers, not windows alone")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"{where}: hidden_act {act!r} is not supported; gpt-oss's experts run the clamped SwiGLU")
    theta, scaling = _rope(cfg, where, "gpt_oss", fallback=150000.0)
    hidden, heads = need("hidden_size"), need("num_attention_heads")
    return dict(model_type="gpt_oss", vocab_size=need("vocab_size"), hidden_size=hidden, num_layers=layers,
                num_heads=heads, num_kv_heads=cfg.get("num_key_value_heads") or heads,
                head_dim=cfg.get("head_dim") or hidden // heads, num_experts=need("num_local_experts"),
                top_k=need("num_experts_per_tok"), expert_intermediate_size=need("intermediate_size"),
                norm_topk_prob=True, rope_theta=theta, rope_scaling=scaling,
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
                max_position_embeddings=need("max_position_embeddings"),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention_bias=bool(cfg.get("attention_bias", True)), sliding_window=window if window_layers else 0,
                window_layers=window_layers, attention_sinks=True, router_bias=True, expert_bias=True,
                swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)), swiglu_limit=float(cfg.get("swiglu_limit", 7.0)))


def _deepseek_fields(cfg: dict[str, Any], name: str, need) -> dict[str, Any]:
    """DeepSeek-V2/V3's config.json: MLA (kv_lora_rank, q_lora_rank, the rotary and plain head
    dims), dense first layers, shared experts, grouped routing (V2's softmax, greedy or by each
    group's best expert; V3's sigmoid with a correction bias, groups by their best two)."""
    where, v3 = name or "config.json", cfg["model_type"] == "deepseek_v3"
    method = cfg.get("topk_method") or ("noaux_tc" if v3 else "greedy")
    scoring = cfg.get("scoring_func") or ("sigmoid" if v3 else "softmax")
    known = {"greedy", "group_limited_greedy"} if not v3 else {"noaux_tc"}
    if method not in known or scoring != ("sigmoid" if v3 else "softmax"):
        raise ConfigError(f"{where}: topk_method {method!r} with scoring_func {scoring!r} is not supported for "
                          f"{cfg['model_type']}; supported: {sorted(known)} with {'sigmoid' if v3 else 'softmax'}")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"{where}: hidden_act {act!r} is not supported; DeepSeek's FFNs run SiLU")
    theta, scaling = _rope(cfg, where, cfg["model_type"], fallback=10000.0)
    grouped = v3 or method == "group_limited_greedy"
    if cfg.get("attention_bias"):
        raise ConfigError(f"{where}: attention_bias is not supported with multi-head latent attention")
    heads, rope = need("num_attention_heads"), need("qk_rope_head_dim")
    return dict(model_type=cfg["model_type"], vocab_size=need("vocab_size"), hidden_size=need("hidden_size"),
                num_layers=need("num_hidden_layers"), num_heads=heads, num_kv_heads=heads,
                head_dim=need("qk_nope_head_dim") + rope, num_experts=need("n_routed_experts", "num_local_experts"),
                top_k=need("num_experts_per_tok"), expert_intermediate_size=need("moe_intermediate_size"),
                norm_topk_prob=bool(cfg.get("norm_topk_prob", v3)), rope_theta=theta, rope_scaling=scaling,
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                max_position_embeddings=need("max_position_embeddings"),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention_bias=bool(cfg.get("attention_bias", False)),
                kv_lora_rank=need("kv_lora_rank"), q_lora_rank=cfg.get("q_lora_rank") or None, qk_rope_head_dim=rope,
                v_head_dim=need("v_head_dim"), first_k_dense=int(cfg.get("first_k_dense_replace") or 0),
                dense_intermediate_size=need("intermediate_size"), n_shared_experts=int(cfg.get("n_shared_experts") or 0),
                scoring=scoring, n_group=int(cfg.get("n_group") or 1) if grouped else 1,
                topk_group=int(cfg.get("topk_group") or 1) if grouped else 1, score_correction_bias=v3,
                routed_scaling_factor=float(cfg.get("routed_scaling_factor") or 1.0),
                rope_interleave=bool(cfg.get("rope_interleave", True)) if v3 else True)


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
