"""Model and engine configuration. Torch-free: the planner and the CLI import this cheaply.

`ModelConfig` is parsed from a Hugging Face `config.json` (model types `mixtral` and
`qwen3_moe`) or taken from a named preset. `EngineConfig` holds the serving knobs of one
engine (KV cache, batching, prefill policy) and is validated where it is built; its dtype
and device may be "auto", resolved against the model by `EngineConfig.resolve`.

`resolve_model` takes a model as users name it: a preset, a checkpoint directory, the demo
checkpoint (`megainfer-demo`), or a Hugging Face repo id (`org/name[@revision]`) found in
the local Hugging Face cache; nothing is ever downloaded.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megainfer.errors import CheckpointError, ConfigError
from megainfer.hub_cache import cached_snapshot

logger = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("mixtral", "qwen3_moe")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
AUTO = "auto"  # EngineConfig dtype/device: chosen from the model and the machine
# Above this many bytes of weights a preset is shape-only: generating random weights for
# it would take more memory than a demo should.
RANDOM_WEIGHTS_MAX_BYTES = 4 << 30


# Spellings of a dtype config.json files use, as megainfer names it.
_DTYPE_ALIASES = {"float": "float32", "half": "float16", "bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def _rope_theta(cfg: dict[str, Any], name: str, model_type: str) -> float:
    """The checkpoint's RoPE theta, refusing what megainfer does not run (scaled RoPE, sliding windows)."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ConfigError(f"{name}: rope type {rope_type!r} (rope_parameters.rope_type) is not "
                          "supported; only the default RoPE is")
    rope_theta = cfg.get("rope_theta", rope.get("rope_theta"))
    if rope_theta is None:
        raise ConfigError(f"{name}: no rope theta: neither 'rope_theta' nor 'rope_parameters.rope_theta' is set")
    sliding = cfg.get("sliding_window")
    if sliding is not None and cfg.get("use_sliding_window", model_type == "mixtral"):
        raise ConfigError(f"{name}: sliding_window={sliding} is not supported; set it to null")
    return rope_theta


