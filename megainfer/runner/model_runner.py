"""Runs one scheduled step on the model: owns the weights, the KV-cache tensors and the sampler."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from itertools import chain, groupby
from operator import attrgetter, getitem
from types import SimpleNamespace
from typing import Any, Callable, Protocol

import numpy as np
import torch

import kernels
from megainfer.config import ModelConfig
from megainfer.engine_config import EngineConfig
from megainfer.messages import PositionLogprobs
from megainfer.model.moe_model import MoEModel
from megainfer.model.weights import WeightSource
from megainfer.runner import memory_profile
from megainfer.runner.kernel_warmup import warm_up_engine
from megainfer.runner.memory_profile import MemorySnapshot
from megainfer.runner.sampler import Sampler, position_logprobs
from megainfer.runner.step_hooks import StepHooks
from megainfer.sampling_params import MAX_LOGPROBS, SamplingParams
from megainfer.scheduling.block_table_rows import BlockTableRows
from megainfer.scheduling.scheduler_output import SchedulerOutput
from megainfer.scheduling.sequence import COMPUTED, TOKEN_IDS
from megainfer.scheduling.step_layout import MicroBatchLayout, StepLayout
from megainfer.tensor_parallel import TensorParallelGroup

logger = logging.getLogger(__name__)


# Prompt rows whose logits are computed at once for prompt logprobs: bounds the [rows, vocab]
# temporaries of a long prompt chunk.
PROMPT_LOGPROB_ROWS = 256


@dataclass
class ExpertNodeLoad:
    """A disaggregated step's (token, expert) pairs as the expert nodes counted them
    (megainfer/disagg/expert_load_round.py): the whole deployment's, not one attention node's."""

    counts: np.ndarray  # [layers, experts] int64, every expert node's added up
    node_pairs: np.ndarray  # [layers, expert nodes] int64, each node's
    prefill: bool  # some attention node's step carried prompt tokens


@dataclass
class StepResult:
    sampled: list[int | None]  # new token per scheduled sequence; None where it was mid-prompt
    expert_counts: np.ndarray | list  # [layer, expert] tokens routed this step (int64; empty when none)
    # By sequence index, for sequences that sampled and asked for logprobs: the sampled token's.
    logprobs: dict[int, PositionLogprobs] = field(default_factory=dict)
    # By sequence index, for sequences asking for prompt logprobs whose prompt rows completed
    # this step: (prompt position of the first entry, one entry per position from there on).
    prompt_logprobs: dict[int, tuple[int, list[PositionLogprobs]]] = field(default_factory=dict)
    # A disaggregated leader's: the expert nodes' counts of the step (None: colocated, a follower).
    expert_node_load: ExpertNodeLoad | None = None


class StepRunner(Protocol):
    """What the engine asks of its runner: this module's colocated `ModelRunner`, or a
    disaggregated attention node's `PipelinedModelRunner` (megainfer/disagg/)."""

    steps_when_idle: bool  # takes part in every step, empty or not (a disaggregated node: lockstep)
    takes_step_hooks: bool  # `execute` takes `StepHooks` (the engine may schedule asynchronously)
    deployment_busy: bool  # did any node of its deployment have work in the last step?
    step_id: int  # the step it runs next; all attention nodes of a deployment run each number together
    kernels: Any  # which implementation each operator runs (kernels.startup.KernelReport), once built

    def execute(self, out: SchedulerOutput, hooks: StepHooks | None = None) -> StepResult: ...


