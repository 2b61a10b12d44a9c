"""Torch references of the MoE kernels: fused gating (router logits to top-k, counts and the
send-order permutation) and the grouped SwiGLU expert GEMM over tokens sorted by expert, with
gpt-oss's variant of it (per-expert biases and a clamped SwiGLU, `ExpertActivation`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


# Width of a slot table (`fused_gating`'s expert_slots): a pair's replica is picked by its row
# modulo this, so shares are kept to 1/64. One width for every table: the gating kernel is
# compiled per width.
REPLICA_BUCKETS = 64


@dataclass
class Gating:
    topk_ids: torch.Tensor  # [T, k] int64 expert ids, most probable first (ties: lower id first)
    topk_weights: torch.Tensor  # [T, k] float32 routing weights
    expert_counts: torch.Tensor  # [E] int64 (token, choice) pairs per expert
    node_counts: torch.Tensor | None = None  # [N] int64 tokens each expert node receives (a token once per node)
    node_offsets: torch.Tensor | None = None  # [N + 1] int64
    # Tokens in send order, node after node: node n's are [node_offsets[n], node_offsets[n + 1]); the
    # Triton kernel sizes the tensor by a host-known bound, so entries past node_offsets[-1] are spare.
    node_token_ids: torch.Tensor | None = None
    # The pairs' layout by expert; a kernel fills it, the reference derives it when first asked.
    _pair_order: torch.Tensor | None = None
    _pair_positions: torch.Tensor | None = None
    # [T, k] int64 the replica slot each pair goes to, where a slot table was given (see
    # `fused_gating`); None: each expert is its own slot.
    _topk_slots: torch.Tensor | None = None

    @property
    def topk_slots(self) -> torch.Tensor:
        """[T, k] int64: the slot (a replica of the chosen expert) each pair is sent to."""
        return self.topk_ids if self._topk_slots is None else self._topk_slots

    @property
    def expert_offsets(self) -> torch.Tensor:
        """[E + 1] int64: expert e's pairs are pair_order[off[e]:off[e + 1]]."""
        off = torch.zeros(self.expert_counts.numel() + 1, dtype=torch.int64, device=self.expert_counts.device)
        off[1:] = torch.cumsum(self.expert_counts, 0)
        return off

    @property
    def pair_order(self) -> torch.Tensor:
        """[T * k] int64 pair ids (token * k + choice) grouped by expert."""
        if self._pair_order is None:
            self._pair_order = torch.sort(self.topk_ids.reshape(-1), stable=True).indices
        return self._pair_order

    @property
    def pair_positions(self) -> torch.Tensor:
        """[T * k] int64: where each pair sits in pair_order (the inverse permutation)."""
        if self._pair_positions is None:
            order = self.pair_order
            self._pair_positions = torch.empty_like(order)
            self._pair_positions[order] = torch.arange(order.numel(), device=order.device)
        return self._pair_positions


