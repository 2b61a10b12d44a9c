"""Time and energy of one engine step on a colocated instance (the model on `tp` GPUs of one
node, attention and experts tensor-parallel), from what the step computes.

The simulator (`megainfer.simulator`) describes each step of the real scheduler as a few
layer classes: how many tokens pass a layer, how many query-key pairs its attention scores,
how many cached tokens it reads, and how many distinct experts its tokens activated. This
module turns that into seconds with the same roofline as `perf_model` (every phase is the
larger of its FLOPs over the achievable FLOP rate and its bytes over the achievable HBM
bandwidth, plus launch overhead and the tensor-parallel all-reduce), so the planner, the
simulator and the router predict with one set of formulas. (A live node's step times are
fitted online instead, from the steps it measured: `megainfer.routing.online_step_model`.)

Expert weights dominate an MoE step's bytes: a layer reads every expert any of its tokens
chose, once per step. That is the traffic layered prefill saves.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from megainfer.config import ModelConfig
from megainfer.errors import PlanError
from planner.catalog import GPU
from planner.perf_model import MEMORY_HEADROOM, Efficiency

# Board power a GPU draws while its kernels wait (launch gaps, synchronisation), as a
# fraction of its rated power. H100 SXM idles near 70-100 W of 700 W and sits higher while
# a serving loop keeps it clocked up.
IDLE_POWER_FRACTION = 0.3


@dataclass(frozen=True)
class LayerClass:
    """`layers` layers that see the same work in one step (the expert count varies per layer)."""

    layers: int
    tokens: int  # tokens through each of these layers
    score_pairs: float  # query-key pairs its attention scores, summed over sequences
    kv_tokens: float  # cached tokens its attention reads, summed over sequences
    active_experts: np.ndarray | int  # distinct experts activated: one entry per layer, or one count for all


@dataclass(frozen=True)
class StepCost:
    seconds: float
    expert_bytes: float  # expert weights read, all GPUs together
    energy_j: float  # estimate, all GPUs together


class ColocatedStepModel:
    def __init__(self, model: ModelConfig, gpu: GPU, tp: int, *, dtype_bytes: int = 2,
                 efficiency: Efficiency = Efficiency(), idle_power_fraction: float = IDLE_POWER_FRACTION) -> None:
        if tp < 1 or tp > gpu.gpus_per_node:
            raise PlanError(f"--tp {tp}: a colocated instance uses 1..{gpu.gpus_per_node} GPUs of one {gpu.name} node")
        self.model, self.gpu, self.tp, self.dtype_bytes = model, gpu, tp, dtype_bytes
        self.overhead_s = efficiency.layer_overhead_s
        flops = tp * gpu.flops * efficiency.compute
        hbm = tp * gpu.hbm_bytes_per_s * efficiency.memory
        # Seconds per unit of work, the whole instance together.
        self.s_per_flop = 1.0 / flops
        self.s_per_byte = 1.0 / hbm
        self.attn_params = model.attention_params_per_layer
        self.expert_bytes_each = model.expert_params * dtype_bytes
        # A layer with tokens activates at least top_k experts: below this compute time its
        # expert half is memory-bound whatever the count.
        self.min_expert_read_s = model.top_k * self.expert_bytes_each * self.s_per_byte
        self.kv_bytes_per_token_layer = 2 * model.kv_size * dtype_bytes
        # Two all-reduces per layer (after attention, after the experts): ring traffic per GPU.
        token_bytes = model.hidden_size * dtype_bytes
        self.allreduce_s_per_token = 0.0 if tp == 1 else \
            2 * 2 * (tp - 1) / tp * token_bytes / (gpu.link_bytes_per_s * efficiency.link)
        self.allreduce_fixed_s = 0.0 if tp == 1 else 2 * efficiency.allreduce_latency_s
        self.head_bytes = model.vocab_size * model.hidden_size * dtype_bytes
        self.power_w = tp * gpu.power_w
        self.idle_w = self.power_w * idle_power_fraction

    def kv_capacity_tokens(self) -> int:
        """Tokens of KV cache that fit beside the weights on the instance's GPUs."""
        model = self.model
        weights = model.num_params * self.dtype_bytes
        free = self.tp * self.gpu.memory_bytes * MEMORY_HEADROOM - weights
        per_token = self.kv_bytes_per_token_layer * model.num_layers
        if free < per_token:
            raise PlanError(f"{model.name} ({weights / 1e9:.1f} GB of weights) does not fit on {self.tp} x "
                            f"{self.gpu.name} ({self.gpu.memory_gb:g} GB each); raise --tp")
        return int(free // per_token)

    def step(self, layer_classes: list[LayerClass], sampled_tokens: int) -> StepCost:
        model = self.model
        busy = 0.0  # time at the roofline (not launch gaps): what draws power beyond idle
        seconds = 0.0
        expert_bytes = 0.0
        for group in layer_classes:  # layers that see the same work
            if group.layers == 0 or group.tokens == 0:
                continue  # layers no token passes this step (layered prefill with no decodes)
            attn_flops = 2 * self.attn_params * group.tokens + 4 * model.q_size * group.score_pairs
            attn_bytes = self.attn_params * self.dtype_bytes + group.kv_tokens * self.kv_bytes_per_token_layer
            t_attn = max(attn_flops * self.s_per_flop, attn_bytes * self.s_per_byte)
            t_moe_flops = 2 * model.expert_params * model.top_k * group.tokens * self.s_per_flop
            if isinstance(group.active_experts, int):
                read = group.layers * group.active_experts * self.expert_bytes_each
                t_moe = group.layers * max(t_moe_flops, group.active_experts * self.expert_bytes_each * self.s_per_byte)
            else:
                read = float(group.active_experts.sum()) * self.expert_bytes_each
                if t_moe_flops <= self.min_expert_read_s:  # memory-bound in every layer
                    t_moe = read * self.s_per_byte
                else:
                    t_moe = float(np.maximum(t_moe_flops, group.active_experts * self.expert_bytes_each
                                             * self.s_per_byte).sum())
            t_allreduce = self.allreduce_s_per_token * group.tokens + self.allreduce_fixed_s
            layer_busy = group.layers * (t_attn + t_allreduce) + t_moe
            busy += layer_busy
            seconds += layer_busy + group.layers * 2 * self.overhead_s
            expert_bytes += read
        if sampled_tokens:
            t_head = max(2 * self.head_bytes / self.dtype_bytes * sampled_tokens * self.s_per_flop,
                         self.head_bytes * self.s_per_byte)
            busy += t_head
            seconds += t_head + self.overhead_s
        energy = self.idle_w * seconds + (self.power_w - self.idle_w) * busy
        return StepCost(seconds, expert_bytes, energy)