class ModelRunner:
    steps_when_idle = False
    takes_step_hooks = False
    deployment_busy = False  # the colocated engine is its whole deployment
    step_id = -1  # it does not number its steps
    kernels = None

    def __init__(self, model_config: ModelConfig, config: EngineConfig, weights: WeightSource,
                 max_model_len: int) -> None:
        self.model_config = model_config
        self.config = config
        self.device, self.dtype = device_and_dtype(config)
        load_and_size(self, lambda: MoEModel(model_config, self.dtype, self.device, max_model_len), weights,
                      max_model_len)
        self.sampler = Sampler(config.seed, self.device, model_config.eos_token_ids)
        self.cohort_hidden = CohortHiddenStates()
        self.block_tables = BlockTableRows(config.max_num_seqs, -(-max_model_len // config.block_size),
                                           windowed=bool(model_config.kv_window))
        logger.info("model %s on %s (%s): %d KV blocks of %d tokens", model_config.name, self.device,
                    config.dtype, self.num_blocks, config.block_size)

    @property
    def layered_hidden_bytes(self) -> int:
        """Memory held by prompts in flight between layer groups."""
        return self.cohort_hidden.num_bytes

    def profile_memory(self, before: MemorySnapshot | None, max_model_len: int) -> int | None:
        """The KV budget gpu_memory_utilization leaves after `profile_step` (bytes); None without
        a baseline (the CPU, or a cache sized by the config). See megainfer/runner/memory_profile.py."""
        if before is None:
            return None
        found = memory_profile.profile(memory_profile.CudaMemory(self.device), before, self.profile_step,
                                       self.config.gpu_memory_utilization)
        return memory_profile.kv_budget_bytes(found, self.config.min_kv_cache_bytes(self.model_config, max_model_len))

    @torch.inference_mode()
    def profile_step(self) -> None:
        """The largest step the engine schedules, through every layer and the sampler, over a
        scratch KV cache: what `profile_memory` measures. Keeps nothing, samples with a sampler
        of its own: the runner's state is as before."""
        inputs, cache, last_rows = profile_inputs(self.model_config, self.config, self.device, self.dtype)
        fwd = self.model(*inputs[:2], [cache] * self.model_config.num_layers, inputs[2])
        profile_sampling(self.model.compute_logits(fwd.hidden[last_rows]), self.config.seed,
                         self.model_config.eos_token_ids)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> StepResult:
        layout = StepLayout.of(out, 1)
        self.cohort_hidden.forget_departed(out.all_seqs, layout)
        self.block_tables.retain(out.all_seqs)
        if layout.has_cohort:
            return self._execute_layered(out, layout)
        input_ids, positions, batch = self._prepare(out)
        fwd = self.model(input_ids, positions, self.kv_caches, batch)
        # One micro-batch without a cohort: every row is a decode row of fwd.hidden (normed).
        result = sample_rows(self.model.compute_logits, lambda j, in_cohort: fwd.hidden, self.sampler,
                             out.all_seqs, layout)
        result.expert_counts = fwd.expert_counts.cpu().numpy()
        return result

    def _execute_layered(self, out: SchedulerOutput, layout: StepLayout) -> StepResult:
        """Decodes through every layer; the cohort's chunks through this step's layer group only,
        entering from the embedding (first group) or from where the last step left them."""
        cfg = self.model_config
        seqs = out.all_seqs
        state = MicroBatchState.prepare(self.model, seqs, layout, layout.micro_batches[0], self.cohort_hidden,
                                        self.config.block_size, self.device, self.block_tables)
        # Summed on the device and read once, after sampling: no host sync inside a layer.
        expert_counts = torch.zeros(cfg.num_layers, cfg.num_experts, dtype=torch.int64, device=self.device)
        for layer in range(cfg.num_layers):
            state.cross(layout, layer)
            if state.hidden is None:
                continue
            _, positions, batch = state.inputs_at(layout, layer)
            state.hidden, counts = self.model.layer(layer, state.hidden, positions, self.kv_caches[layer], batch)
            expert_counts[layer] += counts
        state.cross(layout, cfg.num_layers)
        self.cohort_hidden.keep(seqs, layout, state)
        result = sample_step(self.model, self.sampler, seqs, layout, [state])
        result.expert_counts = expert_counts.cpu().numpy()
        return result

    def _prepare(self, out: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, kernels.PagedAttentionBatch]:
        return prepare_batch(out.seqs, out.num_scheduled_tokens, out.num_single_token, self.config.block_size,
                             self.device, self.block_tables)


BatchInputs = tuple[torch.Tensor, torch.Tensor, kernels.PagedAttentionBatch]  # input ids, positions, metadata


def device_and_dtype(config: EngineConfig) -> tuple[torch.device, torch.dtype]:
    """A runner's device and dtype from its (resolved) config; its CPU threads set where asked."""
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    return torch.device(config.device), getattr(torch, config.dtype)


class CohortHiddenStates:
    """Layered prefill: each cohort member's hidden states between two of its layer groups, by
    request id (a tensor-parallel follower rank names members by the leader's key)."""

    def __init__(self) -> None:
        self.by_request: dict[str, torch.Tensor] = {}

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.by_request.values())

    def forget_departed(self, seqs: list, layout: StepLayout) -> None:
        """Drop members that left the cohort (preempted, aborted) since the last step."""
        if not self.by_request:  # no cohort in flight (every step without layered prefill)
            return
        members = {seqs[i].request_id for batch in layout.micro_batches for i in batch.cohort_sequences}
        for request_id in list(self.by_request):
            if request_id not in members:
                del self.by_request[request_id]

    def entering(self, model: MoEModel, seqs: list, layout: StepLayout, batch: MicroBatchLayout,
                 combined: BatchInputs | None) -> torch.Tensor | None:
        """A micro-batch's cohort rows as they enter this step's group: embedded in the first
        group, else as the previous group left them. None when it carries no cohort member."""
        if not batch.cohort_sequences:
            return None
        if layout.cohort_join_layer == 0:
            return model.embed(combined[0][batch.num_decode_rows:])
        return torch.cat([self.by_request[seqs[i].request_id] for i in batch.cohort_sequences])

    def keep(self, seqs: list, layout: StepLayout, state: MicroBatchState) -> None:
        """After the step: keep each member's rows for its next group; after its last group, let
        them go."""
        for i, (begin, end) in zip(state.layout.cohort_sequences, state.layout.cohort_row_ranges):
            request_id = seqs[i].request_id
            if layout.cohort_last_group:
                self.by_request.pop(request_id, None)
            else:
                self.by_request[request_id] = state.cohort[begin:end]


