"""Time and energy of one engine step on a colocated instance (the model on `tp` devices of one
node, attention and experts tensor-parallel), from what the step computes.

The simulator (`megainfer.tools.simulator`) describes each step of the real scheduler as a few
layer classes: how many tokens pass a layer, the attention work (decoding sequences and the
context they read, prompt chunks and what precedes them), and how many distinct experts its
tokens activated in each layer. This module sums the operators' seconds for that work
(`operator_costs`): from an operator profile measured on the device where it covers the
step, elsewhere from the roofline corrected by efficiency curves. The planner, the simulator
and the router's prior price steps with this one model. (A live node's step times are fitted
online instead, from the steps it measured: `megainfer.routing.online_step_model`.)

Expert weights dominate an MoE step's bytes: a layer reads every expert any of its tokens
chose, once per step. That is the traffic layered prefill saves. A dense layer (DeepSeek's
first `first_k_dense`) routes nothing: its FFN is dense work, like attention, and so are an
MoE layer's shared experts (`OperatorCosts.dense`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from megainfer.config import ModelConfig
from megainfer.errors import PlanError
from planner.catalog import GPU
from planner.efficiency_curves import EfficiencyCurves
from planner.operator_costs import DevicePeaks, OperatorCosts, chunk_score_pairs
from planner.operator_profile import OperatorProfile
from planner.perf_model import MEMORY_HEADROOM

# Board power a GPU draws while its kernels wait (launch gaps, synchronisation), as a
# fraction of its rated power. H100 SXM idles near 70-100 W of 700 W and sits higher while
# a serving loop keeps it clocked up.
IDLE_POWER_FRACTION = 0.3


@dataclass(frozen=True)
class AttentionWork:
    """One layer's attention in a step: the decoding sequences and the prompt chunks."""

    decode_seqs: int = 0
    decode_context: float = 0.0  # cached tokens the decodes read, summed (each its whole context)
    prefill_chunks: tuple[tuple[int, int], ...] = ()  # (chunk tokens, tokens cached before it)

    @property
    def score_pairs(self) -> float:
        return self.decode_context + sum(chunk_score_pairs(n, p) for n, p in self.prefill_chunks)

    @property
    def kv_tokens(self) -> float:
        return self.decode_context + sum(n + p for n, p in self.prefill_chunks)

    def __add__(self, other: "AttentionWork") -> "AttentionWork":
        return AttentionWork(self.decode_seqs + other.decode_seqs, self.decode_context + other.decode_context,
                             self.prefill_chunks + other.prefill_chunks)

    @classmethod
    def of_chunks(cls, chunks: list[tuple[int, int]]) -> "AttentionWork":
        """From (scheduled tokens, computed tokens) per sequence: one-token rows decode."""
        decodes = [p + 1 for n, p in chunks if n == 1]
        return cls(len(decodes), float(sum(decodes)), tuple((n, p) for n, p in chunks if n > 1))


@dataclass(frozen=True)
class LayerClass:
    """`layers` layers that see the same work in one step (the expert count varies per layer)."""

    layers: int
    tokens: int  # tokens through each of these layers
    attention: AttentionWork
    # distinct routed experts activated: one entry per MoE layer of these, or one count for all of them
    active_experts: np.ndarray | int
    dense_layers: int = 0  # of `layers`, those with a dense FFN and no routed experts (DeepSeek's first)

    @property
    def moe_layers(self) -> int:
        return self.layers - self.dense_layers


@dataclass(frozen=True)
class StepCost:
    seconds: float
    expert_bytes: float  # expert weights read, all devices together
    energy_j: float  # estimate, all devices together (0 where the device's power is unknown)
    operators: dict[str, float] = field(default_factory=dict, compare=False)  # seconds by operator


