"""How much of a GPU the KV cache gets: vLLM's `--gpu-memory-utilization`, by profiling.

`gpu_memory_utilization` (u; EngineConfig, `--gpu-memory-utilization`, plan.yaml's
`serve.gpu_memory_utilization`; default 0.9) is the share of the GPU's TOTAL memory this
process may use: weights, activations, non-torch memory (cuBLAS workspaces, NCCL buffers)
and the KV cache together. A runner on CUDA sizes its KV cache as vLLM does:

1. `baseline(device)` before the weights load (a `MemorySnapshot`);
2. once they are loaded, `profile(memory, baseline, run, u)`: torch's peak statistics reset,
   `run()` — one step at the largest batch the engine schedules, forward and sampling (the
   runner's own; no KV cache exists yet and it writes none) — its activations freed,
   `torch.cuda.empty_cache()`, a second snapshot;
3. the arithmetic, `MemoryProfile.of` (pure, tested with injected readings):

       torch_peak    = torch.cuda.max_memory_allocated() since the reset: the weights (still
                       held) plus the step's peak activations
       non_torch     = (total - free) - torch.cuda.memory_reserved(): what the driver counts
                       as used that torch's allocator does not hold
       non_torch_new = non_torch(after) - non_torch(baseline), at least 0: what other
                       processes held at the baseline, and this process's CUDA context, are
                       left out (vLLM's rule); memory another process allocates during the
                       profile counts as ours, which no reading can tell apart
       used          = torch_peak + non_torch_new
       kv_budget     = total * u - used            (config.kv_cache_budget_bytes)

4. `kv_budget_bytes(profile, min_bytes)`: a ConfigError naming --gpu-memory-utilization and
   the numbers when total * u exceeds what was free at the baseline (other processes hold
   more than 1 - u of the GPU; vLLM refuses the same) or when the budget is below
   `min_bytes`, one sequence of max_model_len (EngineConfig.min_kv_cache_bytes).

The ranks of a tensor-parallel node agree on the least budget (each rank profiles; a rank
that would refuse offers -1, so every rank refuses together instead of leaving the others
waiting in a collective). On the CPU nothing is profiled: the KV cache keeps its 2 GiB
default, allocated lazily (model_runner._zeroed). A config that gives num_kv_blocks or
kv_cache_bytes is not profiled either: the user sized the cache.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from megainfer.config import kv_cache_budget_bytes
from megainfer.errors import ConfigError

logger = logging.getLogger(__name__)

FLAG = "--gpu-memory-utilization (serve.gpu_memory_utilization in a plan)"


@dataclass(frozen=True)
class MemorySnapshot:
    """One reading of a device's memory, bytes."""

    total_bytes: int  # the device's memory (driver)
    free_bytes: int  # free on the device (driver): every process counted
    torch_reserved_bytes: int  # held by this process's caching allocator
    torch_peak_bytes: int = 0  # most allocated at once since the last peak reset

    @property
    def non_torch_bytes(self) -> int:
        """Used on the device but not held by torch's allocator: other processes, the CUDA
        context, cuBLAS workspaces, NCCL buffers."""
        return self.total_bytes - self.free_bytes - self.torch_reserved_bytes


class CudaMemory:
    """The readings and resets of one CUDA device (what tests replace with injected numbers)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def snapshot(self) -> MemorySnapshot:
        torch.cuda.synchronize(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        return MemorySnapshot(total, free, torch.cuda.memory_reserved(self.device),
                              torch.cuda.max_memory_allocated(self.device))

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def release_cached(self) -> None:
        """Hand the allocator's free blocks back to the driver (so readings count what is held)."""
        gc.collect()
        torch.cuda.empty_cache()


def baseline(device: torch.device) -> MemorySnapshot | None:
    """The reading before the weights load; None off CUDA (nothing is profiled there)."""
    if device.type != "cuda":
        return None
    memory = CudaMemory(device)
    memory.release_cached()
    return memory.snapshot()


