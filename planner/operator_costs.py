"""Seconds of each operator of one instance (the model on `tp` devices, TP-sharded): from an
operator profile where its grid covers the point, elsewhere from the roofline corrected by
efficiency curves. Counts, per operator, how many lookups each source answered, which is what
`plan --explain` and `simulate` report.

The operators are the profile's (planner/operator_profile.py): per layer `dense`,
`attention_decode`, `attention_prefill`, `moe`, `allreduce`; per step `lm_head`, `sampling`,
`step_overhead`. Every method prices what one device of the instance spends (the TP ranks run
in lockstep on 1/tp of the work each).

DeepSeek's multi-head latent attention (MLA) caches per token and layer one latent of
kv_lora_rank values and a rotary key of qk_rope_head_dim (`ModelConfig.kv_cache_width`), read
whole by every rank (`ModelConfig.kv_shards`). Decode runs it absorbed: q_nope goes through
W_UK into the latent space and the latent-weighted sum through W_UV (those GEMMs are per token,
in `dense`: `attention_side_params` counts W_UK and W_UV), so a (query head, cached token) pair
costs 2·(kv_lora_rank + qk_rope_head_dim) FLOPs for the score and 2·kv_lora_rank for the value
sum. Prompt chunks run decompressed, as ordinary attention over K and V of head_dim and
v_head_dim, after decompressing the cached context's latents (the chunk's own in `dense`).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np

from megainfer.config import ModelConfig
from planner.catalog import GPU
from planner.efficiency_curves import EfficiencyCurves, OperatorCurves
from planner.operator_profile import OPERATOR_AXES, OperatorProfile

PROFILE, CURVES = "profile", "curves"

# Kernel launches per call where the curves price an operator (the profile measured them).
LAUNCHES = {"dense": 8, "attention": 2, "moe": 6, "lm_head": 2, "sampling": 4}


def chunk_score_pairs(tokens: int, cached: float) -> float:
    """Query-key pairs a prompt chunk of `tokens` after `cached` tokens scores (causal inside it)."""
    return tokens * cached + tokens * (tokens + 1) / 2


@dataclass(frozen=True)
class DevicePeaks:
    """One device's peaks, what the curves take fractions of."""

    name: str
    flops: float  # FLOP/s
    hbm_bytes_per_s: float
    link_bytes_per_s: float  # to its TP peers

    @classmethod
    def of(cls, gpu: GPU) -> "DevicePeaks":
        """A catalog GPU's datasheet peaks."""
        return cls(gpu.name, gpu.flops, gpu.hbm_bytes_per_s, gpu.link_bytes_per_s)


