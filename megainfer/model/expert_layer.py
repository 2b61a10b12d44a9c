"""The expert half of one MoE decoder layer: what an expert node runs.

Holds the SwiGLU experts (gpt-oss: the clamped SwiGLU, with biases) of any subset of expert ids. Given tokens with their global
top-k expert ids and routing weights, returns for every token the routing-weighted sum of
the outputs of the experts it chose *among those this layer holds* (zero for the rest),
so summing the outputs of layers holding disjoint subsets gives the full MoE output.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

import kernels
from kernels import moe_packed

from megainfer.config import ModelConfig
from megainfer.model.checkpoint_names import expert_tensors, expert_weights, read
from megainfer.model.weights import WeightSource



def check_expert_ids(expert_ids: list[int], num_experts: int) -> None:
    if len(set(expert_ids)) != len(expert_ids) or not all(0 <= e < num_experts for e in expert_ids):
        raise ValueError(f"expert ids must be distinct and in [0, {num_experts}), got {expert_ids}")


@dataclass(frozen=True)
class NodeSlots:
    """The ids the dispatch records name this node's experts by: `ids[i]` for row i, out of
    `num_ids` (the expert count, or N·S slots with replicas); `room` rows of weights."""

    ids: list[int]
    num_ids: int
    room: int

    def check(self, held: int) -> None:
        if len(self.ids) != held or held > self.room or len(set(self.ids)) != held or not all(
                0 <= i < self.num_ids for i in self.ids):
            raise ValueError(f"slot ids {self.ids} must be {held} distinct ids in [0, {self.num_ids}), "
                             f"at most {self.room}")

    def local_index(self) -> torch.Tensor:
        local = torch.full((self.num_ids,), self.room, dtype=torch.int64)
        local[self.ids] = torch.arange(len(self.ids))
        return local


class ExpertLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, dtype: torch.dtype, device: torch.device | str,
                 expert_ids: Sequence[int] | None = None, tp_rank: int = 0, tp_size: int = 1,
                 slots: NodeSlots | None = None, row_pairs: torch.Tensor | None = None) -> None:
        """With tp_size > 1 this rank holds a 1/tp_size slice of every expert's intermediate
        dimension (gate and up rows, down columns): its output is a partial sum, and the
        ranks' outputs add up to the layer's. `slots`: where experts have replicas
        (megainfer/expert_replicas.py), the slot ids the records name for `expert_ids`, and room
        for more experts than it holds now (a re-placement fills it: `stage`, `commit`). `row_pairs`:
        int64 [room] on the device where this layer counts the pairs each row computes (an expert
        node passes views of one [layers, room] tensor, read once per step); None: its own."""
        super().__init__()
        self.cfg = cfg
        self.layer = layer
        self.expert_ids = list(range(cfg.num_experts) if expert_ids is None else expert_ids)
        check_expert_ids(self.expert_ids, cfg.num_experts)
        if cfg.expert_intermediate_size % tp_size:
            raise ValueError(f"expert intermediate size {cfg.expert_intermediate_size} does not split over "
                             f"{tp_size} tensor-parallel ranks")
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.slots = slots or NodeSlots(self.expert_ids, cfg.num_experts, len(self.expert_ids))
        self.slots.check(len(self.expert_ids))
        n, h, i = self.slots.room, cfg.hidden_size, cfg.expert_intermediate_size // tp_size
        # [local expert, 2I, H]: rows 0..I-1 are the gate projection, I..2I-1 the up projection.
        self.w_gate_up = nn.Parameter(torch.zeros(n, 2 * i, h, dtype=dtype, device=device), requires_grad=False)
        self.w_down = nn.Parameter(torch.zeros(n, h, i, dtype=dtype, device=device), requires_grad=False)
        # gpt-oss's biases: the gate's then the up's [n, 2I], the down projection's [n, H]. The
        # down bias is added once over a tensor-parallel node's ranks (rank 0's partial sum).
        self.b_gate_up = self.b_down = None
        if cfg.expert_bias:
            self.b_gate_up = nn.Parameter(torch.zeros(n, 2 * i, dtype=dtype, device=device), requires_grad=False)
            if tp_rank == 0:
                self.b_down = nn.Parameter(torch.zeros(n, h, dtype=dtype, device=device), requires_grad=False)
        self.activation = kernels.ExpertActivation(cfg.swiglu_alpha, cfg.swiglu_limit)
        # Global (slot) id -> local row; ids held elsewhere map to n, past the last row, so their
        # pairs sort last and no boolean mask (a host sync on a GPU) drops them.
        self.register_buffer("local_index", self.slots.local_index().to(device), persistent=False)
        self.holds_all = n == cfg.num_experts and self.slots.ids == list(range(cfg.num_experts))
        # (token, expert) pairs each row computed, counted on the device (in a captured graph too)
        # and summed since start: the load the node takes, router-independent (its step's share
        # goes to the attention nodes in the load round, disagg/expert_load_round.py).
        if row_pairs is None:
            row_pairs = torch.zeros(n, dtype=torch.int64, device=device)
        elif row_pairs.shape != (n,) or row_pairs.dtype != torch.int64:
            raise ValueError(f"row_pairs must be int64 [{n}], got {row_pairs.dtype} {list(row_pairs.shape)}")
        self.register_buffer("row_pairs", row_pairs, persistent=False)
        # On the CPU, the experts packed once for oneDNN after loading (kernels/moe_packed.py):
        # the GEMM library would otherwise repack them on every call, once per micro-batch.
        self.packed: moe_packed.PackedExperts | None = None

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                valid: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, H], topk_ids [T, k] global ids, topk_weights [T, k] -> [T, H]. `valid` ([1] int32
        on the device): the live rows of a padded batch (a CUDA graph's size); the rows past it
        are computed by no expert and come out zero."""
        k, n = topk_ids.shape[1], self.slots.room  # the room, not the experts held: shapes stay put
        local = self.local_index[topk_ids.reshape(-1)]
        if valid is not None:  # padding rows' pairs go where pairs of experts held elsewhere go
            local = torch.where(torch.arange(local.numel(), device=x.device) < valid * k, local, n)
        # Sort (token, choice) pairs by expert so each expert runs one contiguous GEMM; the
        # stable sort keeps token order inside an expert, as transformers' loop does. Pairs of
        # experts held elsewhere (id n) come last, past the last offset.
        local, order = torch.sort(local, stable=True)
        # A token's k experts are distinct (so are their slots), so at most min(k, n) of its pairs are held here: the
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
        self.row_pairs += counts[:n]  # in place: a captured graph and the node's [layers, room] view see it
        out = kernels.grouped_expert_gemm(x[token_ids], offsets, self.w_gate_up, self.w_down,
                                          topk_weights.reshape(-1)[order], packed=self.packed,
                                          activation=self.activation, gate_up_bias=self.b_gate_up,
                                          down_bias=self.b_down)
        if not self.holds_all or valid is not None:  # rows past the last offset were never computed
            out = torch.where((local < n)[:, None], out, 0)
        return torch.zeros_like(x).index_add_(0, token_ids, out)

    def load_weights(self, source: WeightSource) -> None:
        for local, e in enumerate(self.expert_ids):
            self._load_row(self._row_of(local), source, e)
        if self.slots.room and moe_packed.available(self.w_gate_up.device, self.w_gate_up.dtype):
            self.packed = moe_packed.PackedExperts.pack(self.w_gate_up, self.w_down)

    def _row_of(self, local: int) -> "ExpertRow":
        """Row `local` of every weight tensor (views: what is copied into them lands in place)."""
        return ExpertRow(self.w_gate_up[local], self.w_down[local],
                         None if self.b_gate_up is None else self.b_gate_up[local],
                         None if self.b_down is None else self.b_down[local])

    def _load_row(self, row: "ExpertRow", source: WeightSource, expert: int) -> None:
        """Expert `expert`'s weights (this rank's slice) into one row of the weight tensors."""
        t = {role: read(source, ref) for role, ref in expert_tensors(self.cfg, self.layer, expert).items()}
        gate, up, down, gate_bias, up_bias, down_bias = expert_weights(t)
        rows = slice(self.tp_rank * self.w_down.shape[2], (self.tp_rank + 1) * self.w_down.shape[2])
        row.gate_up.copy_(torch.cat([gate[rows], up[rows]]))
        row.down.copy_(down[:, rows])
        if row.gate_up_bias is not None:
            row.gate_up_bias.copy_(torch.cat([gate_bias[rows], up_bias[rows]]))
        if row.down_bias is not None:
            row.down_bias.copy_(down_bias)

    def stage(self, expert_ids: list[int], slot_ids: list[int], source: WeightSource) -> "StagedExperts":
        """A re-placement's experts for this layer, loaded beside the serving ones (nothing
        serving changes): only the rows whose expert changes are read from `source`. Runs off
        the serving thread; `commit` then switches at a step boundary."""
        check_expert_ids(expert_ids, self.cfg.num_experts)
        slots = NodeSlots(list(slot_ids), self.slots.num_ids, self.slots.room)
        slots.check(len(expert_ids))
        changed = [i for i, e in enumerate(expert_ids) if i >= len(self.expert_ids) or self.expert_ids[i] != e]
        def rows_like(held: torch.Tensor | None) -> torch.Tensor | None:
            return None if held is None else held.new_empty((len(changed),) + tuple(held.shape[1:]))

        gate_up, down = rows_like(self.w_gate_up), rows_like(self.w_down)
        gate_up_bias, down_bias = rows_like(self.b_gate_up), rows_like(self.b_down)
        for k, i in enumerate(changed):
            self._load_row(ExpertRow(gate_up[k], down[k], None if gate_up_bias is None else gate_up_bias[k],
                                     None if down_bias is None else down_bias[k]), source, expert_ids[i])
        packed = None
        if self.packed is not None:  # the CPU's packed copy, built here rather than at the switch
            whole_gate_up, whole_down = self.w_gate_up.clone(), self.w_down.clone()
            whole_gate_up[changed], whole_down[changed] = gate_up, down
            packed = moe_packed.PackedExperts.pack(whole_gate_up, whole_down)
        return StagedExperts(list(expert_ids), slots, changed, gate_up, down, packed, gate_up_bias, down_bias)

    def commit(self, staged: "StagedExperts") -> None:
        """Serve the staged placement from now on: the changed rows and the slot map copied into
        the serving tensors in place (a captured graph keeps reading them), the CPU's packed copy swapped."""
        if staged.changed:
            index = torch.tensor(staged.changed, device=self.w_gate_up.device)
            self.w_gate_up.index_copy_(0, index, staged.gate_up)
            self.w_down.index_copy_(0, index, staged.down)
            for held, new in ((self.b_gate_up, staged.gate_up_bias), (self.b_down, staged.down_bias)):
                if held is not None:
                    held.index_copy_(0, index, new)
        self.local_index.copy_(staged.slots.local_index())
        self.expert_ids, self.slots = staged.expert_ids, staged.slots
        self.holds_all = False  # a re-placed layer never holds every expert under its own id
        if staged.packed is not None:
            self.packed = staged.packed


@dataclass
class StagedExperts:
    """A layer's experts after a re-placement, loaded and not yet serving (`ExpertLayer.stage`)."""

    expert_ids: list[int]
    slots: NodeSlots
    changed: list[int]  # the rows whose expert changes
    gate_up: torch.Tensor  # [changed, 2I, H] their weights, in the order of `changed`
    down: torch.Tensor
    packed: "moe_packed.PackedExperts | None"
    gate_up_bias: torch.Tensor | None = None  # gpt-oss's biases of the changed rows
    down_bias: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.gate_up, self.down, self.gate_up_bias, self.down_bias)
                   if t is not None)


@dataclass
class ExpertRow:
    """One expert's row of a layer's weight tensors (views), where its weights are loaded."""

    gate_up: torch.Tensor  # [2I, H] this rank's gate rows, then its up rows
    down: torch.Tensor  # [H, I]
    gate_up_bias: torch.Tensor | None  # [2I] (gpt-oss)
    down_bias: torch.Tensor | None  # [H] (gpt-oss, tensor-parallel rank 0 only)
