"""The serving knobs of one engine (KV cache, batching, prefill policy, CUDA graphs), validated
where they are built. dtype and device may be "auto", resolved against the model by
`EngineConfig.resolve`. Torch-free (resolving device "auto" asks torch, lazily).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
from dataclasses import dataclass
from typing import Any

from megainfer.config import (DTYPE_BYTES, GPU_MEMORY_UTILIZATION, KV_BLOCK_TOKENS, ModelConfig,
                              check_gpu_memory_utilization)
from megainfer.errors import ConfigError
from megainfer.messages import LayeredSettings

logger = logging.getLogger(__name__)

AUTO = "auto"  # EngineConfig dtype/device: chosen from the model and the machine
PREFILL_POLICIES = ("chunked", "layered")
DEVICES = ("cpu", "cuda")
EXPERT_LOAD_WINDOW = 64  # steps of routed tokens per expert an engine keeps by default


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
    # what a profiling step at the largest batch leaves of it (megainfer/runner/memory_profile.py)
    gpu_memory_utilization: float = GPU_MEMORY_UTILIZATION
    max_num_seqs: int = 256  # running sequences at once
    max_num_batched_tokens: int = 512  # token budget of one step (Sarathi chunk size)
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    prefill_policy: str = "chunked"
    group_tokens: int = 512  # layered: prompt tokens per layer group, G = ceil(cohort tokens / this)
    num_layer_groups: int | None = None  # layered: a fixed G instead
    # layered: G from group_tokens but at most this many, a cohort filling layered_chunk_tokens
    # (the layered-prefill paper's --num-stages with its --max-num-batched-tokens)
    max_layer_groups: int | None = None
    layered_chunk_tokens: int = 8192  # layered: prompt tokens of one cohort (longer prompts go in chunks)
    # layered, with max_layer_groups: (most cohort tokens, groups) rows, rising; the groups of the
    # first row a cohort fits, max_layer_groups above the last (LayeredSettings.group_table)
    layered_group_table: tuple[tuple[int, int], ...] | None = None
    layered_fill_cohorts: bool = False  # layered: cut any member so a cohort fills layered_chunk_tokens
    target_step_ms: float | None = None  # attention balancing: cap prompt tokens by predicted step time
    # Schedule the next step while this one's last layer runs (a runner that takes `StepHooks`:
    # an attention node's); the colocated runner always schedules after the step.
    async_scheduling: bool = False
    # CUDA: decode's (layer, micro-batch) computations run as CUDA graphs captured at start-up
    # (megainfer/disagg/decode_graphs.py) unless this is set (vLLM's --enforce-eager)
    enforce_eager: bool = False
    cuda_graph_sizes: tuple[int, ...] | None = None  # decode batch sizes to capture; None: a ladder to the largest
    num_threads: int | None = None  # CPU intra-op threads; None: torch's default
    # Steps whose routed tokens per expert the engine keeps (engine/expert_load_window.py).
    expert_load_window: int = EXPERT_LOAD_WINDOW
    show_progress: bool = False  # progress bar while loading weights
    # Automatic prefix caching (vLLM v1's default): full KV blocks named by their prefix are
    # kept and shared by later prompts (scheduling/prefix_cache.py).
    enable_prefix_caching: bool = True

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
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "group_tokens", "layered_chunk_tokens",
                     "expert_load_window"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"engine option '{name}' must be a positive integer, got {value!r}")
        for name in ("async_scheduling", "enforce_eager", "enable_prefix_caching"):
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
        for name in ("num_kv_blocks", "kv_cache_bytes", "max_model_len", "num_threads", "num_layer_groups",
                     "max_layer_groups"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise ConfigError(f"engine option '{name}' must be a positive integer or None, got {value!r}")
        if self.num_layer_groups is not None and self.max_layer_groups is not None:
            raise ConfigError("engine options 'num_layer_groups' (a fixed G) and 'max_layer_groups' (a cap on the G "
                              "derived from group_tokens) exclude each other; give one")
        if self.layered_group_table is not None:
            self.layered_group_table = check_group_table(self.layered_group_table, self.max_layer_groups)
        if not isinstance(self.layered_fill_cohorts, bool):
            raise ConfigError(f"engine option 'layered_fill_cohorts' must be true or false, "
                              f"got {self.layered_fill_cohorts!r}")
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
        are given): on CUDA, by a profiling step (megainfer/runner/memory_profile.py)."""
        return self.num_kv_blocks is None and self.kv_cache_bytes is None

    def kv_block_bytes(self, model: ModelConfig, tp_size: int = 1) -> int:
        """One KV block of one rank, which stores 1/tp_size of the KV heads (MLA: the whole latent,
        which every head reads; `ModelConfig.kv_shards`)."""
        return self.block_size * model.kv_bytes_per_token(self.concrete_dtype) // model.kv_shards(tp_size)

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
        tokens = self.layered_settings(model.num_layers).chunk_tokens
        return tokens * model.hidden_size * DTYPE_BYTES[self.concrete_dtype]

    def layered_settings(self, num_layers: int) -> LayeredSettings:
        """The layered policy's settings for a model of `num_layers` (whatever the policy)."""
        return LayeredSettings.of(num_layers, self.group_tokens, self.num_layer_groups, self.layered_chunk_tokens,
                                  self.max_layer_groups, self.layered_group_table, self.layered_fill_cohorts)

    def replace(self, **changes: Any) -> "EngineConfig":
        return dataclasses.replace(self, **changes)


def check_group_table(table: Any, max_layer_groups: int | None) -> tuple[tuple[int, int], ...]:
    """`layered_group_table` as a tuple of (most cohort tokens, groups) rows, or a ConfigError
    naming what is wrong: it needs max_layer_groups (the groups above its last row), and both
    columns rise, positive integers, the groups at most max_layer_groups."""
    if max_layer_groups is None:
        raise ConfigError("engine option 'layered_group_table' needs 'max_layer_groups' (the groups of a cohort "
                          "above the table's last row); set it, or drop the table")
    try:
        rows = tuple((t, g) for t, g in table)
    except (TypeError, ValueError):
        raise ConfigError(f"engine option 'layered_group_table' must be a list of [most tokens, groups] pairs, "
                          f"got {table!r}") from None
    for t, g in rows:
        if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (t, g)) or g > max_layer_groups:
            raise ConfigError(f"engine option 'layered_group_table' row {[t, g]!r}: tokens and groups must be "
                              f"positive integers, groups at most max_layer_groups ({max_layer_groups})")
    if any(a[0] >= b[0] or a[1] > b[1] for a, b in zip(rows, rows[1:])):
        raise ConfigError(f"engine option 'layered_group_table' must rise in tokens (and not fall in groups), "
                          f"got {[list(r) for r in rows]!r}")
    return rows
