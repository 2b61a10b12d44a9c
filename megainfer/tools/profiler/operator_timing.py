"""One timing function per operator, on megainfer's own modules with random inputs.

An `OperatorBench` holds what one tensor-parallel rank holds of one decoder layer and the
head: a one-layer `MoEModel` without experts (its attention layer, rotary table, final norm,
embedding and LM head), the layer's `ExpertLayer` (packed for the CPU as `load_weights`
packs it), a `Sampler` and a KV cache. Layer 0's weights come from the checkpoint, or are
seeded random ones for a preset, as the engine loads them. Attention batches are built by
the engine's own `model_runner.prepare_batch`, from synthetic sequences.

`dense` is measured as the real `AttentionLayer.forward` on `tokens` decoding sequences with
the attention kernel taken out (it returns an empty tensor of its output's shape): so dense
plus the attention tables is the forward the engine runs, with no copy of the forward's steps
here to drift from it, and no difference of two noisy timings that could go negative.
With tp > 1 the layer is built at the rank's sharded shapes and its output all-reduce is
left out (the `allreduce` table prices it).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass
from typing import Callable

import torch

import kernels
from megainfer.config import ModelConfig
from megainfer.model.expert_layer import ExpertLayer
from megainfer.model.moe_model import MoEModel
from megainfer.model.weights import WeightSource
from megainfer.runner.model_runner import prepare_batch
from megainfer.runner.sampler import Sampler
from megainfer.sampling_params import SamplingParams

Timer = Callable[[Callable[[], object]], float]  # fn -> median seconds of one call


# Operators are timed in turn on distinct layers (weights and KV cache) holding at least this
# many bytes, up to the model's layer count: an engine step passes every layer before it
# comes back to the first, so a call meets its weights where the engine does, while its
# inputs, just produced, stay hot as in the engine. Timed back to back on one layer, the demo
# model's layer stayed in the CPU's cache and priced the engine's steps 25-40% low; timed
# after a cache flush (inputs evicted too, as Triton's do_bench does) small operators came
# out 15-20% slow. More than any CPU's last-level cache or a GPU's L2.
WORKING_SET_BYTES = 256 << 20


def layer_copies(model: ModelConfig, dtype_bytes: int, tp_size: int) -> int:
    """Distinct layers the profile builds (one where a layer alone outgrows the caches)."""
    layer_bytes = (model.attention_params_per_layer + model.num_experts * model.expert_params) * dtype_bytes / tp_size
    return max(1, min(model.num_layers, math.ceil(WORKING_SET_BYTES / layer_bytes)))


def _rotating(calls: list[Callable[[], object]]) -> Callable[[], object]:
    """One call of the next of `calls` each time (a layer after the other, as a step runs them)."""
    turn = itertools.cycle(calls)
    return lambda: next(turn)()


def _no_attention(query: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """Stands in for the paged attention kernel while `dense` is timed: its output's shape."""
    return torch.empty_like(query)


@dataclass
class SyntheticSequence:
    """What `prepare_batch` reads of a sequence: its tokens (a range stands in for the ids),
    how many of them are in the cache, and its KV blocks."""

    token_ids: range
    num_computed_tokens: int
    block_table: list[int]


