"""The deployment a user would otherwise pick: the model colocated on one GPU type (the
TensorRT-LLM / vLLM shape), judged by the same performance model under the same SLO.

An instance is N GPUs. Attention is tensor-parallel inside a node (t = min(N, GPUs per
node)) and data-parallel across the N/t groups; experts are expert-parallel over all N
GPUs (tensor-parallel inside an expert once N exceeds the expert count). An MoE layer runs
attention (with DeepSeek's router and shared experts: dense work every token does), then the
all-to-all dispatch, the routed experts, and the all-to-all combine, with no micro-batch
overlap; a dense layer (DeepSeek's first) runs attention and its FFN, no all-to-all.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from megainfer.config import ModelConfig
from megainfer.errors import PlanError
from planner.catalog import GPU, Catalog
from planner.perf_model import MEMORY_HEADROOM, PerfModel
from planner.search import MAX_BATCH, OBJECTIVES, SEARCH_STEPS, Throughput

INSTANCE_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)


@dataclass
class ColocatedCandidate(Throughput):
    gpu: str
    attention_tp: int
    t_attention: float  # per layer, seconds
    t_experts: float
    t_all_to_all: float  # one direction


def _evaluate(model: ModelConfig, perf: PerfModel, gpu: GPU, n: int, batch):
    t = min(n, gpu.gpus_per_node)
    groups = n // t
    a_side = perf.sides([(gpu, t)], "attention")
    t_attn = perf.attention_time(a_side, batch / groups)[0]
    t_dense = perf.dense_layer_time(a_side, batch / groups)[0]
    experts_per_gpu = max(model.num_experts // n, 1)
    expert_tp = max(n // model.num_experts, 1)
    e_side = perf.sides([(gpu, min(expert_tp, gpu.gpus_per_node))], "experts", [experts_per_gpu])
    t_exp = perf.expert_time(e_side, batch * model.top_k / model.num_experts, experts_per_gpu)[0]
    step_s = max(float(s[0]) * batch / groups + float(c[0]) for s, c in perf.step_lines([(gpu, t)]))
    # Dispatch: each GPU sends its share of tokens to the GPUs of their experts (the local
    # share stays); inside a node over NVLink/PCIe, across nodes over the NIC.
    remote = (n - 1) / n
    per_gpu_bytes = batch / n * model.top_k * perf.token_bytes * remote
    bandwidth = gpu.link_bytes_per_s * perf.eff.link if n <= gpu.gpus_per_node else \
        gpu.nic_bytes_per_s * perf.utilization(per_gpu_bytes / max(n - 1, 1))
    t_a2a = np.where(n > 1, per_gpu_bytes / bandwidth, 0.0)
    tbt = model.num_moe_layers * (t_attn + t_exp + 2 * t_a2a) + model.first_k_dense * t_dense + step_s
    return t, t_attn, t_exp, t_a2a, tbt


def _fits(model: ModelConfig, perf: PerfModel, gpu: GPU, n: int) -> int:
    """Sequences whose KV fits on an instance of n GPUs (<= 0: the weights alone do not). Each
    attention group of t GPUs holds one copy of the attention weights, and of a sequence's KV
    split over its t ranks (MLA: one whole copy per rank, `ModelConfig.kv_shards`); the routed
    experts of the MoE layers once over all n."""
    t = min(n, gpu.gpus_per_node)
    weights = perf.attention_weight_bytes() * (n // t) \
        + model.num_experts * model.expert_params * model.num_moe_layers * perf.dtype_bytes
    free = n * gpu.memory_bytes * MEMORY_HEADROOM - weights
    return int(free // (perf.kv_bytes_per_sequence() * (t // model.kv_shards(t))))


def best_colocated(model: ModelConfig, catalog: Catalog, gpus: list[str], *, tbt_slo_s: float, perf: PerfModel,
                   objective: str = "cost") -> ColocatedCandidate | None:
    """The best colocated deployment over `gpus` and instance sizes, or None if none meets the SLO."""
    if objective not in OBJECTIVES:
        raise PlanError(f"objective {objective!r} is not one of {', '.join(OBJECTIVES)}")
    best: ColocatedCandidate | None = None
    for gpu in (catalog[g] for g in gpus):
        for n in INSTANCE_SIZES:
            capacity = _fits(model, perf, gpu, n)
            if capacity < 1 or _evaluate(model, perf, gpu, n, 1)[-1] > tbt_slo_s:
                continue
            lo, hi = 1, min(capacity, MAX_BATCH)
            for _ in range(SEARCH_STEPS):
                if lo >= hi:
                    break
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if _evaluate(model, perf, gpu, n, mid)[-1] <= tbt_slo_s else (lo, mid - 1)
            t, t_attn, t_exp, t_a2a, tbt = _evaluate(model, perf, gpu, n, lo)
            cand = ColocatedCandidate(gpu=gpu.name, gpus=n, attention_tp=t, batch=lo, t_attention=float(t_attn),
                                      t_experts=float(t_exp), t_all_to_all=float(t_a2a), tbt=float(tbt),
                                      cost_per_hour=n * gpu.price, power_w=n * gpu.power_w)
            if best is None or cand.objective(objective) > best.objective(objective):
                best = cand
    return best
