"""MegaScale-Infer's performance model (§4): per-micro-batch attention time T_a, expert time
T_e and one-way network time T_c for one layer, the iteration latency they give, and the
memory constraint.

T_a and T_e come from the operator model the simulator uses (`phase_lines` draws them as
lines in the batch through `operator_costs`: an operator profile where one covers the
device, the roofline corrected by efficiency curves elsewhere), plus a per-iteration cost
(the framework's step overhead, LM head and sampling). A calibration file can replace the
attention and expert times with the paper's measured linear fits (T_a = k1·b_a + k2,
T_e = k3·b_e + k4 per expert) and the network's utilisation curve with a measured one.

Every function is plain arithmetic on numbers or numpy arrays (broadcasting), so the
search evaluates thousands of configurations in one call and tests evaluate one.

Symbols (per the paper): b_a tokens of one micro-batch on one attention node; b_e tokens
one expert receives from a whole micro-batch; m micro-batches; L layers; T_f = max(T_a, T_e).

DeepSeek-V2/V3 (docs/planner.md, "DeepSeek"): the attention node also runs every MoE layer's
shared experts (in T_a) and the first `first_k_dense` layers whole, FFN included (T_d per
layer and micro-batch, no exchange); expert nodes hold the routed experts of the
`num_moe_layers` MoE layers only, so L in the pipeline is the MoE layers. MLA's KV cache is
`kv_cache_width` values per token and layer, held whole by every attention rank.
"""

from __future__ import annotations

import copy

import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import yaml

from megainfer.config import (GPU_MEMORY_UTILIZATION, KV_BLOCK_TOKENS, ModelConfig, estimated_attention_step_bytes,
                              kv_cache_budget_bytes)
from megainfer.errors import PlanError
from planner.expert_popularity import PopularityPricing
from planner.catalog import GPU
from planner.round_host_cost import HostCost
from planner.operator_profile import OperatorProfile
from planner.phase_lines import PhaseLines

# Fraction of GPU memory plans may fill; the rest is activations, workspace, fragmentation.
MEMORY_HEADROOM = 0.9
# Prompt tokens a step may add beside its decodes in the plans written (the scheduler's
# default group size): the token budget is the decodes plus this (planner/search.py writes it).
PREFILL_CHUNK_TOKENS = 512


@dataclass(frozen=True)
class Efficiency:
    """Link efficiency of the colocated baseline's all-to-all (the phases' own efficiencies are
    the operator model's curves)."""

    link: float = 0.8  # achieved fraction of NVLink/PCIe bandwidth


@dataclass(frozen=True)
class UtilizationCurve:
    """Achieved fraction of NIC bandwidth as a function of message size (bytes), linear in
    log2(size) between measured points; flat beyond both ends."""

    sizes: tuple[float, ...] = (1024, 8192, 32768, 131072, 262144, 1048576, 8388608)
    utils: tuple[float, ...] = (0.03, 0.18, 0.42, 0.68, 0.78, 0.86, 0.90)

    def __post_init__(self) -> None:
        if len(self.sizes) != len(self.utils) or len(self.sizes) < 2:
            raise PlanError("network.utilization needs at least two [bytes, utilisation] points")
        if any(b <= a for a, b in zip(self.sizes, self.sizes[1:])):
            raise PlanError("network.utilization sizes must increase")
        if not all(0 < u <= 1 for u in self.utils):
            raise PlanError("network.utilization values must lie in (0, 1]")

    def __call__(self, message_bytes):
        x = np.log2(np.maximum(message_bytes, 1.0))
        return np.interp(x, np.log2(self.sizes), self.utils)