def _checkpoint_dtype(cfg: dict[str, Any]) -> str | None:
    """config.json's weights dtype (`torch_dtype`, or `dtype` as transformers 5 writes it)."""
    value = cfg.get("torch_dtype", cfg.get("dtype"))
    if not isinstance(value, str) or value == AUTO:
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


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and numerics of one decoder-only MoE model (every layer is an MoE layer)."""

    model_type: str  # "mixtral" | "qwen3_moe" (presets may name other families, shape-only)
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int  # query heads
    num_kv_heads: int
    head_dim: int  # Qwen3's differs from hidden_size // num_heads
    num_experts: int
    top_k: int  # experts per token
    expert_intermediate_size: int
    norm_topk_prob: bool  # renormalise the top-k routing weights to sum to 1
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # biases on q/k/v/o projections (Qwen3 option)
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = ""  # preset name, checkpoint directory or hub id, for messages
    torch_dtype: str | None = None  # the checkpoint's weights (config.json torch_dtype/dtype); None: a preset

    def __post_init__(self) -> None:
        for f in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                  "num_experts", "top_k", "expert_intermediate_size", "max_position_embeddings"):
            value = getattr(self, f)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"model config field '{f}' must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"model config: num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})")
        if self.top_k > self.num_experts:
            raise ConfigError(
                f"model config: num_experts_per_tok ({self.top_k}) exceeds the number of experts "
                f"({self.num_experts})")
        if self.rms_norm_eps <= 0 or self.rope_theta <= 0:
            raise ConfigError("model config: rms_norm_eps and rope_theta must be positive")

    # Sizes the engine, planner and accounting share.
    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def expert_params(self) -> int:
        """Parameters of one expert (gate, up and down projections)."""
        return 3 * self.hidden_size * self.expert_intermediate_size

    def expert_bytes(self, dtype: str) -> int:
        return self.expert_params * DTYPE_BYTES[dtype]

    @property
    def attention_params_per_layer(self) -> int:
        h = self.hidden_size
        return h * (self.q_size + 2 * self.kv_size) + self.q_size * h + 2 * h + h * self.num_experts

    def attention_rank_weight_bytes(self, value_bytes: int, tp=1):
        """One tensor-parallel attention rank's weights: 1/tp of every layer's attention half
        (router included) and, on every rank whole, the embedding and the LM head. `tp` may be a
        numpy array (the planner sizes many configurations at once)."""
        head = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return (head + self.num_layers * self.attention_params_per_layer / tp) * value_bytes

    @property
    def num_params(self) -> int:
        embed = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        per_layer = self.attention_params_per_layer + self.num_experts * self.expert_params
        return embed + self.num_layers * per_layer + self.hidden_size

    @property
    def num_active_params(self) -> int:
        """Parameters one token touches: attention, router and its top-k experts."""
        embed = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        per_layer = self.attention_params_per_layer + self.top_k * self.expert_params
        return embed + self.num_layers * per_layer

    def kv_bytes_per_token(self, dtype: str) -> int:
        return 2 * self.num_layers * self.kv_size * DTYPE_BYTES[dtype]

    # -- Hugging Face config.json -------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any], name: str = "") -> "ModelConfig":
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
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
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

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> "ModelConfig":
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
        cfg = cls.from_hf_dict(raw, name=str(directory))
        # generation_config.json may name further EOS tokens (chat models' end-of-turn).
        eos = read_json_object(directory / "generation_config.json").get("eos_token_id")
        if eos is not None:
            extra = eos if isinstance(eos, list) else [eos]
            merged = tuple(dict.fromkeys([*cfg.eos_token_ids, *map(int, extra)]))
            cfg = dataclasses.replace(cfg, eos_token_ids=merged)
        return cfg

    def to_hf_dict(self) -> dict[str, Any]:
        """The config.json a checkpoint of this model carries (inverse of `from_hf_dict`)."""
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(f"preset {self.name!r} ({self.model_type}) is shape-only and has no checkpoint form")
        cfg: dict[str, Any] = {
            "model_type": self.model_type,
            "architectures": ["MixtralForCausalLM" if self.model_type == "mixtral" else "Qwen3MoeForCausalLM"],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "num_experts_per_tok": self.top_k,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "sliding_window": None,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0],
        }
        if self.model_type == "mixtral":
            cfg.update(num_local_experts=self.num_experts, intermediate_size=self.expert_intermediate_size)
        else:
            cfg.update(num_experts=self.num_experts, moe_intermediate_size=self.expert_intermediate_size,
                       intermediate_size=self.expert_intermediate_size, norm_topk_prob=self.norm_topk_prob,
                       attention_bias=self.attention_bias, decoder_sparse_step=1, mlp_only_layers=[],
                       use_sliding_window=False)
        return cfg

    @property
    def runnable_with_random_weights(self) -> bool:
        return (self.model_type in SUPPORTED_MODEL_TYPES
                and self.num_params * DTYPE_BYTES["float32"] <= RANDOM_WEIGHTS_MAX_BYTES)


def _mixtral(name: str, **kw: Any) -> ModelConfig:
    base = dict(model_type="mixtral", norm_topk_prob=True, rope_theta=1e6, rms_norm_eps=1e-5, name=name,
                bos_token_id=1, eos_token_ids=(2,))
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
    "tiny-qwen3-moe": _qwen3(
        "tiny-qwen3-moe", hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=2, head_dim=64,
        num_experts=16, top_k=4, expert_intermediate_size=256, max_position_embeddings=4096, **_BYTE_VOCAB),
    "mixtral-8x7b": _mixtral(
        "mixtral-8x7b", vocab_size=32000, hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8,
        head_dim=128, num_experts=8, top_k=2, expert_intermediate_size=14336, max_position_embeddings=32768),
    "mixtral-8x22b": _mixtral(
        "mixtral-8x22b", vocab_size=32768, hidden_size=6144, num_layers=56, num_heads=48, num_kv_heads=8,
        head_dim=128, num_experts=8, top_k=2, expert_intermediate_size=16384, max_position_embeddings=65536),
    # DBRX is its own family (LayerNorm, clipped QKV); only its shapes matter to the planner.
    "dbrx": ModelConfig(
        model_type="dbrx", name="dbrx", vocab_size=100352, hidden_size=6144, num_layers=40, num_heads=48,
        num_kv_heads=8, head_dim=128, num_experts=16, top_k=4, expert_intermediate_size=10752,
        norm_topk_prob=True, rope_theta=5e5, rms_norm_eps=1e-5, max_position_embeddings=32768),
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


DEMO_MODEL = "megainfer-demo"  # the small checkpoint trained by `python -m megainfer.demo.train`
# org/name, optionally @revision (a branch, tag or commit): a Hugging Face repo id.
HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<revision>[\w./-]+))?$")


def demo_checkpoint() -> Path:
    """Where the demo checkpoint lives: inside the installed package."""
    return Path(__file__).resolve().parent / "demo" / "checkpoint"


def resolve_model(model: str | os.PathLike) -> tuple[ModelConfig, Path | None]:
    """A model as users name it -> (config, checkpoint directory or None for a preset): a preset
    name, `megainfer-demo`, a checkpoint directory, or a Hugging Face repo id (`org/name`,
    `org/name@revision`) in the local cache."""
    key = str(model)
    if key in PRESETS:
        return PRESETS[key], None
    if key == DEMO_MODEL:
        path = demo_checkpoint()
        if not (path / "config.json").is_file():
            raise ConfigError(f"the demo checkpoint is missing ({path} has no config.json); train it with "
                              "`python -m megainfer.demo.train --minutes 40`")
        return dataclasses.replace(ModelConfig.from_pretrained(path), name=DEMO_MODEL), path
    path = Path(key).expanduser()
    if path.exists():
        return ModelConfig.from_pretrained(path), path
    hub = HUB_ID.match(key)
    if hub:
        snapshot = cached_snapshot(hub["repo"], hub["revision"])
        return dataclasses.replace(ModelConfig.from_pretrained(snapshot), name=key), snapshot
    raise ConfigError(f"model {key!r} is neither a checkpoint directory, a Hugging Face repo id (org/name) nor "
                      f"a preset; presets: {', '.join(PRESETS)}, {DEMO_MODEL}")


# vLLM's --gpu-memory-utilization default: the share of a GPU's total memory one engine process
# may use, weights, activations, non-torch memory and KV cache together (`kv_cache_budget_bytes`).
GPU_MEMORY_UTILIZATION = 0.9
# Planning estimates of what an attention rank's profiling step holds beyond its weights (the
# nodes measure it, memory_profile.py; these keep the planner and the dry run near that):
SAMPLER_BYTES_PER_LOGIT = 44  # per sampled row and vocabulary entry at the sampler's peak with every
# option on (float32 logits, the penalties' int64 counts, top-k/top-p's sort: float32 values and
# int64 indices, softmaxes), measured on the CPU over megainfer.sampler
HIDDEN_STATE_COPIES = 16  # [tokens, hidden] tensors alive at once inside an attention half (an allowance)
NON_TORCH_ALLOWANCE_BYTES = 512 << 20  # cuBLAS workspaces and NCCL buffers (an allowance)


def check_gpu_memory_utilization(value: Any, name: str = "gpu_memory_utilization",
                                 error: type[Exception] = ConfigError) -> float:
    """`value` if it is a share of a GPU's memory, 0 < value <= 1; else `error` naming `name`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise error(f"{name} must be the share of the GPU's total memory this process may use, "
                    f"0 < u <= 1 (default {GPU_MEMORY_UTILIZATION}), got {value!r}")
    return float(value)