class OperatorCosts:
    def __init__(self, model: ModelConfig, tp: int, peaks: DevicePeaks, curves: EfficiencyCurves, *,
                 dtype_bytes: int = 2, profile: OperatorProfile | None = None,
                 expert_bytes_per_param: float | None = None, tuned_expert_tiles: bool = False) -> None:
        """`expert_bytes_per_param`: the expert weights' storage where it differs from `dtype_bytes`
        (MXFP4: 4.25 bits, a serving engine that computes from it directly reads that much).
        `tuned_expert_tiles`: the engine runs the expert GEMMs with tiles tuned for this shape
        and GPU (`EfficiencyCurves.moe_tuned_bandwidth` prices them)."""
        if profile is not None:
            profile.check_applies(model, tp)
        self.model, self.tp, self.peaks, self.curves, self.profile = model, tp, peaks, curves, profile
        self.dtype_bytes = dtype_bytes
        self.expert_bytes_per_param = expert_bytes_per_param or dtype_bytes
        self.sources: dict[str, Counter] = {op: Counter() for op in OPERATOR_AXES}
        m = model
        # The attention side's weights of one MoE layer (attention, router, shared experts) and of
        # one dense layer (attention, FFN); equal for a model without dense layers.
        self.attn_params = m.attention_side_params() / tp
        self.dense_layer_params = m.attention_side_params(moe_layer=False) / tp
        self.expert_params = m.expert_params / tp  # one expert's slice on one rank
        self.kv_bytes_per_token = m.kv_cache_width * dtype_bytes / m.kv_shards(tp)  # one layer's, one rank's
        heads = m.num_heads / tp
        if m.mla:  # FLOPs per (query token, cached token) pair on one rank; see the module's docstring
            self.decode_pair_flops = heads * (2 * m.kv_cache_width + 2 * m.kv_lora_rank)
            self.prefill_pair_flops = heads * 2 * (m.head_dim + m.v_head_dim)
            self.decompress_flops = heads * 2 * m.kv_lora_rank * (m.head_dim - m.qk_rope_head_dim + m.v_head_dim)
        else:  # q·k and the value sum, head_dim each
            self.decode_pair_flops = self.prefill_pair_flops = 4 * (m.q_size / tp)
            self.decompress_flops = 0.0
        self.head_params = m.vocab_size * m.hidden_size / tp
        width = m.expert_intermediate_size / tp  # one expert's GEMM width on one rank
        self._moe_width_efficiency = width / (width + curves.moe_width_half)
        moe = curves.moe
        if self.expert_bytes_per_param < 1:  # 4-bit experts: their own kernel, where the curves price it
            if curves.moe_quantized_flops_half:
                moe = type(moe)(type(moe.flops)(moe.flops.peak, curves.moe_quantized_flops_half), moe.bandwidth)
            if curves.moe_quantized_bandwidth:
                moe = moe.with_bandwidth_share(curves.moe_quantized_bandwidth)
        if tuned_expert_tiles and curves.moe_tuned_bandwidth:
            moe = moe.with_bandwidth_share(curves.moe_tuned_bandwidth)
        self._moe_curves = moe
        self.token_bytes = m.hidden_size * dtype_bytes
        # Exact-point cache of table lookups: steps repeat the same few shapes.
        self._cache: dict[tuple, float | None] = {}

    # -- sources ---------------------------------------------------------------------------
    def _lookup(self, op: str, *point: float) -> float | None:
        """The profile's seconds at `point`, or None where no table covers it."""
        key = (op, *point)
        if key in self._cache:
            value = self._cache[key]
        else:
            table = self.profile.table(op) if self.profile is not None else None
            value = table(*point) if table is not None and table.covers(*point) else None
            if len(self._cache) < 200_000:
                self._cache[key] = value
        self.sources[op][PROFILE if value is not None else CURVES] += 1
        return value

    def source_summary(self) -> dict[str, str]:
        """operator -> "profile", "curves" or "profile (n% curves)" over the lookups so far;
        operators never asked are left out."""
        out = {}
        for op, counts in self.sources.items():
            total = sum(counts.values())
            if not total:
                continue
            if counts[CURVES] == 0:
                out[op] = PROFILE
            elif counts[PROFILE] == 0:
                out[op] = CURVES
            else:
                out[op] = f"{PROFILE} ({counts[CURVES] / total:.0%} outside its grid: {CURVES})"
        return out

    # -- roofline with curves --------------------------------------------------------------
    def _roofline(self, curves: OperatorCurves, flops: float, size: float, bytes_read: float, launches: int,
                  overlap: float = 0.0):
        """max(FLOP time, byte time), or where `overlap` p > 0 the p-norm (t_f^p + t_b^p)^(1/p): a
        kernel whose weight loads and MMAs overlap only partly (p 1: they add up)."""
        peaks = self.peaks
        # One call (most of a simulation's) in plain floats: numpy's per-op cost on scalars is ~10%
        # of a simulation. Per-layer arrays elementwise.
        larger, smaller = (np.maximum, np.minimum) if isinstance(size, np.ndarray) else (max, min)
        t_flops = flops / (peaks.flops * curves.flops(larger(size, 1e-9)))
        t_bytes = bytes_read / (peaks.hbm_bytes_per_s * curves.bandwidth(larger(bytes_read, 1e-9)))
        seconds = larger(t_flops, t_bytes)
        if overlap:
            ratio = smaller(t_flops, t_bytes) / larger(seconds, 1e-30)
            seconds = seconds * (1 + ratio ** overlap) ** (1 / overlap)
        return seconds + launches * self.curves.launch_s

    # -- per layer -------------------------------------------------------------------------
    def dense(self, tokens: int, moe_layer: bool = True) -> float:
        """The attention side's GEMMs of one layer: an MoE layer's attention projections, router
        and shared experts, or (moe_layer False) a dense layer's projections and FFN. A profile's
        `dense` table measured the former; a dense layer is priced from the curves."""
        if tokens <= 0:
            return 0.0
        measured = self._lookup("dense", tokens) if moe_layer else None
        if measured is not None:
            return measured
        if not moe_layer:
            self.sources["dense"][CURVES] += 1
        params = self.attn_params if moe_layer else self.dense_layer_params
        return float(self._roofline(self.curves.gemm, 2 * params * tokens, tokens, params * self.dtype_bytes,
                                    LAUNCHES["dense"]))

    def attention_decode(self, seqs: int, context_tokens: float) -> float:
        """`seqs` decoding sequences reading `context_tokens` cached tokens between them."""
        if seqs <= 0:
            return 0.0
        measured = self._lookup("attention_decode", seqs, round(context_tokens / seqs))
        if measured is not None:
            return measured
        # The windowed layers of a model (gpt-oss) read at most their window of each sequence.
        context_tokens = seqs * self.model.attended_tokens(context_tokens / seqs)
        kv_bytes = context_tokens * self.kv_bytes_per_token
        # Decode attention streams the cache with a few query heads per KV head: its FLOP rate is
        # set by the context it streams, not by a prefill chunk's query tokens.
        return float(self._roofline(self.curves.attention, self.decode_pair_flops * context_tokens, context_tokens,
                                    kv_bytes, LAUNCHES["attention"]))

    def attention_prefill(self, tokens: int, cached: int) -> float:
        """One sequence's prompt chunk of `tokens` after `cached` tokens."""
        if tokens <= 0:
            return 0.0
        measured = self._lookup("attention_prefill", tokens, cached)
        if measured is not None:
            return measured
        pairs = chunk_score_pairs(tokens, cached)
        kv_bytes = self.model.attended_tokens(cached + tokens) * self.kv_bytes_per_token
        flops = self.prefill_pair_flops * pairs + self.decompress_flops * cached
        return float(self._roofline(self.curves.attention, flops, tokens, kv_bytes, LAUNCHES["attention"]))

    def moe(self, tokens: int, active_experts: np.ndarray | int) -> float:
        """The expert half summed over layers: one entry of `active_experts` per layer (or one
        count for a single layer), each layer's `tokens` tokens spread over its active experts."""
        if tokens <= 0:
            return 0.0
        pairs = tokens * self.model.top_k
        table = self.profile.table("moe") if self.profile is not None else None
        if table is None:  # every layer from the curves: one vectorised roofline
            experts = np.maximum(np.atleast_1d(active_experts), 1).astype(np.float64)
            self.sources["moe"][CURVES] += len(experts)
            return float(self._moe_roofline(pairs, experts).sum())
        counts, layers = np.unique(np.atleast_1d(active_experts), return_counts=True)
        total = 0.0
        for experts, n in zip(counts.tolist(), layers.tolist()):
            experts = max(1, experts)
            measured = self._lookup("moe", pairs / experts, experts)
            total += n * (measured if measured is not None else float(self._moe_roofline(pairs, experts)))
        return total

    def _moe_roofline(self, pairs: int, experts):
        # gate, up and down: expert_params counts all three; narrow experts run below the curve's rate
        flops = 2 * self.expert_params * pairs / self._moe_width_efficiency
        return self._roofline(self._moe_curves, flops, pairs / experts,
                              experts * self.expert_params * self.expert_bytes_per_param, LAUNCHES["moe"],
                              self.curves.moe_overlap)

    def allreduce(self, tokens: int) -> float:
        """One all-reduce of `tokens` hidden vectors over the instance's TP ranks (0 at tp 1)."""
        if self.tp == 1 or tokens <= 0:
            return 0.0
        size = tokens * self.token_bytes
        measured = self._lookup("allreduce", size)
        if measured is not None:
            return measured
        ring = 2 * (self.tp - 1) / self.tp * size
        return self.curves.allreduce_latency_s + ring / (self.peaks.link_bytes_per_s * self.curves.link)

    # -- per step --------------------------------------------------------------------------
    def lm_head(self, tokens: int) -> float:
        if tokens <= 0:
            return 0.0
        measured = self._lookup("lm_head", tokens)
        if measured is not None:
            return measured
        return float(self._roofline(self.curves.gemm, 2 * self.head_params * tokens, tokens,
                                    self.head_params * self.dtype_bytes, LAUNCHES["lm_head"]))

    def sampling(self, seqs: int) -> float:
        if seqs <= 0:
            return 0.0
        measured = self._lookup("sampling", seqs)
        if measured is not None:
            return measured
        logits_bytes = seqs * self.model.vocab_size * 4
        return LAUNCHES["sampling"] * self.curves.launch_s + logits_bytes / (
            self.peaks.hbm_bytes_per_s * self.curves.gemm.bandwidth(logits_bytes))

    def step_overhead(self, seqs: int) -> float:
        measured = self._lookup("step_overhead", max(seqs, 1))
        if measured is not None:
            return measured
        return self.curves.step_overhead_s + self.curves.step_overhead_per_seq_s * seqs
