"""Runs one scheduled step on the model: owns the weights, the KV-cache tensors and the sampler."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

import kernels
from megainfer.config import EngineConfig, ModelConfig
from megainfer.model.moe_model import MoEModel
from megainfer.model.weights import WeightSource
from megainfer.sampler import Sampler
from megainfer.scheduler import SchedulerOutput

logger = logging.getLogger(__name__)


@dataclass
class StepResult:
    sampled: list[int | None]  # new token per scheduled sequence; None where it was mid-prompt
    expert_counts: list[list[int]]  # [layer][expert] tokens routed this step


class ModelRunner:
    def __init__(self, model_config: ModelConfig, config: EngineConfig, weights: WeightSource,
                 max_model_len: int) -> None:
        self.model_config = model_config
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = getattr(torch, config.dtype)
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.model = MoEModel(model_config, self.dtype, self.device, max_model_len)
        with torch.inference_mode():
            self.model.load_weights(weights, show_progress=config.show_progress)
        self.num_blocks, self.kv_caches = allocate_kv_caches(model_config, config, max_model_len, self.device,
                                                             model_config.num_kv_heads)
        self.sampler = Sampler(config.seed, self.device)
        # Layered prefill: hidden states of cohort members between layer groups, by request id.
        self.layered_hidden: dict[str, torch.Tensor] = {}
        logger.info("model %s on %s (%s): %d KV blocks of %d tokens", model_config.name, self.device,
                    config.dtype, self.num_blocks, config.block_size)

    @property
    def layered_hidden_bytes(self) -> int:
        """Memory held by prompts in flight between layer groups."""
        return sum(t.numel() * t.element_size() for t in self.layered_hidden.values())

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> StepResult:
        if out.layered is not None:
            return self._execute_layered(out)
        input_ids, positions, batch = self._prepare(out)
        fwd = self.model(input_ids, positions, self.kv_caches, batch)
        samples = out.samples()
        rows = [batch.query_start_host[i + 1] - 1 for i, s in enumerate(samples) if s]
        sampled: list[int | None] = [None] * len(out.seqs)
        if rows:
            logits = self.model.compute_logits(fwd.hidden[torch.tensor(rows, device=self.device)])
            seqs = [s for s, flag in zip(out.seqs, samples) if flag]
            tokens = iter(self.sampler.sample(logits, [s.request_id for s in seqs], [s.params for s in seqs]))
            sampled = [next(tokens) if flag else None for flag in samples]
        return StepResult(sampled, fwd.expert_counts.tolist())

    def _execute_layered(self, out: SchedulerOutput) -> StepResult:
        """Decodes through every layer; the cohort's chunks through this step's layer group only,
        entering from the embedding (first group) or from where the last step left them."""
        lp = out.layered
        cfg = self.model_config
        model = self.model
        first, end = lp.layers
        cohort_ids = [s.request_id for s in lp.seqs]
        for rid in list(self.layered_hidden):  # members that left the cohort (preempted, aborted)
            if rid not in cohort_ids:
                del self.layered_hidden[rid]
        bs = self.config.block_size
        nd = len(out.seqs)
        dec = prepare_batch(out.seqs, out.num_scheduled_tokens, out.num_single_token, bs, self.device) if nd else None
        every = out.seqs + lp.seqs
        counts = out.num_scheduled_tokens + lp.num_tokens
        ids_all, pos_all, batch_all = prepare_batch(every, counts, sum(1 for n in counts if n == 1), bs, self.device)
        nd_tokens = sum(out.num_scheduled_tokens)
        h_dec = model.embed(dec[0]) if nd else None
        if first == 0:
            h_cohort = model.embed(ids_all[nd_tokens:])
        else:
            h_cohort = torch.cat([self.layered_hidden[rid] for rid in cohort_ids])
        expert_counts = torch.zeros(cfg.num_layers, cfg.num_experts, dtype=torch.int64)
        for layer in range(cfg.num_layers):
            if first <= layer < end:
                both = torch.cat([h_dec, h_cohort]) if nd else h_cohort
                both, c = model.layer(layer, both, pos_all, self.kv_caches[layer], batch_all)
                h_dec, h_cohort = (both[:nd_tokens], both[nd_tokens:]) if nd else (None, both)
            elif nd:
                h_dec, c = model.layer(layer, h_dec, dec[1], self.kv_caches[layer], dec[2])
            else:
                continue
            expert_counts[layer] += c.cpu()
        # Rows that sample: every decode; a cohort chunk that completes its prompt, after the last group.
        starts = batch_all.query_start_host
        rows, seqs = [], []
        for i, seq in enumerate(out.seqs):
            if seq.num_computed_tokens + out.num_scheduled_tokens[i] == seq.num_tokens:
                rows.append(h_dec[starts[i + 1] - 1])
                seqs.append(seq)
        cohort_offsets = [starts[nd + j] - nd_tokens for j in range(len(lp.seqs) + 1)]
        for j, seq in enumerate(lp.seqs):
            part = h_cohort[cohort_offsets[j]:cohort_offsets[j + 1]]
            if not lp.last:
                self.layered_hidden[seq.request_id] = part
            else:
                self.layered_hidden.pop(seq.request_id, None)
                if seq.num_computed_tokens + lp.num_tokens[j] == seq.num_tokens:
                    rows.append(part[-1])
                    seqs.append(seq)
        sampled: list[int | None] = [None] * (nd + len(lp.seqs))
        if rows:
            logits = model.compute_logits(model.norm(torch.stack(rows)))
            tokens = self.sampler.sample(logits, [s.request_id for s in seqs], [s.params for s in seqs])
            index = {id(s): i for i, s in enumerate(every)}
            for seq, token in zip(seqs, tokens):
                sampled[index[id(seq)]] = token
        return StepResult(sampled, expert_counts.tolist())

    def _prepare(self, out: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, kernels.PagedAttentionBatch]:
        return prepare_batch(out.seqs, out.num_scheduled_tokens, out.num_single_token, self.config.block_size,
                             self.device)


def prepare_batch(seqs, num_tokens: list[int], num_single: int, block_size: int,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor, kernels.PagedAttentionBatch]:
    """Input ids, positions and attention metadata of `seqs`, each computing its next
    `num_tokens[i]` tokens (the first `num_single` with one token each)."""
    token_ids: list[int] = []
    starts = [0]
    seq_lens = []
    for seq, n in zip(seqs, num_tokens):
        begin = seq.num_computed_tokens
        token_ids.extend(seq.token_ids[begin:begin + n])
        starts.append(starts[-1] + n)
        seq_lens.append(begin + n)
    width = max(len(s.block_table) for s in seqs)
    tables = [s.block_table + [0] * (width - len(s.block_table)) for s in seqs]
    query_lens = torch.tensor(num_tokens)
    seq_lens_t = torch.tensor(seq_lens)
    # Position of each query token: its sequence's cached length minus the tokens after it.
    seq_of_token = torch.repeat_interleave(torch.arange(len(seqs)), query_lens)
    positions = torch.arange(len(token_ids)) - torch.tensor(starts[:-1])[seq_of_token] \
        + (seq_lens_t - query_lens)[seq_of_token]
    block_tables = torch.tensor(tables, dtype=torch.int64)
    slots = block_tables[seq_of_token, positions // block_size] * block_size + positions % block_size
    batch = kernels.PagedAttentionBatch(
        block_tables=block_tables.to(device),
        seq_lens=seq_lens_t.to(torch.int32).to(device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        slot_mapping=slots.to(device),
        num_single=num_single,
        seq_lens_host=seq_lens,
        query_start_host=starts,
    )
    return torch.tensor(token_ids, device=device), positions.to(device), batch


def allocate_kv_caches(model_config: ModelConfig, config: EngineConfig, max_model_len: int, device: torch.device,
                       num_kv_heads: int) -> tuple[int, list[tuple[torch.Tensor, torch.Tensor]]]:
    """(blocks, per-layer (K, V) caches of [blocks, block_size, num_kv_heads, head_dim]); the
    block count comes from the config (or the memory free after loading weights)."""
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None
    num_blocks = config.resolved_num_kv_blocks(model_config, max_model_len, free)
    dtype = getattr(torch, config.dtype)
    shape = (num_blocks, config.block_size, num_kv_heads, model_config.head_dim)
    return num_blocks, [(_zeroed(shape, dtype, device), _zeroed(shape, dtype, device))
                        for _ in range(model_config.num_layers)]


def _zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled KV-cache tensor. Zeros matter: attention reads whole blocks and masks the
    unused slots, and garbage NaNs there would survive the mask (0 * NaN). On the CPU the
    zeros come from calloc, whose pages the OS maps lazily, so a large cache costs memory
    only as blocks are used instead of all at start-up (torch.zeros writes every page)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    numel = int(np.prod(shape))
    raw = np.zeros(numel * torch.tensor([], dtype=dtype).element_size(), dtype=np.uint8)
    return torch.from_numpy(raw).view(dtype).view(shape)