@dataclass
class MicroBatchState:
    """One micro-batch's tensors through a step: the runner's side of a `MicroBatchLayout`."""

    layout: MicroBatchLayout
    decode_inputs: BatchInputs | None  # the decode-only batch; None when the micro-batch has no decodes
    combined_inputs: BatchInputs | None  # decodes + cohort, run inside the group; decode_inputs without a cohort
    hidden: torch.Tensor | None  # rows passing the current layer: the decodes, plus the cohort inside its group
    cohort: torch.Tensor | None  # the cohort's rows while outside its group (before it joins, after it leaves)

    @classmethod
    def prepare(cls, model: MoEModel, seqs: list, layout: StepLayout, batch: MicroBatchLayout,
                cohort_hidden: CohortHiddenStates, block_size: int, device: torch.device,
                tables: BlockTableRows | None = None) -> "MicroBatchState":
        """Inputs of both batches, the decodes' embeddings and the cohort's entering rows."""
        decode = prepare_rows(seqs, layout, batch.decode_sequences, block_size, device, tables)
        combined = prepare_rows(seqs, layout, batch.sequences, block_size, device, tables) \
            if batch.cohort_sequences else decode
        hidden = model.embed(decode[0]) if decode is not None else None
        return cls(batch, decode, combined, hidden, cohort_hidden.entering(model, seqs, layout, batch, combined))

    def inputs_at(self, layout: StepLayout, layer: int) -> BatchInputs | None:
        """The batch `hidden` is at `layer`: the combined one inside the cohort's group."""
        inside = self.layout.cohort_sequences and layout.cohort_inside(layer)
        return self.combined_inputs if inside else self.decode_inputs

    def cross(self, layout: StepLayout, layer: int) -> None:
        """Before `layer` (or after the last, with layer = the layer count): the cohort's rows
        leave the decodes at its group's end layer and join them at its first layer."""
        if not self.layout.cohort_sequences:
            return
        if layer == layout.cohort_leave_layer:
            decode_rows = self.layout.num_decode_rows
            self.cohort = self.hidden[decode_rows:]
            self.hidden = self.hidden[:decode_rows] if decode_rows else None
        if layer == layout.cohort_join_layer:
            self.hidden = self.cohort if self.hidden is None else torch.cat([self.hidden, self.cohort])


def prepare_rows(seqs: list, layout: StepLayout, indices: tuple[int, ...], block_size: int,
                  device: torch.device, tables: BlockTableRows | None) -> BatchInputs | None:
    """`prepare_batch` of the step's sequences at these sequence indices; None for none."""
    if not indices:
        return None
    counts = [layout.num_tokens[i] for i in indices]
    return prepare_batch([seqs[i] for i in indices], counts, counts.count(1), block_size, device, tables)