def kv_cache_budget_bytes(total_bytes, utilization, used_bytes):
    """Bytes one GPU gives the KV cache, vLLM's rule: the process's share of the GPU's total
    memory (total_bytes * utilization) less everything else the process holds at its largest
    step (`used_bytes`: weights, peak activations, non-torch memory). The nodes measure
    `used_bytes` (megainfer/memory_profile.py); the planner and a plan's dry run estimate it
    (`estimated_attention_step_bytes` beside the weights). Numbers or numpy arrays."""
    return total_bytes * utilization - used_bytes


def estimated_attention_step_bytes(model: "ModelConfig", value_bytes: int, sampled_rows, tokens,
                                   expert_nodes: int | None = None):
    """What an attention rank's profiling step is expected to hold beyond its weights, at a step of
    `tokens` tokens sampling `sampled_rows` rows: the sampler's working set, per token its hidden
    states and the dispatch records (packed, and the inputs gathered for them: a record for each
    expert node the token goes to, twice; None nodes: top_k, the most), and the non-torch
    allowance. `sampled_rows` and `tokens` may be numpy arrays."""
    record = model.hidden_size * value_bytes + 8 * model.top_k  # megainfer/disagg/expert_link.py
    destinations = model.top_k if expert_nodes is None else min(model.top_k, expert_nodes)
    per_token = HIDDEN_STATE_COPIES * model.hidden_size * value_bytes + 2 * record * destinations
    return sampled_rows * model.vocab_size * SAMPLER_BYTES_PER_LOGIT + tokens * per_token + NON_TORCH_ALLOWANCE_BYTES
KV_BLOCK_TOKENS = 16  # tokens per KV-cache block by default: a sequence's KV comes in blocks of these
PREFILL_POLICIES = ("chunked", "layered")
DEVICES = ("cpu", "cuda")


