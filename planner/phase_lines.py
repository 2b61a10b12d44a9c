"""The plan search's phase times as lines in the batch, from the operator model.

The search evaluates hundreds of thousands of configurations as numpy arrays and
binary-searches batch sizes, so it prices a phase as the largest of a few straight lines in
its batch (MegaScale-Infer's T_a = k1·b_a + k2 shape). This module draws those lines through
the operator model the simulator uses (`operator_costs`: a profile where one covers the
device, efficiency curves elsewhere), so `plan` and `simulate` predict from the same numbers:

- attention node, per MoE layer and micro-batch of b_a decoding tokens at the plan's mean
  context: dense (attention projections, router, shared experts) + attention_decode + the TP
  all-reduce;
- attention node, per dense layer (DeepSeek's first `first_k_dense`, whose FFN runs there with
  no exchange) and micro-batch: dense (attention projections, FFN) + attention_decode + the
  TP all-reduces of the attention and of the FFN;
- expert node, per layer and micro-batch, each of its e experts receiving b_e tokens: moe +
  the TP all-reduce;
- per iteration on an attention node with s sequences: step overhead, LM head and sampling.

Each is measured on a geometric grid of batches and becomes the largest of the secants between
neighbouring grid points. The phase times are convex in the batch (a fixed cost, weights read
once, until per-token work takes over), so the largest secant equals them at the grid points
and lies slightly above between them. The lines' sources are counted like any lookup, for
`plan --explain`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megainfer.config import ModelConfig
from planner.catalog import GPU
from planner.efficiency_curves import EfficiencyCurves
from planner.operator_costs import DevicePeaks, OperatorCosts
from planner.operator_profile import OperatorProfile

Line = tuple[float, float]  # (seconds per unit of batch, seconds)

# Batches the lines pass through (tokens per micro-batch on a node, tokens per expert,
# sequences per node): neighbouring pairs of a geometric grid.
GRID = (1, 4, 16, 64, 256, 1024, 4096)
ATTENTION_POINTS = EXPERT_POINTS = STEP_POINTS = tuple(zip(GRID, GRID[1:]))


def _line(f, a: float, b: float) -> Line:
    fa, fb = f(a), f(b)
    slope = max((fb - fa) / (b - a), 0.0)
    return slope, max(fa - slope * a, 0.0)


def _lines(f, points) -> list[Line]:
    return [_line(f, a, b) for a, b in points]


@dataclass
class PhaseLines:
    """The operator model of every (GPU, tp) the search tries, and the lines drawn from it."""

    model: ModelConfig
    seq_len: int
    dtype_bytes: int = 2
    curves_path: str | None = None
    profiles: list[OperatorProfile] = field(default_factory=list)
    _costs: dict[tuple[str, int], OperatorCosts] = field(default_factory=dict)
    _curves: dict[str, EfficiencyCurves] = field(default_factory=dict)  # by GPU: the file read once each

    def __post_init__(self) -> None:
        for profile in self.profiles:  # a profile of another model is a mistake worth stopping on
            profile.check_applies(self.model, profile.tp)

    def costs(self, gpu: GPU, tp: int) -> OperatorCosts:
        key = (gpu.name, tp)
        if key not in self._costs:
            profile = next((p for p in self.profiles if p.device.catalog_name == gpu.name and p.tp == tp), None)
            self._costs[key] = OperatorCosts(self.model, tp, DevicePeaks.of(gpu), self.curves(gpu),
                                             dtype_bytes=self.dtype_bytes, profile=profile)
        return self._costs[key]

    def attention(self, gpu: GPU, tp: int) -> list[Line]:
        ops = self.costs(gpu, tp)

        def t_a(b: float) -> float:
            tokens = max(1, round(b))
            return ops.dense(tokens) + ops.attention_decode(tokens, tokens * self.seq_len) + ops.allreduce(tokens)

        return _lines(t_a, ATTENTION_POINTS)

    def dense_layers(self, gpu: GPU, tp: int) -> list[Line]:
        """One dense layer on the attention node, as lines in b_a (no lines: the model has none)."""
        if not self.model.first_k_dense:
            return []
        ops = self.costs(gpu, tp)

        def t_d(b: float) -> float:
            tokens = max(1, round(b))
            return ops.dense(tokens, moe_layer=False) + ops.attention_decode(tokens, tokens * self.seq_len) + \
                2 * ops.allreduce(tokens)

        return _lines(t_d, ATTENTION_POINTS)

    def experts(self, gpu: GPU, tp: int, experts_per_node: int) -> list[Line]:
        ops = self.costs(gpu, tp)
        top_k = self.model.top_k

        def t_e(b_e: float) -> float:
            tokens = max(1, round(b_e * experts_per_node / top_k))  # tokens whose pairs land here
            return ops.moe(tokens, experts_per_node) + ops.allreduce(tokens)

        return _lines(t_e, EXPERT_POINTS)

    def per_step(self, gpu: GPU, tp: int) -> list[Line]:
        ops = self.costs(gpu, tp)

        def t_step(seqs: float) -> float:
            n = max(1, round(seqs))
            return ops.step_overhead(n) + ops.lm_head(n) + ops.sampling(n)

        return _lines(t_step, STEP_POINTS)

    def sources(self, gpu: str, tp: int) -> dict[str, str]:
        costs = self._costs.get((gpu, tp))
        return costs.source_summary() if costs is not None else {}

    def curves(self, gpu: GPU) -> EfficiencyCurves:
        if gpu.name not in self._curves:
            self._curves[gpu.name] = EfficiencyCurves.load(gpu.name, self.curves_path)
        return self._curves[gpu.name]