# A micro-batch's rows after the last layer: final(micro_batch, in_cohort) -> its decode rows
# (in_cohort False) or its cohort rows (True).
FinalRows = Callable[[int, bool], torch.Tensor]


def samples_by_micro_batch(seqs: list, layout: StepLayout) -> bool:
    """Whether a step's tokens may be sampled micro-batch by micro-batch, each as its last layer
    ends (`greedy_rows`): a plain decode step whose every row is greedy-only, so the tokens
    are the argmax of rows that need nothing of the others, whatever batch computes them."""
    return layout.every_row_samples and all(map(_GREEDY_ONLY, seqs))


def greedy_rows(model: MoEModel, sampler: Sampler, hidden: torch.Tensor) -> list[int]:
    """The greedy tokens of final hidden states (not yet normed), one per row."""
    return sampler.greedy(model.compute_logits(model.norm(hidden)))


def sample_step(model: MoEModel, sampler: Sampler, seqs: list, layout: StepLayout,
                states: list[MicroBatchState]) -> StepResult:
    """Sample the step's sampling rows from the micro-batches' final hidden states (not yet
    normed), with the logprobs asked for. The expert counts are left to the caller."""
    return sample_rows(lambda hidden: model.compute_logits(model.norm(hidden)),
                       lambda j, in_cohort: states[j].cohort if in_cohort else states[j].hidden,
                       sampler, seqs, layout)


def sample_rows(to_logits: Callable[[torch.Tensor], torch.Tensor], final: FinalRows, sampler: Sampler, seqs: list,
                layout: StepLayout) -> StepResult:
    """The one sampling path of every runner: the sampled rows' tokens (and logprobs where
    asked) and the prompt logprobs of the prompt rows this step completed, from the rows'
    final hidden states; `to_logits` turns such rows into float32 logits. Expert counts empty."""
    result = StepResult([None] * layout.num_sequences, [])
    if layout.sampled_sequences:
        logits = to_logits(_gather_rows(final, layout))
        result.sampled, result.logprobs = sample_tokens(sampler, logits, seqs, layout)
    for rows in prompt_logprob_rows(seqs, layout):
        result.prompt_logprobs[rows.sequence] = (rows.first_position, _prompt_logprobs(to_logits, final, seqs, rows))
    return result