@dataclass
class EngineConfig:
    """Serving knobs of one engine (one attention node, or the colocated model)."""

    dtype: str = "float32"  # or "auto": the checkpoint's (see `resolve`)
    device: str = "cpu"  # cpu, cuda, cuda:N, or "auto": cuda where torch sees a GPU
    seed: int = 0
    block_size: int = KV_BLOCK_TOKENS  # tokens per KV-cache block
    num_kv_blocks: int | None = None  # None: sized from kv_cache_bytes
    kv_cache_bytes: int | None = None  # None: 2 GiB on CPU; on CUDA what gpu_memory_utilization leaves
    # CUDA: the share of the GPU's total memory this process may use (vLLM's); the KV cache gets
    # what a profiling step at the largest batch leaves of it (megainfer/memory_profile.py)
    gpu_memory_utilization: float = GPU_MEMORY_UTILIZATION
    max_num_seqs: int = 256  # running sequences at once
    max_num_batched_tokens: int = 512  # token budget of one step (Sarathi chunk size)
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    prefill_policy: str = "chunked"
    group_tokens: int = 512  # layered: prompt tokens per layer group, G = ceil(cohort tokens / this)
    num_layer_groups: int | None = None  # layered: a fixed G instead
    layered_chunk_tokens: int = 8192  # layered: prompt tokens of one cohort (longer prompts go in chunks)
    target_step_ms: float | None = None  # attention balancing: cap prompt tokens by predicted step time
    # Schedule the next step while this one's last layer runs (a runner that takes `StepHooks`:
    # an attention node's); the colocated runner always schedules after the step.
    async_scheduling: bool = False
    # CUDA: decode's (layer, micro-batch) computations run as CUDA graphs captured at start-up
    # (megainfer/disagg/decode_graphs.py) unless this is set (vLLM's --enforce-eager)
    enforce_eager: bool = False
    cuda_graph_sizes: tuple[int, ...] | None = None  # decode batch sizes to capture; None: a ladder to the largest
    num_threads: int | None = None  # CPU intra-op threads; None: torch's default
    show_progress: bool = False  # progress bar while loading weights

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES and self.dtype != AUTO:
            raise ConfigError(f"dtype {self.dtype!r} is not supported; choose one of {', '.join(DTYPE_BYTES)} "
                              f"or {AUTO}")
        if not isinstance(self.device, str) or not (self.device in (*DEVICES, AUTO) or
                                                    re.fullmatch(r"cuda:\d+", self.device)):
            raise ConfigError(f"device {self.device!r} is not supported; choose 'cpu', 'cuda[:N]' or 'auto'")
        if self.prefill_policy not in PREFILL_POLICIES:
            raise ConfigError(f"prefill_policy {self.prefill_policy!r} is not supported; choose one of "
                              f"{', '.join(PREFILL_POLICIES)}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "group_tokens", "layered_chunk_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"engine option '{name}' must be a positive integer, got {value!r}")
        for name in ("async_scheduling", "enforce_eager"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"engine option '{name}' must be true or false, got {getattr(self, name)!r}")
        if self.cuda_graph_sizes is not None:
            sizes = self.cuda_graph_sizes
            if not isinstance(sizes, (tuple, list)) or not sizes or any(
                    isinstance(n, bool) or not isinstance(n, int) or n <= 0 for n in sizes):
                raise ConfigError(f"engine option 'cuda_graph_sizes' must be a list of positive integers (decode "
                                  f"batch sizes to capture) or None, got {sizes!r}")
            self.cuda_graph_sizes = tuple(sorted(set(sizes)))
        if self.target_step_ms is not None and (isinstance(self.target_step_ms, bool) or
                                                not isinstance(self.target_step_ms, (int, float)) or
                                                self.target_step_ms <= 0):
            raise ConfigError(f"engine option 'target_step_ms' must be a positive number or None, "
                              f"got {self.target_step_ms!r}")
        for name in ("num_kv_blocks", "kv_cache_bytes", "max_model_len", "num_threads", "num_layer_groups"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise ConfigError(f"engine option '{name}' must be a positive integer or None, got {value!r}")
        check_gpu_memory_utilization(self.gpu_memory_utilization, "engine option 'gpu_memory_utilization'")

    def resolve(self, model: ModelConfig) -> "EngineConfig":
        """This config with "auto" replaced. dtype auto: the checkpoint's torch_dtype (float32
        stays float32, bfloat16 stays bfloat16, on the CPU too, as vLLM keeps it); float32 for
        presets. device auto: cuda when torch sees a GPU, else cpu (said in the log)."""
        dtype, device = self.dtype, self.device
        if dtype == AUTO:
            dtype = model.torch_dtype or "float32"
            if dtype not in DTYPE_BYTES:
                raise ConfigError(f"{model.name}: the checkpoint's dtype {dtype!r} (config.json torch_dtype) is not "
                                  f"one megainfer runs; pass --dtype {' or '.join(DTYPE_BYTES)}")
        if device == AUTO:
            import torch

            device = "cuda" if torch.cuda.is_available() else "cpu"
            if device == "cpu":
                logger.info("device auto: running on the CPU (torch.cuda.is_available() is False)")
        return self if (dtype, device) == (self.dtype, self.device) else self.replace(dtype=dtype, device=device)

    @property
    def concrete_dtype(self) -> str:
        """The dtype, which sizing needs resolved (an engine resolves "auto" when it loads the model)."""
        if self.dtype == AUTO:
            raise ConfigError("dtype 'auto' must be resolved against the model first (EngineConfig.resolve)")
        return self.dtype

    def resolved_max_model_len(self, model: ModelConfig) -> int:
        if self.max_model_len is None:
            return model.max_position_embeddings
        if self.max_model_len > model.max_position_embeddings:
            raise ConfigError(f"max_model_len {self.max_model_len} exceeds the model's "
                              f"max_position_embeddings ({model.max_position_embeddings}); lower --max-model-len")
        return self.max_model_len

    @property
    def max_step_tokens(self) -> int:
        """The most tokens one step computes: chunked steps stop at the token budget; layered
        steps carry every running sequence's decode (the budget is not theirs to spend) plus one
        cohort. The profiling step runs this many (memory_profile.py); slots hold them."""
        if self.prefill_policy == "layered":
            return self.max_num_seqs + self.layered_chunk_tokens
        return self.max_num_batched_tokens

    @property
    def sizes_kv_from_memory(self) -> bool:
        """Whether the KV cache is sized from the device's memory (neither its blocks nor its bytes
        are given): on CUDA, by a profiling step (megainfer/memory_profile.py)."""
        return self.num_kv_blocks is None and self.kv_cache_bytes is None

    def kv_block_bytes(self, model: ModelConfig, tp_size: int = 1) -> int:
        """One KV block of one rank, which stores 1/tp_size of the KV heads."""
        return self.block_size * model.kv_bytes_per_token(self.concrete_dtype) // tp_size

    def min_kv_cache_bytes(self, model: ModelConfig, max_model_len: int, tp_size: int = 1) -> int:
        """The least KV budget that serves a request at all: one sequence of max_model_len, and
        the layered cohort's reserve."""
        blocks = math.ceil(max_model_len / self.block_size)
        return blocks * self.kv_block_bytes(model, tp_size) + self.layered_hidden_reserve(model)

    def resolved_num_kv_blocks(self, model: ModelConfig, max_model_len: int, kv_budget_bytes: int | None,
                               tp_size: int = 1) -> int:
        """Blocks of the paged KV cache: the explicit count, else what the byte budget holds:
        kv_cache_bytes, else `kv_budget_bytes` (on CUDA what gpu_memory_utilization leaves after
        the profiling step, the least over a node's ranks), else 2 GiB (the CPU). With tensor
        parallelism a rank stores 1/tp_size of the KV heads, so a block costs it 1/tp_size of
        the whole model's."""
        if self.num_kv_blocks is not None:
            return self.num_kv_blocks
        block_bytes = self.kv_block_bytes(model, tp_size)
        budget = self.kv_cache_bytes or (kv_budget_bytes if kv_budget_bytes is not None else 2 << 30)
        budget -= self.layered_hidden_reserve(model)
        # Never more than every running sequence at full length could use.
        wanted = self.max_num_seqs * math.ceil(max_model_len / self.block_size)
        blocks = min(budget // block_bytes, wanted)
        if blocks < 1:
            raise ConfigError(f"KV cache budget of {budget} bytes holds no {block_bytes}-byte block; "
                              "raise kv_cache_bytes")
        return max(1, blocks)

    def layered_hidden_reserve(self, model: ModelConfig) -> int:
        """Bytes the layered policy's in-flight cohort may hold between steps (its hidden
        states, at most one cohort's tokens), taken from the KV-cache budget; 0 for chunked."""
        if self.prefill_policy != "layered":
            return 0
        groups = self.num_layer_groups or model.num_layers
        tokens = min(self.layered_chunk_tokens, self.group_tokens * groups)
        return tokens * model.hidden_size * DTYPE_BYTES[self.concrete_dtype]

    def replace(self, **changes: Any) -> "EngineConfig":
        return dataclasses.replace(self, **changes)