class ColocatedStepModel:
    def __init__(self, model: ModelConfig, gpu: GPU | None, tp: int, *, dtype_bytes: int | None = None,
                 curves: EfficiencyCurves | None = None, profile: OperatorProfile | None = None,
                 curves_path: str | None = None, idle_power_fraction: float = IDLE_POWER_FRACTION,
                 expert_bytes_per_param: float | None = None, tuned_expert_tiles: bool = False) -> None:
        """`gpu` (the catalog's entry) gives memory, power and the curves' peaks; it may be None
        when a profile is given (a CPU, or a device outside the catalog): the profile's measured
        peaks and KV capacity stand in, and energy is not estimated. `tuned_expert_tiles`: the
        engine priced runs expert tiles tuned for this shape and GPU (`OperatorCosts`)."""
        if gpu is None and profile is None:
            raise PlanError("a step model needs a GPU from the catalog (--gpu) or an operator profile (--profile)")
        if gpu is not None and (tp < 1 or tp > gpu.gpus_per_node):
            raise PlanError(f"--tp {tp}: a colocated instance uses 1..{gpu.gpus_per_node} GPUs of one {gpu.name} node")
        self.model, self.gpu, self.tp, self.profile = model, gpu, tp, profile
        self.dtype_bytes = dtype_bytes or (profile.dtype_bytes if profile is not None else 2)
        if gpu is not None:
            peaks = DevicePeaks.of(gpu)
        else:
            d = profile.device
            peaks = DevicePeaks(d.name, d.peak_flops or 1e12, d.peak_bytes_per_s or 1e11, d.peak_bytes_per_s or 1e11)
        self.curves = curves or EfficiencyCurves.load(gpu.name if gpu is not None else "cpu", curves_path)
        self.ops = OperatorCosts(model, tp, peaks, self.curves, dtype_bytes=self.dtype_bytes, profile=profile,
                                 expert_bytes_per_param=expert_bytes_per_param, tuned_expert_tiles=tuned_expert_tiles)
        # Expert weights as stored (MXFP4 for gpt-oss's published checkpoints, when the engine
        # priced computes from them; megainfer itself dequantizes at load).
        self.expert_bytes_per_param = expert_bytes_per_param or self.dtype_bytes
        self.expert_bytes_each = model.expert_params * self.expert_bytes_per_param
        self.power_w = tp * gpu.power_w if gpu is not None else 0.0
        self.idle_w = self.power_w * idle_power_fraction

    @property
    def device_name(self) -> str:
        if self.profile is not None and (self.gpu is None or self.profile.device.kind != "cuda"):
            return self.profile.device.name
        return self.gpu.name

    def kv_capacity_tokens(self) -> int:
        """Tokens of KV cache the instance holds: the profiled engine's own sizing where a profile
        says it, else what fits beside the weights on the GPUs."""
        if self.profile is not None and self.profile.kv_cache_tokens:
            return int(self.profile.kv_cache_tokens)
        model = self.model
        experts = model.num_moe_layers * model.num_experts * model.expert_params
        weights = (model.num_params - experts) * self.dtype_bytes + experts * self.expert_bytes_per_param
        free = self.tp * self.gpu.memory_bytes * MEMORY_HEADROOM - weights
        # A block id's layers, over the tp ranks: split (KV heads) or, MLA, a whole copy on each.
        per_token = model.kv_cache_width * self.dtype_bytes * model.kv_cache_layers * (self.tp // model.kv_shards(self.tp))
        if free < per_token:
            raise PlanError(f"{model.name} ({weights / 1e9:.1f} GB of weights) does not fit on {self.tp} x "
                            f"{self.gpu.name} ({self.gpu.memory_gb:g} GB each); raise --tp")
        return int(free // per_token)

    def step(self, layer_classes: list[LayerClass], *, sampled: int, seqs: int) -> StepCost:
        """A step of `seqs` scheduled sequences, `sampled` of which sample a token."""
        ops = self.ops
        by_op = dict.fromkeys(("dense", "attention", "moe", "allreduce", "lm_head", "sampling", "host",
                               "step_overhead"), 0.0)
        expert_bytes = 0.0
        layers_run = 0
        for group in layer_classes:  # layers that see the same work
            if group.layers == 0 or group.tokens == 0:
                continue  # layers no token passes this step (layered prefill with no decodes)
            work = group.attention
            attention = ops.attention_decode(work.decode_seqs, work.decode_context) + sum(
                ops.attention_prefill(n, p) for n, p in work.prefill_chunks)
            layers_run += group.layers
            by_op["attention"] += group.layers * attention
            by_op["dense"] += group.moe_layers * ops.dense(group.tokens)
            if group.dense_layers:
                by_op["dense"] += group.dense_layers * ops.dense(group.tokens, moe_layer=False)
            by_op["allreduce"] += group.layers * 2 * ops.allreduce(group.tokens)  # attention's, and the FFN's
            if group.moe_layers == 0:
                continue
            active = group.active_experts
            if isinstance(active, (int, np.integer)):
                by_op["moe"] += group.moe_layers * ops.moe(group.tokens, int(active))
                expert_bytes += group.moe_layers * int(active) * self.expert_bytes_each
            else:
                by_op["moe"] += ops.moe(group.tokens, active)
                expert_bytes += float(active.sum()) * self.expert_bytes_each
        # The host issues the layers while the GPU runs the ones before: the GPU waits only where
        # the layers' kernels take less than their issuing (small decode batches).
        kernels = by_op["dense"] + by_op["attention"] + by_op["allreduce"] + by_op["moe"]
        by_op["host"] = max(0.0, layers_run * self.curves.layer_host_s - kernels)
        by_op["lm_head"] = ops.lm_head(sampled)
        by_op["sampling"] = ops.sampling(sampled)
        by_op["step_overhead"] = ops.step_overhead(seqs)
        seconds = sum(by_op.values())
        busy = seconds - by_op["step_overhead"] - by_op["host"]  # kernels at work: power beyond idle
        energy = self.idle_w * seconds + (self.power_w - self.idle_w) * busy
        return StepCost(seconds, expert_bytes, energy, by_op)

    def explain(self) -> list[tuple[str, str]]:
        """(operator, where its seconds came from) over the steps priced so far."""
        return sorted(self.ops.source_summary().items())


def device_label(step_model: ColocatedStepModel) -> str:
    """'2 x H100', or the profiled device's name."""
    return f"{step_model.tp} x {step_model.device_name}"