def fused_gating(logits: torch.Tensor, top_k: int, renormalize: bool, expert_node: torch.Tensor | None = None,
                 num_nodes: int = 0, valid: torch.Tensor | None = None,
                 expert_slots: torch.Tensor | None = None) -> Gating:
    """logits [T, E] -> softmax -> top-k (renormalised if asked) -> per-expert and per-node counts
    and the permutations that lay pairs out by expert and tokens out by destination node.
    `valid`: [1] int32 on the logits' device, the live rows; rows at or past it (a captured batch's
    padding) get ids and weights but are counted for no expert and sent to no node.
    `expert_slots`: [E, B] int32, where experts have replicas: token t's pair with expert e goes
    to slot expert_slots[e, t % B] (`topk_slots`), and `expert_node` maps slots, not experts, to
    nodes. A pure function of the row: every rank of a tensor-parallel node picks alike."""
    e = logits.shape[1]
    probs = F.softmax(logits.float(), dim=-1)
    values, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    weights, ids = values[:, :top_k], order[:, :top_k]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    live = None if valid is None else torch.arange(logits.shape[0], device=logits.device) < valid
    g = Gating(ids, weights, torch.bincount((ids if live is None else ids[live]).reshape(-1), minlength=e))
    if expert_slots is not None:
        buckets = torch.arange(ids.shape[0], device=ids.device) % expert_slots.shape[1]
        g._topk_slots = expert_slots[ids, buckets[:, None]].to(torch.int64)
    if expert_node is not None:
        hits = expert_node[g.topk_slots]  # [T, k] node of each choice
        sent = [(hits == n).any(dim=1) for n in range(num_nodes)]
        per_node = [(s if live is None else s & live).nonzero().flatten() for s in sent]
        g.node_counts = torch.tensor([len(x) for x in per_node], dtype=torch.int64, device=logits.device)
        g.node_offsets = torch.zeros(num_nodes + 1, dtype=torch.int64, device=logits.device)
        g.node_offsets[1:] = torch.cumsum(g.node_counts, 0)
        g.node_token_ids = torch.cat(per_node) if per_node else torch.empty(0, dtype=torch.int64)
    return g


