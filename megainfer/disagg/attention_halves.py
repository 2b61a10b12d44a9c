"""An attention rank's attention halves, one (layer, micro-batch) at a time: replayed from decode's
CUDA graphs (decode_graphs.py) where the step loaded them for the micro-batch, else run eagerly
(`attend_and_pack`, the function the graphs captured)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from megainfer.disagg.attention_dispatch import DispatchParts, attend_and_pack
from megainfer.disagg.decode_graphs import AttentionGraphs

if TYPE_CHECKING:
    from megainfer.model.moe_model import MoEModel
    from megainfer.runner.model_runner import MicroBatchState


class AttentionHalves:
    """An attention rank's attention halves, one (layer, micro-batch) at a time: replayed from
    decode's graphs where the step loaded them for the micro-batch, else eager; either way the
    tokens routed are added to `expert_counts` ([layers, experts], which the graphs add to too)."""

    def __init__(self, model: MoEModel, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 graphs: AttentionGraphs | None, expert_counts: torch.Tensor, tp_size: int) -> None:
        self.model, self.kv_caches, self.graphs, self.expert_counts = model, kv_caches, graphs, expert_counts
        self.tp_size = tp_size

    def load(self, j: int, state: MicroBatchState) -> None:
        """Micro-batch j's inputs for this step, before its first layer: a decode-only micro-batch
        replays graphs."""
        if self.graphs is not None:
            self.graphs.load(j, None if state.layout.cohort_sequences else state.decode_inputs,
                             state.layout.num_decode_rows)

    def dense(self, layer: int, hidden: torch.Tensor | None, inp) -> torch.Tensor | None:
        """A dense layer (DeepSeek's first ones), attention and FFN, eager: its output; no round."""
        if hidden is None:
            return None
        _, positions, batch = inp
        model = self.model
        return model.attention_layers[layer](hidden, positions, model.rotary, self.kv_caches[layer], batch).residual

    def __call__(self, layer: int, j: int, hidden: torch.Tensor, inp) -> DispatchParts:
        """Micro-batch j's attention half of `layer`: its graph where this step loaded one, else eager."""
        graphs = self.graphs
        if graphs is not None and graphs.active[j] is not None:
            return graphs.run(layer, j, hidden)
        _, positions, batch = inp
        model = self.model
        return attend_and_pack(model.attention_layers[layer], model.rotary, self.kv_caches[layer], hidden, positions,
                               batch, self.expert_counts[layer], self.tp_size)