@dataclass
class Calibration:
    """Measured coefficients replacing the roofline where present.

    attention[(gpu, tp)] = (k1 s/token, k2 s) with T_a = k1·b_a + k2 at the measured seq_len;
    experts[(gpu, tp)] = (k3 s/token, k4 s) with T_e = experts_per_node·(k3·b_e + k4)."""

    attention: dict[tuple[str, int], tuple[float, float]] = field(default_factory=dict)
    experts: dict[tuple[str, int], tuple[float, float]] = field(default_factory=dict)
    utilization: UtilizationCurve | None = None

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Calibration":
        """YAML: attention: {H20: {tp2: {k1: .., k2: ..}}}, experts: {L40S: {tp1: {k3: .., k4: ..}}},
        network: {utilization: [[bytes, util], ...]}."""
        path = Path(path)
        if not path.is_file():
            raise PlanError(f"calibration file {str(path)!r} does not exist")
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as exc:
            raise PlanError(f"{path}: not valid YAML ({exc})") from None
        if not isinstance(data, dict):
            raise PlanError(f"{path}: a calibration file is a mapping with attention/experts/network")
        unknown = sorted(set(data) - {"attention", "experts", "network"})
        if unknown:
            raise PlanError(f"{path}: unknown key {unknown[0]!r}; keys: attention, experts, network")
        cal = cls()
        for section, (slope, const) in (("attention", ("k1", "k2")), ("experts", ("k3", "k4"))):
            for gpu, by_tp in (data.get(section) or {}).items():
                for tp_key, coeffs in (by_tp or {}).items():
                    where = f"{path}: {section}.{gpu}.{tp_key}"
                    if not (isinstance(tp_key, str) and tp_key.startswith("tp") and tp_key[2:].isdigit()):
                        raise PlanError(f"{where}: keys under a GPU are tp1, tp2, tp4, ...")
                    if not isinstance(coeffs, dict) or {slope, const} - set(coeffs):
                        raise PlanError(f"{where}: needs {slope} and {const} (seconds per token, seconds)")
                    values = (coeffs[slope], coeffs[const])
                    if not all(isinstance(v, (int, float)) and v >= 0 for v in values):
                        raise PlanError(f"{where}: {slope} and {const} must be non-negative numbers")
                    getattr(cal, section)[(str(gpu), int(tp_key[2:]))] = (float(values[0]), float(values[1]))
        points = (data.get("network") or {}).get("utilization")
        if points is not None:
            try:
                sizes, utils = zip(*((float(s), float(u)) for s, u in points))
            except (TypeError, ValueError):
                raise PlanError(f"{path}: network.utilization must be a list of [bytes, utilisation] pairs") from None
            cal.utilization = UtilizationCurve(sizes, utils)
        return cal


@dataclass(frozen=True)
class Side:
    """One side's hardware as the formulas need it. Fields may be numpy arrays (one entry per
    configuration); `k_slope`/`k_const` are NaN where no calibration applies. `lines`: the
    phase's time as the largest of these (slope, constant) lines in its batch, from the
    operator model (`phase_lines`), arrays over configurations like the rest."""

    nic: object  # bytes/s per GPU
    tp: object
    lines: tuple = ()
    dense_lines: tuple = ()  # attention side: one dense layer's time (T_d), lines like `lines`; () without dense layers
    k_slope: object = math.nan
    k_const: object = math.nan


