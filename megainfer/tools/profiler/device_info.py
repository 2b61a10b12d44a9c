"""What a profile records of the machine: the device's name, its GPU-catalog name, the peak
GEMM rate and copy bandwidth it reaches, and the KV-cache tokens the engine sizes on it."""

from __future__ import annotations

import platform
from pathlib import Path

import torch

from megainfer.config import ModelConfig, estimated_attention_step_bytes, kv_cache_budget_bytes
from megainfer.engine_config import EngineConfig
from megainfer.tools.profiler.timing import median_seconds
from planner.catalog import Catalog
from planner.operator_profile import ProfiledDevice

# (cuda, cpu) sizes of the peak measurements: large enough to reach the plateau, small enough
# to take well under a second on the device.
GEMM_SIZE = {"cuda": 8192, "cpu": 1024}
COPY_BYTES = {"cuda": 1 << 30, "cpu": 64 << 20}


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "cpu"


def catalog_name(device: torch.device, catalog: Catalog | None = None) -> str | None:
    """The catalog GPU whose name is in the device's name (the longest such: "L40S", not "L4")."""
    if device.type != "cuda":
        return None
    name = device_name(device).lower()
    matches = [gpu for gpu in (catalog or Catalog.load()).names() if gpu.lower() in name]
    return max(matches, key=len) if matches else None


def peak_flops(device: torch.device, dtype: torch.dtype, min_time_s: float) -> float:
    """FLOP/s of one large square GEMM in `dtype`."""
    n = GEMM_SIZE[device.type]
    a, b = torch.randn(n, n, dtype=dtype, device=device), torch.randn(n, n, dtype=dtype, device=device)
    return 2 * n ** 3 / median_seconds(lambda: torch.mm(a, b), device, min_time_s)


def peak_bytes_per_s(device: torch.device, min_time_s: float) -> float:
    """Bytes/s of one large tensor copy, counting the read and the write."""
    size = COPY_BYTES[device.type]
    src = torch.ones(size, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * size / median_seconds(lambda: dst.copy_(src), device, min_time_s)


def kv_cache_tokens(model: ModelConfig, config: EngineConfig, max_model_len: int, tp: int,
                    free_bytes_before_weights: int | None) -> int | None:
    """KV-cache tokens the engine sizes by default on this device, estimated: on CUDA,
    gpu_memory_utilization of the memory one rank found free, less the model's weights (its
    share of them) and the largest step (the attention step's estimate standing in for the
    colocated one's; the engine measures it, megainfer/runner/memory_profile.py); on the CPU the
    default 2 GiB budget. None where that leaves nothing."""
    budget = None
    if free_bytes_before_weights is not None:
        value_bytes = torch.tensor([], dtype=getattr(torch, config.concrete_dtype)).element_size()
        experts = model.num_layers * model.num_experts * model.expert_params * value_bytes / tp
        weights = model.attention_rank_weight_bytes(value_bytes, tp) + experts
        tokens = config.max_step_tokens
        step = estimated_attention_step_bytes(model, value_bytes, min(config.max_num_seqs, tokens), tokens, 1)
        budget = int(kv_cache_budget_bytes(free_bytes_before_weights, config.gpu_memory_utilization, weights + step))
        if budget <= 0:
            return None
    return config.resolved_num_kv_blocks(model, max_model_len, budget, tp) * config.block_size


def profiled_device(device: torch.device, dtype: torch.dtype, tp: int, min_time_s: float) -> ProfiledDevice:
    return ProfiledDevice(kind=device.type, name=device_name(device), count=tp,
                          catalog_name=catalog_name(device), peak_flops=peak_flops(device, dtype, min_time_s),
                          peak_bytes_per_s=peak_bytes_per_s(device, min_time_s), threads=torch.get_num_threads())