@dataclass(frozen=True)
class ExpertActivation:
    """How an expert's gate and up projections combine into its hidden activation.

    alpha and limit both None: SwiGLU, silu(gate) * up (Mixtral, Qwen3, DBRX). Both set: the
    clamped form of gpt-oss (transformers' GptOssExperts; alpha 1.702, limit 7.0 there):
    gate = min(gate, limit), up = clamp(up, -limit, limit), (up + 1) * gate * sigmoid(alpha * gate).
    The clamp bounds what one expert's hidden state can reach, so it is part of the model, not
    an optimisation: leaving it out changes the outputs."""

    alpha: float | None = None
    limit: float | None = None

    def __post_init__(self):
        if (self.alpha is None) != (self.limit is None):
            raise ValueError(f"ExpertActivation: alpha ({self.alpha}) and limit ({self.limit}) are set together "
                             "(the clamped SwiGLU) or not at all (plain SwiGLU)")
        if self.limit is not None and not self.limit > 0:
            raise ValueError(f"ExpertActivation: limit must be > 0, got {self.limit}")

    @property
    def clamped(self) -> bool:
        return self.limit is not None

    def __str__(self) -> str:
        """One word (it sits in a `ShapeKey`'s space-separated shape)."""
        return f"clamped-swiglu(alpha={self.alpha:g},limit={self.limit:g})" if self.clamped else "swiglu"

    def apply(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """The hidden activation from the gate and up projections (bias already added), in their dtype."""
        if not self.clamped:
            return F.silu(gate) * up
        gate = gate.clamp(max=self.limit)
        up = up.clamp(-self.limit, self.limit)
        return (up + 1) * (gate * torch.sigmoid(self.alpha * gate))


SWIGLU = ExpertActivation()  # the default: silu(gate) * up


# Above this many rows per expert, padding every expert to the busiest one costs more (the
# padded buffers' traffic) than the per-expert GEMM calls it saves: on a 2-core CPU the
# padded path is 1.7x slower at 2,048 tokens over 8 experts, and on par at 1,024.
BATCHED_MAX_ROWS = 256


def grouped_expert_gemm(x: torch.Tensor, expert_offsets: list[int], w_gate_up: torch.Tensor, w_down: torch.Tensor,
                        row_weights: torch.Tensor, activation: ExpertActivation = SWIGLU,
                        gate_up_bias: torch.Tensor | None = None,
                        down_bias: torch.Tensor | None = None) -> torch.Tensor:
    """SwiGLU experts over rows grouped by expert: rows [off[e], off[e+1]) of x [P, H] go through
    expert e (w_gate_up [E, 2I, H], gate rows first; w_down [E, H, I]); each output row is
    scaled by its routing weight. -> [P, H] in x's dtype. Rows past the last offset (pairs of
    experts held elsewhere) are not computed; here they come out zero.

    `activation`: how gate and up combine (`ExpertActivation`; plain SwiGLU by default).
    `gate_up_bias` [E, 2I] (gate's then up's, as the weight rows) is added to the gate/up
    projection before the activation; `down_bias` [E, H] to the down projection before the
    routing weight scales the row (as transformers' GptOssExperts). Both in x's dtype, added as
    given: under tensor parallelism the caller passes down_bias on one rank only (the ranks'
    partial outputs are summed), the gate/up bias sliced like the weights' rows."""
    counts = [b - a for a, b in zip(expert_offsets, expert_offsets[1:])]
    total = expert_offsets[-1] if expert_offsets else 0
    variant = dict(activation=activation, gate_up_bias=gate_up_bias, down_bias=down_bias)
    if total < x.shape[0]:
        out = x.new_zeros(x.shape)
        if total:
            out[:total] = grouped_expert_gemm(x[:total], expert_offsets, w_gate_up, w_down, row_weights[:total],
                                              **variant)
        return out
    if not x.shape[0]:
        return torch.empty_like(x)
    active = sum(1 for c in counts if c)
    if 2 * active >= len(counts) and max(counts) <= BATCHED_MAX_ROWS:
        out = _batched(x, counts, w_gate_up, w_down, **variant)
    else:
        out = _per_expert(x, counts, w_gate_up, w_down, **variant)
    return (out * row_weights[:, None]).to(x.dtype)


def _per_expert(x: torch.Tensor, counts: list[int], w_gate_up, w_down, linear=F.linear,
                activation: ExpertActivation = SWIGLU, gate_up_bias: torch.Tensor | None = None,
                down_bias: torch.Tensor | None = None) -> torch.Tensor:
    """One GEMM pair per active expert: reads only the active experts' weights. `w_gate_up[e]`
    and `w_down[e]` are expert e's, in whatever form `linear(x, w, bias)` takes (moe_packed
    passes oneDNN-packed weights and its own linear); the biases are plain [E, n] tensors."""
    out = torch.empty_like(x)
    start = 0
    for e, count in enumerate(counts):
        if count == 0:
            continue
        end = start + count
        gate, up = linear(x[start:end], w_gate_up[e], None if gate_up_bias is None else gate_up_bias[e]).chunk(2, -1)
        out[start:end] = linear(activation.apply(gate, up), w_down[e], None if down_bias is None else down_bias[e])
        start = end
    return out


def _batched(x: torch.Tensor, counts: list[int], w_gate_up: torch.Tensor, w_down: torch.Tensor,
             activation: ExpertActivation = SWIGLU, gate_up_bias: torch.Tensor | None = None,
             down_bias: torch.Tensor | None = None) -> torch.Tensor:
    """Most experts active, each with few rows: two batched GEMMs over all of them, rows padded
    to the busiest expert, so per-call GEMM overhead is paid once, not per expert. Padding rows
    pick up the biases too, but are dropped by the final gather."""
    n = len(counts)
    counts_t = torch.tensor(counts, device=x.device)
    local = torch.repeat_interleave(torch.arange(n, device=x.device), counts_t)
    rank = torch.arange(x.shape[0], device=x.device) - (torch.cumsum(counts_t, 0) - counts_t)[local]
    padded = x.new_zeros(n, max(counts), x.shape[1])
    padded[local, rank] = x
    gate, up = _bmm(padded, w_gate_up, gate_up_bias).chunk(2, dim=-1)
    return _bmm(activation.apply(gate, up), w_down, down_bias)[local, rank]


def _bmm(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [E, M, K] @ w[e]^T per expert, + bias [E, N] in the same call (one rounding, as F.linear)."""
    if bias is None:
        return torch.bmm(x, w.transpose(1, 2))
    return torch.baddbmm(bias[:, None, :], x, w.transpose(1, 2))
