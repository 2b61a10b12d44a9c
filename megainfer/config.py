"""What a model is and what it costs: the facts the planner and the engine share. Torch-free:
the planner and the CLI import this cheaply, and it is the one module of the model's
configuration the planner may read (DESIGN.md: planner -> megainfer.config, plan, errors).

`ModelConfig` holds one MoE model's shapes and numerics and derives its sizes (parameters,
weight and KV bytes); the memory budget rules the planner and the nodes both apply
(`kv_cache_budget_bytes`, `estimated_attention_step_bytes`) sit beside it. Where a
`ModelConfig` comes from lives elsewhere: Hugging Face `config.json` in
`megainfer.hf_config`, named presets in `megainfer.presets`, a model as users name it in
`megainfer.model_resolution`; an engine's serving knobs are `megainfer.engine_config`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megainfer.errors import ConfigError

SUPPORTED_MODEL_TYPES = ("mixtral", "qwen3_moe", "dbrx", "gpt_oss", "deepseek_v2", "deepseek_v3")
NORMS = ("rms", "layer")  # RMSNorm (Mixtral, Qwen3), bias-free LayerNorm (DBRX)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# Above this many bytes of weights a preset is shape-only: generating random weights for
# it would take more memory than a demo should.
RANDOM_WEIGHTS_MAX_BYTES = 4 << 30
KV_BLOCK_TOKENS = 16  # tokens per KV-cache block by default: a sequence's KV comes in blocks of these


@dataclass(frozen=True)
class RopeScaling:
    """YaRN's stretch of RoPE to longer contexts (gpt-oss, DeepSeek-V2/V3): the inverse
    frequencies blended between interpolated and extrapolated, the cos/sin tables scaled by the
    attention factor. The fields are config.json's `rope_parameters` (transformers' names);
    `megainfer.model.rotary` computes the tables as transformers does."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float | None = None  # None: from factor (and mscale, mscale_all_dim where given)
    mscale: float | None = None
    mscale_all_dim: float | None = None

    def __post_init__(self) -> None:
        if not self.factor > 0 or self.original_max_position_embeddings <= 0:
            raise ConfigError(f"rope_parameters: yarn needs a positive factor and original_max_position_embeddings, "
                              f"got factor={self.factor!r}, original_max_position_embeddings="
                              f"{self.original_max_position_embeddings!r}")


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and numerics of one decoder-only MoE model (every layer is an MoE layer)."""

    model_type: str  # "mixtral" | "qwen3_moe" | "dbrx" (presets may name other families, shape-only)
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
    rms_norm_eps: float  # the norms' epsilon, RMSNorm's or (norm "layer") LayerNorm's
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # biases on q/k/v/o projections (Qwen3 option)
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = ""  # preset name, checkpoint directory or hub id, for messages
    torch_dtype: str | None = None  # the checkpoint's weights (config.json torch_dtype/dtype); None: a preset
    # A fixed bias on every layer's router logits, one per expert (presets only: `skewed-mixtral`
    # favours a few experts, as real traffic does; a checkpoint's config.json has no such field).
    router_logit_bias: tuple[float, ...] = ()
    norm: str = "rms"  # the layers' and the final norm: "rms" (RMSNorm) or "layer" (LayerNorm without bias: DBRX)
    clip_qkv: float | None = None  # DBRX: q, k and v clamped to [-clip_qkv, clip_qkv] after their projection
    # gpt-oss: `window_layers` see their last `sliding_window` positions only (scheduling/kv_cache.py).
    sliding_window: int = 0
    window_layers: tuple[int, ...] = ()
    attention_sinks: bool = False  # gpt-oss: one learned logit per query head in every softmax's denominator
    router_bias: bool = False  # gpt-oss: a bias on the router's logits
    expert_bias: bool = False  # gpt-oss: biases on every expert's gate/up and down projections
    # gpt-oss's clamped SwiGLU: gate <= limit, |up| <= limit, (up + 1) * gate * sigmoid(alpha * gate).
    swiglu_alpha: float | None = None
    swiglu_limit: float | None = None
    rope_scaling: RopeScaling | None = None  # None: RoPE as trained (no YaRN)
    # DeepSeek's multi-head latent attention where kv_lora_rank > 0 (model/latent_attention.py);
    # head_dim is then qk_nope_head_dim + qk_rope_head_dim (q and k), v_head_dim the values'.
    kv_lora_rank: int = 0
    q_lora_rank: int | None = None
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False  # MLA's rotary dims rotate in adjacent pairs (V2; V3 by default), not halves
    # DeepSeek's dense first layers and shared experts: both run on the attention side, so expert
    # nodes hold MoE layers only (docs/architecture.md "Model families").
    first_k_dense: int = 0
    dense_intermediate_size: int = 0
    n_shared_experts: int = 0
    # DeepSeek's grouped routing (model/grouped_routing.py).
    scoring: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    score_correction_bias: bool = False
    routed_scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        check_model_config(self)

    # Sizes the engine, planner and accounting share.
    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def window_of(self, layer: int) -> int:
        """Positions layer `layer`'s queries see (0: all of them)."""
        return self.sliding_window if layer in self.window_layers else 0

    def attended_tokens(self, context):
        """Keys a query at `context` cached tokens sees, averaged over layers (numbers or arrays)."""
        windowed = len(self.window_layers)
        if not windowed:
            return context
        clipped = context.clip(max=self.sliding_window) if hasattr(context, "clip") else min(context, self.sliding_window)
        return ((self.num_layers - windowed) * context + windowed * clipped) / self.num_layers

    @property
    def kv_window(self) -> int:
        """The window of the sequences' window tables: the sliding window where windowed and
        full-attention layers mix (0: one table per sequence)."""
        return self.sliding_window if self.window_layers and len(self.window_layers) < self.num_layers else 0

    @property
    def kv_cache_layers(self) -> int:
        """KV-cache tensors: one per layer, or where windowed and full layers mix, one per pair of
        them, each through its own block table (a block id costs the larger group's layers)."""
        windowed = len(self.window_layers)
        return max(windowed, self.num_layers - windowed) if self.kv_window else self.num_layers

    def kv_blocks_per_sequence(self, tokens: int, block_size: int) -> int:
        """Block ids a sequence of `tokens` cached tokens holds while decoding: all of its blocks
        for the full-attention layers, at most a window's (plus the one it is writing) for the
        windowed ones."""
        blocks = -(-tokens // block_size)
        if not self.window_layers:
            return blocks
        window = min(blocks, -(-(self.sliding_window - 1) // block_size) + 1)
        return window if len(self.window_layers) == self.num_layers else blocks + window

    @property
    def expert_params(self) -> int:
        """Parameters of one expert (gate, up and down projections)."""
        h, i = self.hidden_size, self.expert_intermediate_size
        return 3 * h * i + (2 * i + h if self.expert_bias else 0)

    def expert_bytes(self, dtype: str) -> int:
        return self.expert_params * DTYPE_BYTES[dtype]

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def rotary_dim(self) -> int:
        """Dimensions RoPE rotates per head: all of head_dim, or MLA's qk_rope_head_dim."""
        return self.qk_rope_head_dim if self.mla else self.head_dim

    @property
    def kv_cache_heads(self) -> tuple[int, int]:
        """(heads, values per head) of one layer's cache tensor per token (MLA: one latent head)."""
        return (1, self.kv_cache_width) if self.mla else (self.num_kv_heads, self.head_dim)

    @property
    def num_moe_layers(self) -> int:
        """Layers with routed experts: what expert nodes hold (DeepSeek's first layers are dense)."""
        return self.num_layers - self.first_k_dense

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense

    @property
    def kv_cache_width(self) -> int:
        """Values one token stores per layer: K and V of its KV heads, or MLA's latent and rotary key."""
        return self.kv_lora_rank + self.qk_rope_head_dim if self.mla else 2 * self.kv_size

    @property
    def shared_expert_intermediate_size(self) -> int:
        return self.n_shared_experts * self.expert_intermediate_size

    def attention_side_params(self, moe_layer: bool = True) -> int:
        """One layer's parameters on the attention side: its attention and, for an MoE layer, the
        router and (DeepSeek) the shared experts; for a dense layer (DeepSeek's first), its FFN."""
        h = self.hidden_size
        if not moe_layer:
            return _attention_only_params(self) + 3 * h * self.dense_intermediate_size
        router = h * self.num_experts + (self.num_experts if self.router_bias or self.score_correction_bias else 0)
        return _attention_only_params(self) + router + 3 * h * self.shared_expert_intermediate_size

    @property
    def attention_params_per_layer(self) -> int:
        """What the attention side holds per layer, averaged over the layers: attention, the
        router, and (DeepSeek) the shared experts of MoE layers and the dense layers' FFN."""
        total = self.num_moe_layers * self.attention_side_params() + \
            self.first_k_dense * self.attention_side_params(moe_layer=False)
        return total // self.num_layers

    def attention_rank_weight_bytes(self, value_bytes: int, tp=1):
        """One tensor-parallel attention rank's weights: 1/tp of every layer's attention half
        (router included) and, on every rank whole, the embedding and the LM head. `tp` may be a
        numpy array (the planner sizes many configurations at once)."""
        head = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return (head + self.num_layers * self.attention_params_per_layer / tp) * value_bytes

    @property
    def num_params(self) -> int:
        embed = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return embed + self.num_layers * self.attention_params_per_layer + \
            self.num_moe_layers * self.num_experts * self.expert_params + self.hidden_size

    @property
    def num_active_params(self) -> int:
        """Parameters one token touches: attention, router and its top-k experts."""
        embed = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return embed + self.num_layers * self.attention_params_per_layer + \
            self.num_moe_layers * self.top_k * self.expert_params

    def kv_shards(self, tp):
        """Pieces one token's KV is split into at tensor parallelism `tp` (an int or a numpy array):
        its KV heads, each whole on a rank and copied past the head count (vLLM's Qwen3-235B on 8
        ranks); MLA's latent, read by every head, whole on each rank (DeepSeek's attention is DP)."""
        heads = 1 if self.mla else self.num_kv_heads
        return (tp + heads - abs(tp - heads)) // 2  # min(tp, heads), for an int or an array alike

    def kv_bytes_per_token(self, dtype: str) -> int:
        """One token's slot of a block id: K and V (MLA: the latent and rotary key) in every KV-cache
        tensor (`kv_cache_layers`)."""
        return self.kv_cache_layers * self.kv_cache_width * DTYPE_BYTES[dtype]

    # -- Hugging Face config.json -------------------------------------------------------

    @property
    def runnable_with_random_weights(self) -> bool:
        return (self.model_type in SUPPORTED_MODEL_TYPES
                and self.num_params * DTYPE_BYTES["float32"] <= RANDOM_WEIGHTS_MAX_BYTES)



def check_model_config(self: "ModelConfig") -> None:
    """A ConfigError naming the first field of `self` that no model can have."""
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
    if self.norm not in NORMS:
        raise ConfigError(f"model config: norm {self.norm!r} is not one of {', '.join(NORMS)}")
    if self.clip_qkv is not None and not self.clip_qkv > 0:
        raise ConfigError(f"model config: clip_qkv must be positive or null, got {self.clip_qkv!r}")
    if self.window_layers and not self.sliding_window > 0:
        raise ConfigError(f"model config: window_layers {list(self.window_layers)} need a positive sliding_window, "
                          f"got {self.sliding_window!r}")
    if any(not 0 <= layer < self.num_layers for layer in self.window_layers) or \
            len(set(self.window_layers)) != len(self.window_layers):
        raise ConfigError(f"model config: window_layers {list(self.window_layers)} must be distinct layers in "
                          f"[0, {self.num_layers})")
    if (self.swiglu_alpha is None) != (self.swiglu_limit is None):
        raise ConfigError("model config: swiglu_alpha and swiglu_limit go together (gpt-oss's clamped SwiGLU), "
                          f"got alpha={self.swiglu_alpha!r}, limit={self.swiglu_limit!r}")
    if self.scoring not in ("softmax", "sigmoid"):
        raise ConfigError(f"model config: scoring {self.scoring!r} is not 'softmax' or 'sigmoid'")
    if self.n_group < 1 or self.num_experts % self.n_group or not 1 <= self.topk_group <= self.n_group:
        raise ConfigError(f"model config: n_group ({self.n_group}) must divide the {self.num_experts} experts "
                          f"and topk_group ({self.topk_group}) be in [1, n_group]")
    if self.topk_group * (self.num_experts // self.n_group) < self.top_k:
        raise ConfigError(f"model config: topk_group {self.topk_group} groups of {self.num_experts // self.n_group} "
                          f"experts hold fewer than num_experts_per_tok ({self.top_k})")
    if self.kv_lora_rank and (self.qk_rope_head_dim <= 0 or self.v_head_dim <= 0
                              or self.head_dim <= self.qk_rope_head_dim):
        raise ConfigError("model config: multi-head latent attention needs positive qk_rope_head_dim and "
                          f"v_head_dim, and head_dim ({self.head_dim}) = qk_nope_head_dim + qk_rope_head_dim")
    if not 0 <= self.first_k_dense < self.num_layers or (self.first_k_dense and self.dense_intermediate_size <= 0):
        raise ConfigError(f"model config: first_k_dense_replace {self.first_k_dense} must leave an MoE layer "
                          f"(of {self.num_layers}) and come with a positive intermediate_size")
    if self.router_logit_bias and len(self.router_logit_bias) != self.num_experts:
        raise ConfigError(f"model config: router_logit_bias has {len(self.router_logit_bias)} values, "
                          f"one per expert wanted ({self.num_experts})")


def _attention_only_params(self: "ModelConfig") -> int:
    """One layer's attention (norms included), without its router or FFN."""
    h = self.hidden_size
    if not self.mla:
        return h * (self.q_size + 2 * self.kv_size) + self.q_size * h + 2 * h + \
            (self.num_heads if self.attention_sinks else 0)
    heads, rope = self.num_heads, self.qk_rope_head_dim
    q = h * heads * self.head_dim if not self.q_lora_rank else \
        h * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * heads * self.head_dim
    kv = h * (self.kv_lora_rank + rope) + self.kv_lora_rank + \
        self.kv_lora_rank * heads * (self.head_dim - rope + self.v_head_dim)
    return q + kv + heads * self.v_head_dim * h + 2 * h


# vLLM's --gpu-memory-utilization default: the share of a GPU's total memory one engine process
# may use, weights, activations, non-torch memory and KV cache together (`kv_cache_budget_bytes`).
GPU_MEMORY_UTILIZATION = 0.9
# Planning estimates of what an attention rank's profiling step holds beyond its weights (the
# nodes measure it, memory_profile.py; these keep the planner and the dry run near that):
SAMPLER_BYTES_PER_LOGIT = 44  # per sampled row and vocabulary entry at the sampler's peak with every
# option on (float32 logits, the penalties' int64 counts, top-k/top-p's sort: float32 values and
# int64 indices, softmaxes), measured on the CPU over megainfer.runner.sampler
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
    `used_bytes` (megainfer/runner/memory_profile.py); the planner and a plan's dry run estimate it
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