class OperatorBench:
    def __init__(self, model: ModelConfig, weights: WeightSource, dtype: torch.dtype, device: torch.device,
                 max_model_len: int, kv_pool_blocks: int, block_size: int, tp_size: int = 1, seed: int = 0) -> None:
        """`kv_pool_blocks`: KV blocks allocated; sequences needing more share them (block ids
        wrap around), which keeps a GPU's largest grid points inside its memory."""
        self.model_config = model
        self.dtype, self.device, self.block_size = dtype, device, block_size
        self.copies = layer_copies(model, torch.tensor([], dtype=dtype).element_size(), tp_size)
        self.head = MoEModel(dataclasses.replace(model, num_layers=self.copies), dtype, device, max_model_len,
                             with_experts=False, tp_rank=0, tp_size=tp_size)
        self.attention = self.head.attention_layers[0]
        self.expert_layers = [ExpertLayer(model, i, dtype, device, tp_rank=0, tp_size=tp_size)
                              for i in range(self.copies)]
        self.experts = self.expert_layers[0]
        with torch.inference_mode():
            self.head.load_weights(weights)
            for layer in self.expert_layers:
                layer.load_weights(weights)
        # The all-reduce of the output projection's partial sums is the allreduce table's: the
        # layer keeps its sharded shapes and skips the collective.
        for attention in self.head.attention_layers:
            attention.tp_size = 1
        self.tp_size = tp_size
        self.weights = weights
        self._partial_experts: ExpertLayer | None = None  # built when an experts count below top_k is timed
        self.sampler = Sampler(seed, device, model.eos_token_ids)
        self.generator = torch.Generator(device=device).manual_seed(seed)
        shape = (kv_pool_blocks, block_size, self.attention.num_kv_heads, model.head_dim)
        # Random, not zeros: untouched zero pages of a CPU cache would all read one cached page.
        self.kv_caches = [(self._randn(shape), self._randn(shape)) for _ in range(self.copies)]
        self.kv_pool_blocks = kv_pool_blocks

    # -- the operators: each times one point with `timer` -----------------------------------
    def dense(self, timer: Timer, tokens: int) -> float:
        hidden = self._randn((tokens, self.model_config.hidden_size))
        _, positions, batch = self._batch([SyntheticSequence(range(1), 0, self._blocks(i, 1)) for i in range(tokens)],
                                          [1] * tokens, num_single=tokens)
        rotary = self.head.rotary
        # The layer's own forward with the attention kernel taken out (the attention tables
        # price it): timed directly, not as a difference of two noisy timings.
        real_kernel = kernels.paged_attention
        kernels.paged_attention = _no_attention
        try:
            return timer(_rotating([lambda a=a, kv=kv: a(hidden, positions, rotary, kv, batch)
                                    for a, kv in zip(self.head.attention_layers, self.kv_caches)]))
        finally:
            kernels.paged_attention = real_kernel

    def attention_decode(self, timer: Timer, seqs: int, context: int) -> float:
        decodes = [SyntheticSequence(range(context), context - 1, self._blocks(i, context)) for i in range(seqs)]
        _, _, batch = self._batch(decodes, [1] * seqs, num_single=seqs)
        return self._attention_kernel(timer, seqs, batch)

    def attention_prefill(self, timer: Timer, tokens: int, cached: int) -> float:
        chunk = SyntheticSequence(range(cached + tokens), cached, self._blocks(0, cached + tokens))
        _, _, batch = self._batch([chunk], [tokens], num_single=0)
        return self._attention_kernel(timer, tokens, batch)

    def moe(self, timer: Timer, tokens_per_expert: int, experts: int) -> float:
        layers, topk_ids = self._routing(tokens_per_expert, experts)
        x = self._randn((topk_ids.shape[0], self.model_config.hidden_size))
        topk_weights = torch.softmax(self._randn(topk_ids.shape, torch.float32), dim=-1)
        return timer(_rotating([lambda layer=layer: layer(x, topk_ids, topk_weights) for layer in layers]))

    def lm_head(self, timer: Timer, tokens: int) -> float:
        hidden = self._randn((tokens, self.model_config.hidden_size))
        return timer(lambda: self.head.compute_logits(self.head.norm(hidden)))

    def sampling(self, timer: Timer, seqs: int) -> float:
        logits = self._randn((seqs, self.model_config.vocab_size), torch.float32)
        request_ids, params = [f"profile-{i}" for i in range(seqs)], [SamplingParams()] * seqs
        return timer(lambda: self.sampler.sample(logits, request_ids, params))

    def warm_up(self) -> None:
        """Run every operator once, untimed: the process's first calls (allocator growth, GEMM
        library set-up, kernel selection) would otherwise land on the first grid points."""
        def once(fn: Callable[[], object]) -> float:
            fn()
            return 0.0

        for operator, point in (("dense", (8,)), ("attention_decode", (2, 64)), ("attention_prefill", (16, 16)),
                                ("moe", (4, self.model_config.top_k)), ("lm_head", (8,)), ("sampling", (8,))):
            self.time_point(operator, once, point)

    def time_point(self, operator: str, timer: Timer, point: tuple[int, ...]) -> float:
        with torch.inference_mode():
            return getattr(self, operator)(timer, *point)

    # -- inputs -------------------------------------------------------------------------------
    def _attention_kernel(self, timer: Timer, tokens: int, batch: kernels.PagedAttentionBatch) -> float:
        query = self._randn((tokens, self.attention.num_heads, self.model_config.head_dim))
        scale = self.attention.scale
        return timer(_rotating([lambda k=k, v=v: kernels.paged_attention(query, k, v, batch, scale)
                                for k, v in self.kv_caches]))

    def _batch(self, seqs: list[SyntheticSequence], num_tokens: list[int], num_single: int):
        return prepare_batch(seqs, num_tokens, num_single, self.block_size, self.device)

    def _blocks(self, sequence: int, tokens: int) -> list[int]:
        """Sequence `sequence`'s blocks for `tokens` tokens: consecutive, distinct across the
        batch while the pool lasts."""
        n = math.ceil(tokens / self.block_size)
        first = sequence * n
        return [(first + b) % self.kv_pool_blocks for b in range(n)]

    def _routing(self, tokens_per_expert: int, experts: int) -> tuple[list[ExpertLayer], torch.Tensor]:
        """(the layers to run in turn, topk_ids [T, k]) with exactly `experts` experts active, each getting
        `tokens_per_expert` (token, expert) pairs, every token choosing top_k distinct experts.
        With experts >= top_k, pairs go round-robin over experts 0..experts-1 (the last token's
        spare choices raise a few experts' counts by one). With fewer, no token could choose
        top_k distinct active experts of a layer holding them all: then, as on an expert node
        holding a subset, each token's other choices go to experts the layer does not hold."""
        k, num_experts = self.model_config.top_k, self.model_config.num_experts
        if experts >= k:
            tokens = math.ceil(tokens_per_expert * experts / k)
            ids = torch.arange(tokens * k, device=self.device).remainder(experts).view(tokens, k)
            return self.expert_layers, ids
        held_elsewhere = torch.arange(num_experts - (k - experts), num_experts, device=self.device)
        row = torch.cat([torch.arange(experts, device=self.device), held_elsewhere])
        return [self._partial_layer()], row.expand(tokens_per_expert, k).contiguous()

    def _partial_layer(self) -> ExpertLayer:
        """The layer without its last top_k - 1 experts (enough to route any token's remaining
        choices elsewhere)."""
        if self._partial_experts is None:
            cfg = self.model_config
            ids = range(cfg.num_experts - (cfg.top_k - 1))
            self._partial_experts = ExpertLayer(cfg, 0, self.dtype, self.device, ids, tp_rank=0, tp_size=self.tp_size)
            with torch.inference_mode():
                self._partial_experts.load_weights(self.weights)
        return self._partial_experts

    def _randn(self, shape: tuple[int, ...], dtype: torch.dtype | None = None) -> torch.Tensor:
        return torch.randn(shape, generator=self.generator, device=self.device, dtype=dtype or self.dtype)