@dataclass(frozen=True)
class MemoryProfile:
    """What a profiling step found, and the KV budget it leaves (bytes; the module's formula)."""

    total_bytes: int
    utilization: float
    baseline_free_bytes: int  # free at the baseline, every process counted
    torch_peak_bytes: int  # weights plus the step's peak activations
    non_torch_bytes: int  # non-torch memory this process added since the baseline

    @classmethod
    def of(cls, before: MemorySnapshot, after: MemorySnapshot, utilization: float) -> "MemoryProfile":
        return cls(after.total_bytes, utilization, before.free_bytes, after.torch_peak_bytes,
                   max(0, after.non_torch_bytes - before.non_torch_bytes))

    @property
    def requested_bytes(self) -> int:
        """This process's share of the GPU: total * utilization."""
        return int(self.total_bytes * self.utilization)

    @property
    def used_bytes(self) -> int:
        """Everything but the KV cache at the largest step."""
        return self.torch_peak_bytes + self.non_torch_bytes

    @property
    def kv_budget_bytes(self) -> int:
        return int(kv_cache_budget_bytes(self.total_bytes, self.utilization, self.used_bytes))

    @property
    def others_hold_too_much(self) -> bool:
        """Other processes left less free at the start than this process's share."""
        return self.requested_bytes > self.baseline_free_bytes

    def describe(self) -> str:
        return (f"{FLAG} {self.utilization:g} gives this process {_gib(self.requested_bytes)} of the GPU's "
                f"{_gib(self.total_bytes)}; weights and the largest step's activations take "
                f"{_gib(self.torch_peak_bytes)} (torch's peak), non-torch memory {_gib(self.non_torch_bytes)}, "
                f"leaving {_gib(self.kv_budget_bytes)} for the KV cache")


def profile(memory: CudaMemory, before: MemorySnapshot, run: Callable[[], None],
            utilization: float) -> MemoryProfile:
    """Run the profiling step `run` (which must free what it allocates: keep nothing) between a
    peak reset and a reading, and the profile they give against `before`."""
    memory.reset_peak()
    run()
    memory.release_cached()
    found = MemoryProfile.of(before, memory.snapshot(), utilization)
    logger.info("memory profile: %s", found.describe())
    return found


def offered_budget(found: MemoryProfile) -> int:
    """What a tensor-parallel rank offers when the ranks agree on the least budget: -1 where it
    would refuse, so that every rank refuses."""
    return -1 if found.others_hold_too_much else found.kv_budget_bytes


def kv_budget_bytes(found: MemoryProfile, min_bytes: int, agreed: int | None = None) -> int:
    """The KV budget: `found`'s, or `agreed` (the least over a node's ranks) when given. A
    ConfigError naming the flag and the numbers when other processes hold more than 1 - u of the
    GPU, or when the budget is below `min_bytes` (one sequence of max_model_len)."""
    _refuse_crowded(found)
    budget = found.kv_budget_bytes if agreed is None else agreed
    if budget < max(1, min_bytes):
        where = "" if agreed is None or agreed == found.kv_budget_bytes else \
            f" (another rank of this node has {_gib(agreed)}; see its log)"
        raise ConfigError(
            f"{found.describe()}{where}: less than one sequence of max_model_len needs "
            f"({_gib(min_bytes)}). Raise --gpu-memory-utilization, or lower --max-model-len, --max-num-seqs or "
            "--max-num-batched-tokens (the largest step's activations)")
    return budget


def check_fits(found: MemoryProfile) -> None:
    """A node without a KV cache (an expert node): a ConfigError naming the flag and the numbers
    when its weights and largest step need more than its share of the GPU."""
    _refuse_crowded(found)
    if found.kv_budget_bytes < 0:
        raise ConfigError(
            f"{found.describe()}: the weights and the largest micro-batch need more than this process's share. "
            "Raise --gpu-memory-utilization, or give the node fewer experts, or lower scheduler.max_num_batched_tokens")


def _refuse_crowded(found: MemoryProfile) -> None:
    if found.others_hold_too_much:
        raise ConfigError(
            f"{FLAG} {found.utilization:g} asks for {_gib(found.requested_bytes)} of the GPU's "
            f"{_gib(found.total_bytes)}, but only {_gib(found.baseline_free_bytes)} were free when this process "
            "started: other processes hold the rest. Lower --gpu-memory-utilization or free the GPU")


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"
