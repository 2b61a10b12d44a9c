"""The expert half of one MoE decoder layer: what an expert node runs.

Holds the SwiGLU experts of any subset of expert ids. Given tokens with their global
top-k expert ids and routing weights, returns for every token the routing-weighted sum of
the outputs of the experts it chose *among those this layer holds* (zero for the rest),
so summing the outputs of layers holding disjoint subsets gives the full MoE output.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

import kernels
from kernels import moe_packed

from megainfer.config import ModelConfig
from megainfer.model.checkpoint_names import expert_tensors
from megainfer.model.weights import WeightSource



class ExpertLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, dtype: torch.dtype, device: torch.device | str,
                 expert_ids: Sequence[int] | None = None, tp_rank: int = 0, tp_size: int = 1) -> None:
        """With tp_size > 1 this rank holds a 1/tp_size slice of every expert's intermediate
        dimension (gate and up rows, down columns): its output is a partial sum, and the
        ranks' outputs add up to the layer's."""
        super().__init__()
        self.cfg = cfg
        self.layer = layer
        self.expert_ids = list(range(cfg.num_experts) if expert_ids is None else expert_ids)
        if len(set(self.expert_ids)) != len(self.expert_ids) or not all(
                0 <= e < cfg.num_experts for e in self.expert_ids):
            raise ValueError(f"expert ids must be distinct and in [0, {cfg.num_experts}), got {self.expert_ids}")
        if cfg.expert_intermediate_size % tp_size:
            raise ValueError(f"expert intermediate size {cfg.expert_intermediate_size} does not split over "
                             f"{tp_size} tensor-parallel ranks")
        self.tp_rank, self.tp_size = tp_rank, tp_size
        n, h, i = len(self.expert_ids), cfg.hidden_size, cfg.expert_intermediate_size // tp_size
        # [local expert, 2I, H]: rows 0..I-1 are the gate projection, I..2I-1 the up projection.
        self.w_gate_up = nn.Parameter(torch.empty(n, 2 * i, h, dtype=dtype, device=device), requires_grad=False)
        self.w_down = nn.Parameter(torch.empty(n, h, i, dtype=dtype, device=device), requires_grad=False)
        # Global id -> local id; experts held elsewhere map to n, past the last local expert, so
        # their pairs sort last and no boolean mask (a host sync on a GPU) drops them.
        local = torch.full((cfg.num_experts,), n, dtype=torch.int64)
        local[self.expert_ids] = torch.arange(n)
        self.register_buffer("local_index", local.to(device), persistent=False)
        self.holds_all = n == cfg.num_experts
        # On the CPU, the experts packed once for oneDNN after loading (kernels/moe_packed.py):
        # the GEMM library would otherwise repack them on every call, once per micro-batch.
        self.packed: moe_packed.PackedExperts | None = None

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                valid: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, H], topk_ids [T, k] global ids, topk_weights [T, k] -> [T, H]. `valid` ([1] int32
        on the device): the live rows of a padded batch (a CUDA graph's size); the rows past it
        are computed by no expert and come out zero."""
        k, n = topk_ids.shape[1], len(self.expert_ids)
        local = self.local_index[topk_ids.reshape(-1)]
        if valid is not None:  # padding rows' pairs go where pairs of experts held elsewhere go
            local = torch.where(torch.arange(local.numel(), device=x.device) < valid * k, local, n)
        # Sort (token, choice) pairs by expert so each expert runs one contiguous GEMM; the
        # stable sort keeps token order inside an expert, as transformers' loop does. Pairs of
        # experts held elsewhere (id n) come last, past the last offset.
        local, order = torch.sort(local, stable=True)
        # A token's k experts are distinct, so at most min(k, n) of its pairs are held here: the
        # pairs past T * min(k, n) in sorted order are all held elsewhere. Gathering, combining
        # and zeroing only those rows saves k / n of the hidden-sized traffic on an expert node
        # holding fewer experts than top-k (a static bound: CUDA graphs keep their shapes).
        held = x.shape[0] * min(k, n)
        local, order = local[:held], order[:held]
        token_ids = order // k
        # Counts and offsets stay on the device (scatter_add: bincount reads its range back):
        # the Triton GEMM reads them there; the torch reference reads them back itself.
        counts = torch.zeros(n + 1, dtype=torch.int64, device=x.device).scatter_add_(0, local, torch.ones_like(local))
        offsets = torch.cat([counts.new_zeros(1), counts[:n].cumsum(0)])
        out = kernels.grouped_expert_gemm(x[token_ids], offsets, self.w_gate_up, self.w_down,
                                          topk_weights.reshape(-1)[order], packed=self.packed)
        if not self.holds_all or valid is not None:  # rows past the last offset were never computed
            out = torch.where((local < n)[:, None], out, 0)
        return torch.zeros_like(x).index_add_(0, token_ids, out)

    def load_weights(self, source: WeightSource) -> None:
        for local, e in enumerate(self.expert_ids):
            t = {role: source.get(name, shape) for role, (name, shape) in
                 expert_tensors(self.cfg, self.layer, e).items()}
            rows = slice(self.tp_rank * self.w_down.shape[2], (self.tp_rank + 1) * self.w_down.shape[2])
            self.w_gate_up[local].copy_(torch.cat([t["gate"][rows], t["up"][rows]]))
            self.w_down[local].copy_(t["down"][:, rows])
        if moe_packed.available(self.w_gate_up.device, self.w_gate_up.dtype):
            self.packed = moe_packed.PackedExperts.pack(self.w_gate_up, self.w_down)
