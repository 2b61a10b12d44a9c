"""Triton MoE kernels: fused gating and the grouped SwiGLU expert GEMM (signatures as in
`moe_ref`).

Gating is two launches around a prefix sum: the first computes, per token, softmax, top-k
(ties to the lower expert id, as the reference), the renormalised weights, and adds to the
per-expert and per-node counts; the host turns counts into offsets; the second scatters
each (token, choice) pair to its expert's segment and each token to every destination
node it hits (MegaScale-Infer §6's fused gating and dispatch layout). Within a segment the
order is the atomics' order: on a GPU it varies run to run, and `pair_positions` is the
inverse that combining uses.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.dispatch import interpreted
from kernels.moe_ref import Gating

INTERPRETED = interpreted()


@triton.jit
def _gating_kernel(logits_ptr, ids_ptr, weights_ptr, expert_counts_ptr, expert_node_ptr, node_counts_ptr,
                   E: tl.constexpr, K: tl.constexpr, RENORMALIZE: tl.constexpr, NUM_NODES: tl.constexpr,
                   BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    t = tl.program_id(0)
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
    tl.atomic_add(expert_counts_ptr + ids, 1, mask=kk < K)
    if NUM_NODES > 0:
        nodes = tl.load(expert_node_ptr + ids, mask=kk < K, other=-1)
        for n in tl.static_range(NUM_NODES):
            hit = tl.sum((nodes == n).to(tl.int32), axis=0) > 0
            tl.atomic_add(node_counts_ptr + n, hit.to(tl.int32))


@triton.jit
def _scatter_kernel(ids_ptr, expert_offsets_ptr, expert_cursor_ptr, pair_order_ptr, pair_positions_ptr,
                    expert_node_ptr, node_offsets_ptr, node_cursor_ptr, node_tokens_ptr,
                    K: tl.constexpr, NUM_NODES: tl.constexpr, BLOCK_K: tl.constexpr):
    t = tl.program_id(0)
    kk = tl.arange(0, BLOCK_K)
    ids = tl.load(ids_ptr + t * K + kk, mask=kk < K, other=0)
    for j in tl.static_range(K):
        e = tl.sum(tl.where(kk == j, ids, 0), axis=0)
        pos = tl.load(expert_offsets_ptr + e) + tl.atomic_add(expert_cursor_ptr + e, 1)
        tl.store(pair_order_ptr + pos, t * K + j)
        tl.store(pair_positions_ptr + t * K + j, pos)
    if NUM_NODES > 0:
        nodes = tl.load(expert_node_ptr + ids, mask=kk < K, other=-1)
        for n in tl.static_range(NUM_NODES):
            if tl.sum((nodes == n).to(tl.int32), axis=0) > 0:
                pos = tl.load(node_offsets_ptr + n) + tl.atomic_add(node_cursor_ptr + n, 1)
                tl.store(node_tokens_ptr + pos, t)


def fused_gating(logits: torch.Tensor, top_k: int, renormalize: bool, expert_node: torch.Tensor | None = None,
                 num_nodes: int = 0) -> Gating:
    t, e = logits.shape
    dev = logits.device
    block_e, block_k = triton.next_power_of_2(e), triton.next_power_of_2(top_k)
    ids = torch.empty(t, top_k, dtype=torch.int64, device=dev)
    weights = torch.empty(t, top_k, dtype=torch.float32, device=dev)
    expert_counts = torch.zeros(e, dtype=torch.int32, device=dev)
    nodes = num_nodes if expert_node is not None else 0
    node_of = expert_node.to(torch.int32) if nodes else torch.zeros(1, dtype=torch.int32, device=dev)
    node_counts = torch.zeros(max(nodes, 1), dtype=torch.int32, device=dev)
    if t:
        _gating_kernel[(t,)](logits.contiguous(), ids, weights, expert_counts, node_of, node_counts, E=e, K=top_k,
                             RENORMALIZE=renormalize, NUM_NODES=nodes, BLOCK_E=block_e, BLOCK_K=block_k)
    expert_offsets = torch.zeros(e + 1, dtype=torch.int64, device=dev)
    expert_offsets[1:] = torch.cumsum(expert_counts, 0)
    node_offsets = torch.zeros(nodes + 1, dtype=torch.int64, device=dev)
    node_offsets[1:] = torch.cumsum(node_counts[:nodes], 0)
    pair_order = torch.empty(t * top_k, dtype=torch.int64, device=dev)
    pair_positions = torch.empty_like(pair_order)
    node_tokens = torch.empty(int(node_offsets[-1]) if nodes else 1, dtype=torch.int64, device=dev)
    if t:
        _scatter_kernel[(t,)](ids, expert_offsets, torch.zeros(e, dtype=torch.int32, device=dev), pair_order,
                              pair_positions, node_of, node_offsets, torch.zeros(max(nodes, 1), dtype=torch.int32,
                                                                                  device=dev),
                              node_tokens, K=top_k, NUM_NODES=nodes, BLOCK_K=block_k)
    g = Gating(ids, weights, expert_counts.to(torch.int64), _pair_order=pair_order, _pair_positions=pair_positions)
    if nodes:
        g.node_counts, g.node_offsets, g.node_token_ids = node_counts.to(torch.int64), node_offsets, node_tokens
    return g


@triton.jit
def _expert_tile(tile_expert_ptr, tile_row_ptr, offsets_ptr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's expert, its rows (one tile of the expert's segment, ending at row_end) and
    its output columns."""
    tile = tl.program_id(0)
    e = tl.load(tile_expert_ptr + tile).to(tl.int64)
    rows = tl.load(tile_row_ptr + tile) + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    return e, rows, tl.load(offsets_ptr + e + 1), cols


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, h_ptr, tile_expert_ptr, tile_row_ptr, offsets_ptr, H: tl.constexpr,
                    I: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    IEEE: tl.constexpr):
    """h[rows, cols] = silu(x @ W_gate^T) * (x @ W_up^T) for one expert's row tile."""
    e, rows, row_end, cols = _expert_tile(tile_expert_ptr, tile_row_ptr, offsets_ptr, BLOCK_M, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    w_base = w_ptr + e * (2 * I * H)
    for k0 in range(0, H, BLOCK_K):
        kmask = k0 + k < H
        x = tl.load(x_ptr + rows[:, None] * H + k0 + k[None, :], mask=(rows[:, None] < row_end) & kmask[None, :],
                    other=0.0)
        wg = tl.load(w_base + cols[None, :] * H + k0 + k[:, None], mask=(cols[None, :] < I) & kmask[:, None],
                     other=0.0)
        wu = tl.load(w_base + (I + cols[None, :]) * H + k0 + k[:, None], mask=(cols[None, :] < I) & kmask[:, None],
                     other=0.0)
        if IEEE:
            x, wg, wu = x.to(tl.float32), wg.to(tl.float32), wu.to(tl.float32)
            gate += tl.dot(x, wg, input_precision="ieee")
            up += tl.dot(x, wu, input_precision="ieee")
        else:
            gate += tl.dot(x, wg)
            up += tl.dot(x, wu)
    h = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(h_ptr + rows[:, None] * I + cols[None, :], h.to(h_ptr.dtype.element_ty),
             mask=(rows[:, None] < row_end) & (cols[None, :] < I))


@triton.jit
def _down_kernel(h_ptr, w_ptr, out_ptr, row_weight_ptr, tile_expert_ptr, tile_row_ptr, offsets_ptr, H: tl.constexpr,
                 I: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 IEEE: tl.constexpr):
    """out[rows, cols] = routing weight * (h @ W_down^T) for one expert's row tile."""
    e, rows, row_end, cols = _expert_tile(tile_expert_ptr, tile_row_ptr, offsets_ptr, BLOCK_M, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    w_base = w_ptr + e * (H * I)
    for k0 in range(0, I, BLOCK_K):
        kmask = k0 + k < I
        h = tl.load(h_ptr + rows[:, None] * I + k0 + k[None, :], mask=(rows[:, None] < row_end) & kmask[None, :],
                    other=0.0)
        w = tl.load(w_base + cols[None, :] * I + k0 + k[:, None], mask=(cols[None, :] < H) & kmask[:, None],
                    other=0.0)
        if IEEE:
            h, w = h.to(tl.float32), w.to(tl.float32)
            acc += tl.dot(h, w, input_precision="ieee")
        else:
            acc += tl.dot(h, w)
    scale = tl.load(row_weight_ptr + rows, mask=rows < row_end, other=0.0)
    acc = acc * scale[:, None]
    tl.store(out_ptr + rows[:, None] * H + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(rows[:, None] < row_end) & (cols[None, :] < H))


GEMM_BLOCK_M = 16
GEMM_BLOCK_N = 32
GEMM_BLOCK_K = 32


def grouped_expert_gemm(x: torch.Tensor, expert_offsets: list[int], w_gate_up: torch.Tensor, w_down: torch.Tensor,
                        row_weights: torch.Tensor) -> torch.Tensor:
    p, h_dim = x.shape
    i_dim = w_down.shape[2]
    out = torch.empty_like(x)
    experts, rows = [], []
    for e, (a, b) in enumerate(zip(expert_offsets, expert_offsets[1:])):
        for r in range(a, b, GEMM_BLOCK_M):
            experts.append(e)
            rows.append(r)
    if not experts:
        return out
    dev = x.device
    tile_expert = torch.tensor(experts, dtype=torch.int32, device=dev)
    tile_row = torch.tensor(rows, dtype=torch.int32, device=dev)
    offsets = torch.tensor(expert_offsets, dtype=torch.int32, device=dev)
    hidden = torch.empty(p, i_dim, dtype=x.dtype, device=dev)
    # Exact float32 tiles for float32 inputs, and in the interpreter, whose dot has no
    # half-precision path (GPUs take bf16/fp16 tiles on tensor cores).
    ieee = x.dtype == torch.float32 or INTERPRETED
    _gate_up_kernel[(len(experts), triton.cdiv(i_dim, GEMM_BLOCK_N))](
        x.contiguous(), w_gate_up, hidden, tile_expert, tile_row, offsets, H=h_dim, I=i_dim, BLOCK_M=GEMM_BLOCK_M,
        BLOCK_N=GEMM_BLOCK_N, BLOCK_K=GEMM_BLOCK_K, IEEE=ieee)
    _down_kernel[(len(experts), triton.cdiv(h_dim, GEMM_BLOCK_N))](
        hidden, w_down, out, row_weights.float().contiguous(), tile_expert, tile_row, offsets, H=h_dim, I=i_dim,
        BLOCK_M=GEMM_BLOCK_M, BLOCK_N=GEMM_BLOCK_N, BLOCK_K=GEMM_BLOCK_K, IEEE=ieee)
    return out
