"""Triton MoE kernels: fused gating and the grouped SwiGLU expert GEMM (signatures as in
`moe_ref`).

Gating is two launches around a prefix sum: the first computes, per token, softmax, top-k
(ties to the lower expert id, as the reference), the renormalised weights, and adds to the
per-expert and per-node counts; a device cumsum turns counts into offsets (nothing is read
back to the host); the second scatters
each (token, choice) pair to its expert's segment and each token to every destination
node it hits (MegaScale-Infer §6's fused gating and dispatch layout). Within a segment the
order is the atomics' order: on a GPU it varies run to run, and `pair_positions` is the
inverse that combining uses.

The grouped GEMM cuts each expert's rows into BLOCK_M-row tiles; every program finds its
expert and rows from the offsets itself (a prefix sum over the experts' tile counts), so no
work table is built per layer and device-side offsets need no trip to the host: the grid is
then a bound known on the host, and programs past the last tile return at once. Tile sizes
come from `kernels.tiles` by the mean rows per expert.

gpt-oss's experts (per-expert biases, a clamped SwiGLU: `moe_ref.ExpertActivation`) are the
same kernels with constexpr flags: HAS_BIAS adds the bias in float32 to the accumulator, before
the activation (gate/up) or the routing weight (down), CLAMPED clamps the gate and up
projections with `alpha` and `limit` as runtime floats (one compiled variant whatever the
model's constants). The flags off compile exactly the plain kernels.
Widths need not be powers of two (gpt-oss's hidden and intermediate are 2880): every load and
store is masked at H and I, so a partial last column or reduction tile reads zeros.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.launch import interpreted
from kernels.launch import check_expert_biases, check_experts, device_ints
from kernels.moe_ref import SWIGLU, ExpertActivation, Gating
from kernels.tiles import gemm_tiles, pow2

INTERPRETED = interpreted()


@triton.jit
def _gating_kernel(logits_ptr, ids_ptr, weights_ptr, expert_counts_ptr, expert_node_ptr, node_counts_ptr, valid_ptr,
                   slot_table_ptr, slots_ptr, E: tl.constexpr, K: tl.constexpr, RENORMALIZE: tl.constexpr,
                   NUM_NODES: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, HAS_VALID: tl.constexpr,
                   BUCKETS: tl.constexpr):
    t = tl.program_id(0)
    limit = t + 1
    if HAS_VALID:  # rows at or past the live count (a captured batch's padding) are counted nowhere
        limit = tl.load(valid_ptr)
    e = tl.arange(0, BLOCK_E)
    x = tl.load(logits_ptr + t * E + e, mask=e < E, other=float("-inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, axis=0))
    p = p / tl.sum(p, axis=0)
    kk = tl.arange(0, BLOCK_K)
    ids = tl.zeros([BLOCK_K], tl.int32)
    vals = tl.zeros([BLOCK_K], tl.float32)
    remaining = tl.where(e < E, p, -1.0)
    for j in tl.static_range(K):
        best = tl.max(remaining, axis=0)
        idx = tl.min(tl.where(remaining == best, e, BLOCK_E), axis=0)  # ties: the lower id
        ids = tl.where(kk == j, idx, ids)
        vals = tl.where(kk == j, best, vals)
        remaining = tl.where(e == idx, -1.0, remaining)
    if RENORMALIZE:
        vals = vals / tl.sum(tl.where(kk < K, vals, 0.0), axis=0)
    tl.store(ids_ptr + t * K + kk, ids.to(tl.int64), mask=kk < K)
    tl.store(weights_ptr + t * K + kk, vals, mask=kk < K)
    tl.atomic_add(expert_counts_ptr + ids, 1, mask=(kk < K) & (kk * 0 + t < limit))  # a block mask
    slots = ids
    if BUCKETS > 0:  # replicas: the pair's slot by the row's bucket (moe_ref.fused_gating)
        slots = tl.load(slot_table_ptr + ids * BUCKETS + t % BUCKETS, mask=kk < K, other=0)
        tl.store(slots_ptr + t * K + kk, slots.to(tl.int64), mask=kk < K)
    if NUM_NODES > 0:
        nodes = tl.load(expert_node_ptr + slots, mask=kk < K, other=-1)
        for n in tl.static_range(NUM_NODES):
            hit = (tl.sum((nodes == n).to(tl.int32), axis=0) > 0) & (t < limit)
            tl.atomic_add(node_counts_ptr + n, hit.to(tl.int32))


@triton.jit
def _scatter_kernel(ids_ptr, expert_offsets_ptr, expert_cursor_ptr, pair_order_ptr, pair_positions_ptr,
                    expert_node_ptr, node_offsets_ptr, node_cursor_ptr, node_tokens_ptr, valid_ptr, slots_ptr,
                    K: tl.constexpr, NUM_NODES: tl.constexpr, BLOCK_K: tl.constexpr, HAS_VALID: tl.constexpr):
    t = tl.program_id(0)
    limit = t + 1
    if HAS_VALID:  # padding rows take no place in any segment (their pair positions stay unset)
        limit = tl.load(valid_ptr)
    if t < limit:
        kk = tl.arange(0, BLOCK_K)
        ids = tl.load(ids_ptr + t * K + kk, mask=kk < K, other=0)
        for j in tl.static_range(K):
            e = tl.sum(tl.where(kk == j, ids, 0), axis=0)
            pos = tl.load(expert_offsets_ptr + e) + tl.atomic_add(expert_cursor_ptr + e, 1)
            tl.store(pair_order_ptr + pos, t * K + j)
            tl.store(pair_positions_ptr + t * K + j, pos)
        if NUM_NODES > 0:
            slots = tl.load(slots_ptr + t * K + kk, mask=kk < K, other=0)  # the ids, without replicas
            nodes = tl.load(expert_node_ptr + slots, mask=kk < K, other=-1)
            for n in tl.static_range(NUM_NODES):
                if tl.sum((nodes == n).to(tl.int32), axis=0) > 0:
                    pos = tl.load(node_offsets_ptr + n) + tl.atomic_add(node_cursor_ptr + n, 1)
                    tl.store(node_tokens_ptr + pos, t)


def fused_gating(logits: torch.Tensor, top_k: int, renormalize: bool, expert_node: torch.Tensor | None = None,
                 num_nodes: int = 0, valid: torch.Tensor | None = None,
                 expert_slots: torch.Tensor | None = None) -> Gating:
    t, e = logits.shape
    dev = logits.device
    block_e, block_k = triton.next_power_of_2(e), triton.next_power_of_2(top_k)
    ids = torch.empty(t, top_k, dtype=torch.int64, device=dev)
    weights = torch.empty(t, top_k, dtype=torch.float32, device=dev)
    expert_counts = torch.zeros(e, dtype=torch.int32, device=dev)
    nodes = num_nodes if expert_node is not None else 0
    node_of = expert_node.to(torch.int32) if nodes else torch.zeros(1, dtype=torch.int32, device=dev)
    node_counts = torch.zeros(max(nodes, 1), dtype=torch.int32, device=dev)
    buckets = 0 if expert_slots is None else expert_slots.shape[1]
    slot_table = node_of if expert_slots is None else expert_slots.to(torch.int32).contiguous()
    slots = ids if expert_slots is None else torch.empty_like(ids)
    if t:
        _gating_kernel[(t,)](logits.contiguous(), ids, weights, expert_counts, node_of, node_counts,
                             node_of if valid is None else valid, slot_table, slots, E=e, K=top_k,
                             RENORMALIZE=renormalize, NUM_NODES=nodes, BLOCK_E=block_e, BLOCK_K=block_k,
                             HAS_VALID=valid is not None, BUCKETS=buckets)
    expert_offsets = torch.zeros(e + 1, dtype=torch.int64, device=dev)
    expert_offsets[1:] = torch.cumsum(expert_counts, 0)
    node_offsets = torch.zeros(nodes + 1, dtype=torch.int64, device=dev)
    node_offsets[1:] = torch.cumsum(node_counts[:nodes], 0)
    pair_order = torch.empty(t * top_k, dtype=torch.int64, device=dev)
    pair_positions = torch.empty_like(pair_order)
    # Sized by a bound known on the host (a token goes to at most min(k, nodes) nodes), not by
    # node_offsets[-1], which would read the device back (a synchronisation per layer).
    node_tokens = torch.empty(max(1, t * min(top_k, nodes)), dtype=torch.int64, device=dev)
    if t:
        _scatter_kernel[(t,)](ids, expert_offsets, torch.zeros(e, dtype=torch.int32, device=dev), pair_order,
                              pair_positions, node_of, node_offsets, torch.zeros(max(nodes, 1), dtype=torch.int32,
                                                                                  device=dev),
                              node_tokens, node_of if valid is None else valid, slots, K=top_k, NUM_NODES=nodes,
                              BLOCK_K=block_k, HAS_VALID=valid is not None)
    g = Gating(ids, weights, expert_counts.to(torch.int64), _pair_order=pair_order, _pair_positions=pair_positions,
               _topk_slots=None if expert_slots is None else slots)
    if nodes:
        g.node_counts, g.node_offsets, g.node_token_ids = node_counts.to(torch.int64), node_offsets, node_tokens
    return g


@triton.jit
def _expert_tile(offsets_ptr, tile, NUM_EXPERTS: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr):
    """Tile `tile` of the experts' row segments laid end to end, each cut into BLOCK_M-row tiles:
    (its expert, NUM_EXPERTS or more past the last tile; its first row; the expert's row end)."""
    e = tl.arange(0, BLOCK_E)
    lo = tl.load(offsets_ptr + e, mask=e < NUM_EXPERTS, other=0)
    hi = tl.load(offsets_ptr + e + 1, mask=e < NUM_EXPERTS, other=0)
    tiles = (hi - lo + BLOCK_M - 1) // BLOCK_M
    ends = tl.cumsum(tiles, axis=0)
    expert = tl.sum((ends <= tile).to(tl.int32), axis=0)  # experts whose tiles all come before this one
    mine = e == expert
    first_row = tl.sum(tl.where(mine, lo + (tile - ends + tiles) * BLOCK_M, 0), axis=0)
    return expert, first_row, tl.sum(tl.where(mine, hi, 0), axis=0)


@triton.jit
def _gate_up_tile(x_ptr, w_ptr, h_ptr, bias_ptr, alpha, limit, e, rows, row_end, cols, H: tl.constexpr,
                  I: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  IEEE: tl.constexpr, HAS_BIAS: tl.constexpr, CLAMPED: tl.constexpr):
    """h[rows, cols] = act(x @ W_gate^T + b_gate, x @ W_up^T + b_up) for one expert's row tile:
    act(g, u) = silu(g) * u, or with CLAMPED gpt-oss's (clamp(u, -limit, limit) + 1) *
    g' * sigmoid(alpha * g'), g' = min(g, limit)."""
    k = tl.arange(0, BLOCK_K)
    gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    w_base = w_ptr + e * (2 * I * H)
    row_mask = rows[:, None] < row_end
    for k0 in range(0, H, BLOCK_K):
        kmask = k0 + k < H
        x = tl.load(x_ptr + rows[:, None] * H + k0 + k[None, :], mask=row_mask & kmask[None, :], other=0.0)
        w_mask = (cols[None, :] < I) & kmask[:, None]
        wg = tl.load(w_base + cols[None, :] * H + k0 + k[:, None], mask=w_mask, other=0.0)
        wu = tl.load(w_base + (I + cols[None, :]) * H + k0 + k[:, None], mask=w_mask, other=0.0)
        if IEEE:  # float32 in, exact products; also the interpreter's way through half precision
            x, wg, wu = x.to(tl.float32), wg.to(tl.float32), wu.to(tl.float32)
            gate += tl.dot(x, wg, input_precision="ieee")
            up += tl.dot(x, wu, input_precision="ieee")
        else:
            gate += tl.dot(x, wg)
            up += tl.dot(x, wu)
    if HAS_BIAS:  # [E, 2I]: the gate's I, then the up's
        col_mask = cols < I
        gate += tl.load(bias_ptr + e * (2 * I) + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        up += tl.load(bias_ptr + e * (2 * I) + I + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    if CLAMPED:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        h = (up + 1.0) * (gate / (1.0 + tl.exp(-alpha * gate)))
    else:
        h = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(h_ptr + rows[:, None] * I + cols[None, :], h.to(h_ptr.dtype.element_ty),
             mask=row_mask & (cols[None, :] < I))


@triton.jit
def _down_tile(h_ptr, w_ptr, out_ptr, row_weight_ptr, bias_ptr, e, rows, row_end, cols, H: tl.constexpr,
               I: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               IEEE: tl.constexpr, HAS_BIAS: tl.constexpr):
    """out[rows, cols] = routing weight * (h @ W_down^T + b_down) for one expert's row tile (the
    bias scaled with the row, as transformers' GptOssExperts)."""
    k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    w_base = w_ptr + e * (H * I)
    row_mask = rows[:, None] < row_end
    for k0 in range(0, I, BLOCK_K):
        kmask = k0 + k < I
        h = tl.load(h_ptr + rows[:, None] * I + k0 + k[None, :], mask=row_mask & kmask[None, :], other=0.0)
        w = tl.load(w_base + cols[None, :] * I + k0 + k[:, None], mask=(cols[None, :] < H) & kmask[:, None],
                    other=0.0)
        if IEEE:
            acc += tl.dot(h.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(h, w)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + e * H + cols, mask=cols < H, other=0.0).to(tl.float32)[None, :]
    acc = acc * tl.load(row_weight_ptr + rows, mask=rows < row_end, other=0.0)[:, None]
    tl.store(out_ptr + rows[:, None] * H + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_mask & (cols[None, :] < H))


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, h_ptr, offsets_ptr, bias_ptr, alpha, limit, H: tl.constexpr, I: tl.constexpr,
                    NUM_EXPERTS: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, IEEE: tl.constexpr, HAS_BIAS: tl.constexpr, CLAMPED: tl.constexpr):
    """Grid (row tile, column tile); row tiles past the experts' last do nothing. bias_ptr is
    read only with HAS_BIAS, alpha and limit only with CLAMPED."""
    e, first_row, row_end = _expert_tile(offsets_ptr, tl.program_id(0), NUM_EXPERTS, BLOCK_E, BLOCK_M)
    if e < NUM_EXPERTS:
        rows = (first_row + tl.arange(0, BLOCK_M)).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        _gate_up_tile(x_ptr, w_ptr, h_ptr, bias_ptr, alpha, limit, e.to(tl.int64), rows, row_end, cols, H, I,
                      BLOCK_M, BLOCK_N, BLOCK_K, IEEE, HAS_BIAS, CLAMPED)


@triton.jit
def _down_kernel(h_ptr, w_ptr, out_ptr, row_weight_ptr, offsets_ptr, bias_ptr, H: tl.constexpr, I: tl.constexpr,
                 NUM_EXPERTS: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, IEEE: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Grid (row tile, column tile); row tiles past the experts' last do nothing. bias_ptr is
    read only with HAS_BIAS."""
    e, first_row, row_end = _expert_tile(offsets_ptr, tl.program_id(0), NUM_EXPERTS, BLOCK_E, BLOCK_M)
    if e < NUM_EXPERTS:
        rows = (first_row + tl.arange(0, BLOCK_M)).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        _down_tile(h_ptr, w_ptr, out_ptr, row_weight_ptr, bias_ptr, e.to(tl.int64), rows, row_end, cols, H, I,
                   BLOCK_M, BLOCK_N, BLOCK_K, IEEE, HAS_BIAS)


def _row_tiles(expert_offsets: list[int] | torch.Tensor, pairs: int, experts: int, block_m: int) -> int:
    """Row tiles to launch: exact from host offsets, else a bound (each expert wastes at most one
    partial tile) that needs nothing from the device."""
    if isinstance(expert_offsets, torch.Tensor):
        return triton.cdiv(pairs, block_m) + min(experts, pairs)
    return sum(triton.cdiv(b - a, block_m) for a, b in zip(expert_offsets, expert_offsets[1:]))


def _device_offsets(expert_offsets: list[int] | torch.Tensor, experts: int, device: torch.device) -> torch.Tensor:
    count = expert_offsets.numel() if isinstance(expert_offsets, torch.Tensor) else len(expert_offsets)
    if count != experts + 1:
        raise ValueError(f"expert_offsets: want {experts + 1} offsets (one per expert, then the end), got {count}")
    if isinstance(expert_offsets, torch.Tensor):
        return expert_offsets.to(device=device, dtype=torch.int32)
    return device_ints(expert_offsets, device)


def grouped_expert_gemm(x: torch.Tensor, expert_offsets: list[int] | torch.Tensor, w_gate_up: torch.Tensor,
                        w_down: torch.Tensor, row_weights: torch.Tensor, activation: ExpertActivation = SWIGLU,
                        gate_up_bias: torch.Tensor | None = None,
                        down_bias: torch.Tensor | None = None) -> torch.Tensor:
    """SwiGLU experts over rows grouped by expert (as `moe_ref.grouped_expert_gemm`, with its
    activation and biases); the offsets may also be a device tensor [E + 1] (then nothing is read
    back to the host). Rows past the last offset are not written (the caller masks them)."""
    check_experts(x, w_gate_up, w_down, row_weights)
    p, h_dim = x.shape
    experts, i_dim = w_down.shape[0], w_down.shape[2]
    check_expert_biases(x.dtype, experts, 2 * i_dim, h_dim, gate_up_bias, down_bias)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)  # contiguous whatever x's strides
    offsets = _device_offsets(expert_offsets, experts, x.device)
    tiles = gemm_tiles(p / experts, x.dtype, INTERPRETED)
    row_tiles = _row_tiles(expert_offsets, p, experts, tiles.block_m)
    if not p or not row_tiles:
        return out
    hidden = torch.empty(p, i_dim, dtype=x.dtype, device=x.device)
    common = dict(H=h_dim, I=i_dim, NUM_EXPERTS=experts, BLOCK_E=pow2(experts), BLOCK_M=tiles.block_m,
                  BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, IEEE=x.dtype == torch.float32 or INTERPRETED,
                  num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    # An absent bias's pointer is never read (HAS_BIAS=False): any tensor of the device will do.
    _gate_up_kernel[(row_tiles, triton.cdiv(i_dim, tiles.block_n))](
        x.contiguous(), w_gate_up, hidden, offsets, w_gate_up if gate_up_bias is None else gate_up_bias,
        float(activation.alpha or 0.0), float(activation.limit or 0.0), HAS_BIAS=gate_up_bias is not None,
        CLAMPED=activation.clamped, **common)
    _down_kernel[(row_tiles, triton.cdiv(h_dim, tiles.block_n))](
        hidden, w_down, out, row_weights.float().contiguous(), offsets, w_down if down_bias is None else down_bias,
        HAS_BIAS=down_bias is not None, **common)
    return out