def _gather_rows(final: FinalRows, layout: StepLayout) -> torch.Tensor:
    """The hidden states of the sampled rows, in order: in a plain decode step every micro-batch's
    rows as they are; else one gather per run of rows from the same micro-batch's decode or
    cohort rows, none where a run is all of them."""
    if layout.every_row_samples:
        parts = [final(j, False) for j, batch in enumerate(layout.micro_batches) if batch.decode_sequences]
    else:
        parts = [_index(final(*source), list(map(_ROW, run)))
                 for source, run in groupby(layout.sampled_rows, key=_SOURCE)]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _index(hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
    if len(rows) == hidden.shape[0] and rows[0] == 0 and rows[-1] == len(rows) - 1:  # ascending: every row
        return hidden
    return hidden[torch.tensor(rows, device=hidden.device)]


_SOURCE = attrgetter("micro_batch", "in_cohort")
_ROW = attrgetter("row")
_GREEDY_ONLY = attrgetter("greedy_only")


def sample_tokens(sampler: Sampler, logits: torch.Tensor, seqs: list,
                  layout: StepLayout) -> tuple[list[int | None], dict[int, PositionLogprobs]]:
    """Tokens from `logits` (one row per sampled row, in order), placed by sequence index, and
    the logprobs of those that asked, by sequence index (from the raw logits)."""
    owners = list(map(seqs.__getitem__, layout.sampled_sequences))
    if all(map(_GREEDY_ONLY, owners)):  # the common case: one argmax, nothing read per row
        return layout.place_samples(sampler.greedy(logits)), {}
    tokens = sampler.sample(logits, [s.request_id for s in owners], [s.params for s in owners], owners)
    wanted = [k for k, s in enumerate(owners) if s.params.logprobs is not None]
    logprobs = {}
    if wanted:
        entries = position_logprobs(logits[torch.tensor(wanted, device=logits.device)], [tokens[k] for k in wanted],
                                    [owners[k].params.logprobs for k in wanted])
        logprobs = {layout.sampled_sequences[k]: entry for k, entry in zip(wanted, entries)}
    return layout.place_samples(tokens), logprobs


@dataclass(frozen=True)
class PromptRows:
    """A sequence's rows this step that give prompt logprobs: row `begin + i` (of its micro-batch's
    decode or cohort rows) predicts the prompt token at position `first_position + i`."""

    sequence: int  # sequence index
    micro_batch: int
    in_cohort: bool
    begin: int
    end: int
    first_position: int


def prompt_logprob_rows(seqs: list, layout: StepLayout) -> list[PromptRows]:
    """The rows whose logits give prompt logprobs this step: those of prompt tokens (not the
    last, which samples) of sequences that ask and have not generated yet (a preempted one
    recomputing its prompt delivered them already), where the rows passed the last layer:
    every decode row, cohort rows in the cohort's last group only."""
    if all(s.params.prompt_logprobs is None for s in seqs):
        return []
    found = []

    def add(i: int, j: int, in_cohort: bool, first_row: int) -> None:
        seq = seqs[i]
        if seq.params.prompt_logprobs is None or seq.num_output_tokens:
            return
        computed = seq.num_computed_tokens
        end = min(computed + layout.num_tokens[i], seq.num_prompt_tokens - 1)
        if end > computed:
            found.append(PromptRows(i, j, in_cohort, first_row, first_row + end - computed, computed + 1))

    for j, batch in enumerate(layout.micro_batches):
        for i, start in zip(batch.decode_sequences, batch.decode_query_starts):
            add(i, j, False, start)
        if layout.cohort_last_group:
            for i, (start, _) in zip(batch.cohort_sequences, batch.cohort_row_ranges):
                add(i, j, True, start)
    return found


def _prompt_logprobs(to_logits: Callable[[torch.Tensor], torch.Tensor], final: FinalRows, seqs: list,
                     rows: PromptRows) -> list[PositionLogprobs]:
    seq = seqs[rows.sequence]
    hidden = final(rows.micro_batch, rows.in_cohort)[rows.begin:rows.end]
    targets = seq.token_ids[rows.first_position:rows.first_position + rows.end - rows.begin]
    entries: list[PositionLogprobs] = []
    for begin in range(0, len(targets), PROMPT_LOGPROB_ROWS):
        chunk = targets[begin:begin + PROMPT_LOGPROB_ROWS]
        entries += position_logprobs(to_logits(hidden[begin:begin + len(chunk)]), chunk,
                                     [seq.params.prompt_logprobs] * len(chunk))
    return entries


def prepare_batch(seqs, num_tokens: list[int], num_single: int, block_size: int, device: torch.device,
                  tables: BlockTableRows | None = None) -> tuple[torch.Tensor, torch.Tensor, kernels.PagedAttentionBatch]:
    """Input ids, positions and attention metadata of `seqs`, each computing its next
    `num_tokens[i]` tokens (the first `num_single` with one token each). Array work: one pass
    over the sequences reads their counters and ids, numpy builds the rest; the block tables
    come from the runner's persistent rows (`tables`, updated with what changed) or, without
    them, are built here."""
    n = len(seqs)
    counts = np.asarray(num_tokens, dtype=np.int64)
    begins = np.fromiter(map(COMPUTED, seqs), np.int64, n)
    ends = begins + counts
    starts = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(counts, out=starts[1:])
    # Token ids into numpy, then a tensor: `torch.tensor` of a list of Python ints costs about
    # eight times as much (60 against 7 us for a 471-row micro-batch).
    if num_single == n:  # decodes: the one token after the computed ones (a C-level map: every decode, every step)
        token_ids = np.fromiter(map(getitem, map(TOKEN_IDS, seqs), begins.tolist()), np.int64, n)
    else:
        flat: list[int] = []
        for seq, b, e in zip(seqs, begins.tolist(), ends.tolist()):
            flat.extend(seq.token_ids[b:e])
        token_ids = np.asarray(flat, dtype=np.int64)
    # Position of each query token: its sequence's computed length plus its place in the query.
    seq_of_token = np.repeat(np.arange(n), counts)
    positions = np.arange(starts[-1]) - starts[:-1][seq_of_token] + begins[seq_of_token]

    def paged(rows: BlockTableRows | None, attr: str) -> kernels.PagedAttentionBatch:
        block_tables = _block_tables(seqs, rows, attr)
        slots = block_tables[seq_of_token, positions // block_size] * block_size + positions % block_size
        return kernels.PagedAttentionBatch(
            # int32, as the kernel warm-up's batches (kernels/startup.py): Triton builds one variant
            # per pointer type, and a second one here would be built mid-serving.
            block_tables=torch.from_numpy(block_tables.astype(np.int32)).to(device),
            seq_lens=lens, query_start_loc=query_start_loc,
            slot_mapping=torch.from_numpy(slots).to(device),
            num_single=num_single,
            seq_lens_host=ends.tolist(),
            query_start_host=starts.tolist(),
        )

    lens = torch.from_numpy(ends.astype(np.int32)).to(device)
    query_start_loc = torch.from_numpy(starts.astype(np.int32)).to(device)
    batch = paged(tables, "block_table")
    # A model with windowed layers: the same step through the sequences' window tables.
    if (tables.window is not None) if tables is not None else bool(n and getattr(seqs[0], "window_table", None)):
        batch.window_batch = paged(None if tables is None else tables.window, "window_table")
    return torch.from_numpy(token_ids).to(device), torch.from_numpy(positions).to(device), batch


def _block_tables(seqs, rows: BlockTableRows | None, attr: str) -> np.ndarray:
    """[n, widest] int64 the tables (`attr` of each sequence), zero past each one's blocks: from the
    runner's persistent rows where given, else built here."""
    if rows is not None:
        return rows.gather(seqs)[0]
    lists = [getattr(s, attr) for s in seqs]
    widths = np.fromiter(map(len, lists), np.int64, len(lists))
    block_tables = np.zeros((len(lists), max(int(widths.max()), 1)), dtype=np.int64)
    block_tables[np.arange(block_tables.shape[1]) < widths[:, None]] = np.fromiter(
        chain.from_iterable(lists), np.int64, int(widths.sum()))
    return block_tables


def load_and_size(runner, build: Callable[[], MoEModel], weights: WeightSource, max_model_len: int,
                  tp_group: TensorParallelGroup | None = None, spare_blocks: int = 0) -> None:
    """A runner's model and KV cache, in the one order that works: the memory baseline, the model
    (`build()`) with its weights, every kernel variant built and every shape's implementation
    decided (before serving, and before the memory profile, whose largest step then runs what
    serving will run), the profile (`runner.profile_memory`, which runs `runner.model`), then the
    KV cache in what it leaves (a tensor-parallel node's ranks agree on the block count). Sets
    `runner.model`, `kernels`, `num_blocks` and `kv_caches` (with `spare_blocks` more blocks
    than `num_blocks`, past them, for the runner's own use)."""
    config = runner.config
    before = memory_profile.baseline(runner.device) if config.sizes_kv_from_memory else None
    runner.model = build()
    with torch.inference_mode():
        runner.model.load_weights(weights, show_progress=config.show_progress)
    warmup = warm_up_engine(runner.model, config, max_model_len)
    kv_budget = runner.profile_memory(before, max_model_len)
    runner.kernels = warmup.finish()
    runner.num_blocks, runner.kv_caches = allocate_kv_caches(runner.model_config, config, max_model_len, runner.device,
                                                             tp_group, kv_budget, spare_blocks)


def allocate_kv_caches(model_config: ModelConfig, config: EngineConfig, max_model_len: int, device: torch.device,
                       tp_group: TensorParallelGroup | None = None, kv_budget_bytes: int | None = None,
                       spare_blocks: int = 0) -> tuple[int, list[tuple[torch.Tensor, torch.Tensor]]]:
    """(blocks, per-layer (K, V) caches of [blocks, block_size, this rank's KV heads, head_dim]);
    the block count comes from the config, else from `kv_budget_bytes` (what the memory
    profile left, megainfer/runner/memory_profile.py; the ranks of a tensor-parallel node agreed on
    it, so they all hold the same blocks: the leader's scheduler allocates block ids for every
    rank), else the CPU's default budget. `spare_blocks`: blocks past the counted ones, which the
    scheduler never hands out."""
    tp_size = 1 if tp_group is None else tp_group.size
    num_blocks = config.resolved_num_kv_blocks(model_config, max_model_len, kv_budget_bytes, tp_size)
    dtype = getattr(torch, config.dtype)
    shape = (num_blocks + spare_blocks, config.block_size, *kv_cache_heads(model_config, tp_size))
    tensors = [_cache_pair(model_config, lambda: _zeroed(shape, dtype, device)) for _ in range(model_config.kv_cache_layers)]
    return num_blocks, [tensors[i] for i in kv_tensor_of_layer(model_config)]


def kv_cache_heads(model_config: ModelConfig, tp_size: int) -> tuple[int, int]:
    """(heads, values per head) of one rank's cache tensors: its share of the KV heads, or MLA's one
    latent head whole (every rank caches the latent, which all its heads read)."""
    heads, width = model_config.kv_cache_heads
    return (heads, width) if model_config.mla else (heads // tp_size, width)


def _cache_pair(model_config: ModelConfig, make) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's (keys, values): two tensors, or for MLA one, its values being its keys' first
    kv_lora_rank columns (latent_attention.py)."""
    keys = make()
    return (keys, keys) if model_config.mla else (keys, make())


def kv_tensor_of_layer(model_config: ModelConfig) -> list[int]:
    """Each layer's KV-cache tensor: its own, except where windowed and full-attention layers mix
    (ModelConfig.kv_cache_layers): there the i-th windowed layer and the i-th full one share
    tensor i, each indexing it through its own block table, so their blocks never overlap."""
    if model_config.kv_cache_layers == model_config.num_layers:
        return list(range(model_config.num_layers))
    windowed = set(model_config.window_layers)
    seen = {True: 0, False: 0}
    index = []
    for layer in range(model_config.num_layers):
        kind = layer in windowed
        index.append(seen[kind])
        seen[kind] += 1
    return index


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


# Every sampling option on, so the profiling step meets the sampler's largest working set.
PROFILE_SAMPLING = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, min_p=0.05, repetition_penalty=1.1,
                                  presence_penalty=0.1, frequency_penalty=0.1, logprobs=MAX_LOGPROBS)


def profile_inputs(model_config: ModelConfig, config: EngineConfig, device: torch.device, dtype: torch.dtype,
                   tp_size: int = 1) -> tuple[BatchInputs, tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The largest step the scheduler forms, for the profiling step: config.max_step_tokens tokens
    over as many sequences as max_num_seqs lets them be (one token each, the last one the
    rest: the most rows to sample), zero token ids, no context. Returns its inputs, a scratch
    (K, V) cache every layer and sequence write into (the KV cache does not exist yet), and
    the index of each sequence's last row."""
    tokens = config.max_step_tokens
    num_seqs = min(config.max_num_seqs, tokens)
    counts = [1] * (num_seqs - 1) + [tokens - num_seqs + 1]
    blocks = -(-counts[-1] // config.block_size)
    seqs = [SimpleNamespace(num_computed_tokens=0, token_ids=[0] * n,
                            block_table=list(range(-(-n // config.block_size)))) for n in counts]
    inputs = prepare_batch(seqs, counts, sum(1 for n in counts if n == 1), config.block_size, device)
    shape = (blocks, config.block_size, *kv_cache_heads(model_config, tp_size))
    cache = _cache_pair(model_config, lambda: torch.zeros(shape, dtype=dtype, device=device))
    last_rows = inputs[2].query_start_loc[1:].to(torch.int64) - 1
    return inputs, cache, last_rows


def profile_sampling(logits: torch.Tensor, seed: int, eos_token_ids) -> None:
    """Sample every row of `logits` with every option on, and take their logprobs: the sampler's
    largest working set. A sampler of its own: the runner's random streams stay untouched."""
    rows = logits.shape[0]
    history = SimpleNamespace(prompt_token_ids=[0], output_token_ids=[0])
    tokens = Sampler(seed, logits.device, eos_token_ids).sample(
        logits, [f"profile-{i}" for i in range(rows)], [PROFILE_SAMPLING] * rows, [history] * rows)
    position_logprobs(logits, tokens, [MAX_LOGPROBS] * rows)