class PerfModel:
    def __init__(self, model: ModelConfig, seq_len: int, dtype_bytes: int = 2,
                 efficiency: Efficiency = Efficiency(), calibration: Calibration | None = None, *,
                 curves_path: str | None = None, profiles: list[OperatorProfile] = (),
                 host: HostCost | None = None, skew: PopularityPricing | None = None, redundant_experts: int = 0) -> None:
        """`host`: the host's CPU time per M2N round (planner/round_host_cost.py), charged where given.
        `skew`: expert popularity, charged as the hottest expert node's load (expert_popularity.py;
        None: uniform routing); `redundant_experts`: the most spare slots per expert node the
        search tries (0..this), each priced with the redundancy plan's placement."""
        if seq_len <= 0:
            raise PlanError(f"--seq-len must be positive, got {seq_len}")
        self.phases = PhaseLines(model, seq_len, dtype_bytes, curves_path, list(profiles))
        self.model = model
        self.seq_len = seq_len  # mean context length of decoding sequences, tokens
        self.dtype_bytes = dtype_bytes
        self.eff = efficiency
        self.calibration = calibration or Calibration()
        self.host = host
        if redundant_experts < 0:
            raise PlanError(f"--redundant-experts must not be negative, got {redundant_experts}")
        self.skew, self.redundant_experts = skew, redundant_experts
        self.utilization = self.calibration.utilization or UtilizationCurve()
        m = model
        self.attn_weight_params = m.attention_params_per_layer  # per layer, averaged: router, shared experts, dense FFNs
        self.kv_bytes_per_token_layer = m.kv_cache_width * dtype_bytes  # all ranks' KV heads, or MLA's latent once
        self.token_bytes = m.hidden_size * dtype_bytes  # one hidden vector on the wire
        self.record_bytes = self.token_bytes + 8 * m.top_k  # a dispatch record: the vector, k ids, k weights

    # -- compute -------------------------------------------------------------------------
    def sides(self, configs: list[tuple[GPU, int]], role: str, experts_per_node=None) -> Side:
        """One Side whose fields are arrays over `configs` (GPU, tp): the attention or expert
        phase's lines from the operator model, and the calibration where it covers a config."""
        cal = self.calibration.attention if role == "attention" else self.calibration.experts
        coeffs = np.array([cal.get((g.name, tp), (np.nan, np.nan)) for g, tp in configs], dtype=np.float64)
        dense_lines = ()
        if role == "attention":
            per_config = [self.phases.attention(g, tp) for g, tp in configs]
            if self.model.first_k_dense:  # not calibrated: k1, k2 are measured on MoE layers
                dense_lines = _stacked([self.phases.dense_layers(g, tp) for g, tp in configs])
        else:
            per_config = [self.phases.experts(g, tp, int(e)) for (g, tp), e in zip(configs, experts_per_node)]
        return Side(nic=np.array([g.nic_bytes_per_s for g, _ in configs]),
                    tp=np.array([tp for _, tp in configs], dtype=np.float64), lines=_stacked(per_config),
                    dense_lines=dense_lines, k_slope=coeffs[:, 0], k_const=coeffs[:, 1])

    def step_lines(self, configs: list[tuple[GPU, int]]) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per iteration on an attention node, as lines in its sequences: step overhead, LM
        head and sampling."""
        return list(_stacked([self.phases.per_step(g, tp) for g, tp in configs]))

    def attention_pieces(self, side: Side) -> list[tuple[object, object]]:
        """T_a as max over linear pieces (slope s/token, constant s) of b_a: the operator
        model's lines, or the calibrated k1·b_a + k2 where the calibration covers this GPU and tp."""
        calibrated = ~np.isnan(side.k_slope)
        return [(np.where(calibrated, side.k_slope, slope), np.where(calibrated, side.k_const, const))
                for slope, const in side.lines]

    def attention_time(self, side: Side, b_a):
        """T_a: one micro-batch of b_a tokens through one MoE layer's attention half on one node."""
        return np.maximum.reduce([slope * b_a + const for slope, const in self.attention_pieces(side)])

    def dense_layer_time(self, side: Side, b_a):
        """T_d: one micro-batch of b_a tokens through one dense layer, FFN included, on one
        attention node (0 for a model without dense layers)."""
        if not side.dense_lines:
            return np.zeros(np.broadcast(b_a, side.tp).shape)
        return np.maximum.reduce([slope * b_a + const for slope, const in side.dense_lines])

    def expert_pieces(self, side: Side, experts_per_node) -> list[tuple[object, object]]:
        """T_e as max over linear pieces of b_e (tokens each expert receives): the operator
        model's lines (drawn for the side's experts per node), or the calibrated
        experts_per_node·(k3·b_e + k4)."""
        e = experts_per_node
        calibrated = ~np.isnan(side.k_slope)
        return [(np.where(calibrated, e * side.k_slope, slope), np.where(calibrated, e * side.k_const, const))
                for slope, const in side.lines]

    def expert_time(self, side: Side, b_e, experts_per_node):
        """T_e: one micro-batch through one layer's experts on one node; each of its
        `experts_per_node` experts receives b_e tokens."""
        return np.maximum.reduce([slope * b_e + const for slope, const in self.expert_pieces(side, experts_per_node)])

    # -- network -------------------------------------------------------------------------
    def without_redundancy(self) -> "PerfModel":
        """This model with no spare expert slot searched (the same skew)."""
        other = copy.copy(self)
        other.redundant_experts = 0
        return other

    def hot_factor(self, experts_per_node: int, redundant: int) -> float:
        """The hottest expert node's tokens per held expert over the uniform b_e (1 without skew)."""
        return 1.0 if self.skew is None else self.skew.hot_factor(experts_per_node, redundant)

    def expert_imbalance(self, experts_per_node: int, redundant: int) -> float:
        return 1.0 if self.skew is None else self.skew.imbalance(experts_per_node, redundant)

    def node_hit_probability(self, experts_per_node):
        """Chance a token picks at least one of a node's experts (uniform routing): the
        token travels to that node once, whatever number of its experts it chose."""
        e, k = self.model.num_experts, self.model.top_k
        per = np.asarray(experts_per_node, dtype=np.float64)
        # 1 - C(E - per, K) / C(E, K) = 1 - prod_{i<K} (E - per - i) / (E - i)
        miss = np.ones_like(per)
        for i in range(k):
            miss = miss * np.clip(e - per - i, 0, None) / (e - i)
        return 1.0 - miss

    def message_bytes(self, b_a, tp_a, tp_e, experts_per_node):
        """Bytes one attention GPU writes to one expert GPU per micro-batch and layer."""
        tokens = b_a * self.node_hit_probability(experts_per_node)
        return tokens * self.token_bytes / (tp_a * tp_e)

    def transfer_seconds_per_byte(self, attention: Side, experts: Side, n_a, expert_nodes):
        """Seconds per message byte at full utilisation: an attention GPU writes one message to
        each of the expert_nodes·tp_e expert GPUs, an expert GPU receives one from each of the
        n_a·tp_a attention GPUs; the slower end bounds the exchange."""
        return np.maximum(expert_nodes * experts.tp / attention.nic, n_a * attention.tp / experts.nic)

    def transfer_time(self, attention: Side, experts: Side, b_a, n_a, expert_nodes, experts_per_node):
        """T_c, the paper's equation (6): one direction of the attention<->expert exchange of
        one micro-batch for one layer, bounded by the slower of an attention GPU's sends and an
        expert GPU's receives, each at the bandwidth its message size achieves."""
        msg = self.message_bytes(b_a, attention.tp, experts.tp, experts_per_node)
        return msg / self.utilization(msg) * self.transfer_seconds_per_byte(attention, experts, n_a, expert_nodes)

    # -- pipeline ------------------------------------------------------------------------
    def iteration_time(self, t_a, t_e, t_c, m, step_s=0.0, t_dense=0.0):
        """Time between tokens: one token for every sequence, all m micro-batches through all L
        layers, plus `step_s`, the iteration's own cost (step overhead, LM head, sampling).

        A micro-batch's round trip through an MoE layer is T_a + T_c + T_e + T_c; the attention
        node starts a new micro-batch every T_f, so a layer's period is max(m·T_f, round trip).
        With constraint (3) met this is the paper's (T_a + T_e + 2T_c) + T_f·(m·L - 1), L the
        MoE layers. A dense layer (DeepSeek's first) has no exchange: the attention node runs its
        m micro-batches back to back, m·T_d (`t_dense`) each, before the first round trip."""
        t_f = np.maximum(t_a, t_e)
        trip = t_a + t_e + 2 * t_c
        period = np.maximum(m * t_f, trip)
        dense = self.model.first_k_dense * m * t_dense
        return dense + trip + (self.model.num_moe_layers - 1) * period + (m - 1) * t_f + step_s

    # -- memory (constraint 8) -------------------------------------------------------------
    def attention_weight_bytes(self) -> float:
        """Per attention node: every layer's attention half (shared experts and dense FFNs
        included), embedding and LM head."""
        m = self.model
        head = m.vocab_size * m.hidden_size * (1 if m.tie_word_embeddings else 2)
        return (m.num_layers * self.attn_weight_params + head) * self.dtype_bytes

    def kv_bytes_per_sequence(self) -> float:
        """A sequence's KV cache in whole blocks, as the runtime allocates it, over all of an
        attention node's ranks (MLA: one rank's copy; each holds it whole)."""
        m = self.model  # a windowed layer's blocks share tensors with a full one's (ModelConfig.kv_cache_layers)
        tokens = m.kv_blocks_per_sequence(math.ceil(self.seq_len), KV_BLOCK_TOKENS) * KV_BLOCK_TOKENS
        return tokens * self.kv_bytes_per_token_layer * m.kv_cache_layers

    def max_sequences_per_attention_node(self, memory_bytes, tp):
        """Sequences whose KV cache fits on one attention node (may be <= 0), sized as the runtime
        sizes them (megainfer/runner/memory_profile.py) and as a plan's dry run estimates it
        (deploy/runtime_config.estimated_kv_blocks): each rank's KV cache gets
        GPU_MEMORY_UTILIZATION of the GPU's memory less its weights (the embedding and LM head
        whole, 1/tp of the layers) and its largest step, which grows with the sequences: it
        samples every one of them and carries their decodes plus a prefill chunk
        (config.estimated_attention_step_bytes, linear in the sequences: its cost at 0
        sequences and per sequence). A rank holds 1/tp of every sequence's KV, or with MLA all of
        it (`ModelConfig.kv_shards`)."""
        m, value_bytes = self.model, self.dtype_bytes
        fixed = estimated_attention_step_bytes(m, value_bytes, 0, PREFILL_CHUNK_TOKENS)
        per_sequence = estimated_attention_step_bytes(m, value_bytes, 1, PREFILL_CHUNK_TOKENS + 1) - fixed
        budget = kv_cache_budget_bytes(memory_bytes, GPU_MEMORY_UTILIZATION,
                                       m.attention_rank_weight_bytes(value_bytes, tp) + fixed)
        return np.floor(budget / (self.kv_bytes_per_sequence() / m.kv_shards(tp) + per_sequence))

    def expert_node_fits(self, memory_bytes, tp, experts_per_node):
        """Whether an expert node's experts fit: their weights in each MoE layer (dense layers
        have none; shared experts live on the attention side)."""
        need = experts_per_node * self.model.expert_params * self.model.num_moe_layers * self.dtype_bytes
        return need <= memory_bytes * MEMORY_HEADROOM * tp


def _stacked(per_config: list[list[tuple[float, float]]]) -> tuple[tuple[np.ndarray, np.ndarray], ...]:
    """Each config's lines [(slope, constant), ...] -> per line, (slopes, constants) as arrays
    over the configs."""
    return tuple((np.array([lines[i][0] for lines in per_config]), np.array([lines[i][1] for lines in per_config]))
                 for i in range(len(per_config[0])))


def min_micro_batches(t_f: float, t_c: float) -> int:
    """Constraint (3), m·T_f >= 2·(T_f + T_c): the fewest micro-batches that keep both sides busy.
    Under constraint (2) (T_c < T_f) this is 3 when T_c < T_f/2 and 4 otherwise."""
    return max(2, math.ceil(2 * (t_f + t_c) / t_f - 1e-12))


def roofline_utilization(tokens_per_gemm, flops: float, hbm_bytes_per_s: float):
    """Fraction of peak FLOPs a bf16 weight GEMM over `tokens_per_gemm` tokens can reach on the
    roofline: its arithmetic intensity (tokens FLOPs per weight byte) over the ridge point."""
    return np.minimum(1.0, tokens_per_gemm / (flops / hbm_bytes_per_s))
