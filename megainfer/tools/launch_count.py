"""Kernel launches per (layer, micro-batch), counted on the CPU by the torch dispatcher, for
`megainfer bench host`.

Every op that reaches the dispatcher below autograd is recorded (`OpLog`, a
`TorchDispatchMode`); ops that only make a new view of a tensor's memory launch nothing and are
counted apart. What runs is the torch path on the CPU: a decode micro-batch's attention half
(`attend_and_pack`: the `AttentionLayer` with its router and the deployment's node routing, and
the dispatch records packed, as an attention rank runs it) and expert half (the `ExpertLayer` of one node's experts, as an expert node runs it), on
the family's tiny preset with random weights: the op sequence depends on the family (QK norm,
renormalised top-k), not on the sizes. On CUDA the attention, the KV-cache write and the gating
are each one Triton kernel where the node's start-up chose Triton (`kernels.choice`), so the
CUDA path launches fewer than the CPU path counted here; eager CUDA costs several microseconds
per launch either way, against a (layer, micro-batch) of a few hundred.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megainfer.config import ModelConfig
from megainfer.presets import PRESETS

# Ops that return a view of their input's memory: no kernel.
VIEW_OPS = frozenset({
    "aten.view.default", "aten.view.dtype", "aten._unsafe_view.default", "aten.reshape.default", "aten.slice.Tensor",
    "aten.select.int", "aten.unsqueeze.default", "aten.squeeze.dim", "aten.squeeze.default", "aten.transpose.int",
    "aten.t.default", "aten.permute.default", "aten.expand.default", "aten.alias.default", "aten.detach.default",
    "aten.as_strided.default", "aten.split_with_sizes.default", "aten.split.Tensor", "aten.unbind.int",
    "aten.view_as_real.default", "aten.view_as_complex.default", "aten.lift_fresh.default", "aten.chunk.default",
    "aten.flatten.using_ints", "aten.detach_.default", "aten.resolve_conj.default", "aten.resolve_neg.default",
})

# The tiny preset of each family, whose op sequence the family's real models share.
TINY_OF_FAMILY = {"mixtral": "tiny-mixtral", "qwen3_moe": "tiny-qwen3-moe"}


class OpLog(TorchDispatchMode):
    """Every aten op dispatched inside it, by overload name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))

    @property
    def launches(self) -> int:
        return sum(n for op, n in self.ops.items() if op not in VIEW_OPS)

    @property
    def views(self) -> int:
        return sum(n for op, n in self.ops.items() if op in VIEW_OPS)


@dataclass
class HalfLaunches:
    """One half of a (layer, micro-batch): its ops, launches and views, and the most frequent."""

    launches: int
    views: int
    ops: dict[str, int]


@dataclass
class DecodeLaunches:
    model: str  # the tiny preset counted
    rows: int  # decode rows of the micro-batch
    expert_nodes: int
    attention: HalfLaunches
    expert: HalfLaunches


def decode_launches(model: ModelConfig, rows: int = 16, context: int = 64, expert_nodes: int = 2) -> DecodeLaunches:
    """Launches of one decode micro-batch of `rows` sequences at `context` tokens, each half."""
    from megainfer.disagg.attention_dispatch import attend_and_pack
    from megainfer.model.expert_layer import ExpertLayer
    from megainfer.model.moe_model import MoEModel
    from megainfer.model.weights import RandomWeights
    from megainfer.runner.model_runner import prepare_batch

    name = TINY_OF_FAMILY.get(model.model_type)
    if name is None:
        raise ValueError(f"no tiny preset of family {model.model_type!r} to count launches on")
    cfg = PRESETS[name]
    block = 16
    blocks_per_seq = -(-(context + 1) // block)
    device = torch.device("cpu")
    tiny = MoEModel(cfg, torch.float32, device, context + 64, with_experts=False)
    with torch.inference_mode():
        tiny.load_weights(RandomWeights(0))
    per_node = cfg.num_experts // expert_nodes
    node_of = torch.arange(cfg.num_experts) // per_node
    for layer in tiny.attention_layers:
        layer.set_expert_nodes(node_of, expert_nodes)
    shape = (rows * blocks_per_seq, block, cfg.num_kv_heads, cfg.head_dim)
    cache = (torch.zeros(shape), torch.zeros(shape))
    seqs = [DecodingSequence(f"r{i}", context, list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq))) for i in range(rows)]
    ids, positions, batch = prepare_batch(seqs, [1] * rows, rows, block, device)
    experts = ExpertLayer(cfg, 0, torch.float32, device, expert_ids=list(range(per_node)))
    with torch.inference_mode():
        hidden = tiny.embed(ids)
        attention = OpLog()
        with attention:  # the attention half and its dispatch records, as an attention rank runs them
            attend_and_pack(tiny.attention_layers[0], tiny.rotary, cache, hidden, positions, batch,
                            torch.zeros(cfg.num_experts, dtype=torch.int64))
        out = tiny.attention_layers[0](hidden, positions, tiny.rotary, cache, batch)
        expert = OpLog()
        with expert:
            experts(out.expert_input, out.topk_ids, out.topk_weights)
    return DecodeLaunches(name, rows, expert_nodes, _half(attention), _half(expert))


def _half(log: OpLog) -> HalfLaunches:
    return HalfLaunches(log.launches, log.views,
                        dict(sorted(((op, n) for op, n in log.ops.items() if op not in VIEW_OPS), key=lambda kv: -kv[1])))


class DecodingSequence:
    """A sequence decoding its next token (what prepare_batch reads)."""

    def __init__(self, request_id: str, context: int, block_table: list[int], token: int = 3) -> None:
        self.request_id = request_id
        self.num_computed_tokens = context
        self.token_ids = [token] * (context + 1)
        self.block_table = block_table
