"""An attention node's runner: the attention halves here, the experts on expert nodes.

A step's sequences are split into `m` micro-batches (balanced by tokens). Layer by layer,
micro-batch j's expert results of layer l-1 are received and added to its residual
stream, its layer-l attention runs, and its routed tokens go out to the expert nodes;
then j+1. While the experts work on j, this node computes j+1: the ping-pong. Every step,
even an empty one, exchanges one message per (layer, micro-batch, expert node), so expert
nodes never wait on a node with nothing to say.

No host synchronisation inside a layer. A dispatch is one device buffer of records (every
expert node's tokens in node order, see expert_link.py) plus the node offsets, copied to
pinned memory on a copy stream (device_staging.py); it waits in the outbox while the host
launches the next micro-batch's work, and goes out once its copy has landed, when the host
first reads the offsets. The node offsets are the only counts the host needs, and they
arrive with the records; answers say their token counts in their headers. Answers enter the
device in one copy per micro-batch and are added with one `index_add_`. Tokens routed per
expert are summed on the device and read once per step. On the CPU the same code runs with
the copies elided.

Same `execute(SchedulerOutput) -> StepResult` as `ModelRunner`, so `Engine` drives it
unchanged; `steps_when_idle` tells the engine to step even with nothing scheduled.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

from megainfer import memory_profile
from megainfer.block_table_rows import BlockTableRows
from megainfer.config import ModelConfig
from megainfer.disagg import decode_graphs, step_sync
from megainfer.disagg.attention_dispatch import DispatchParts, attend_and_pack
from megainfer.disagg.device_slots import device_slots_for, land_round, round_mismatch
from megainfer.disagg.device_staging import ComputeTimer, DeviceStaging, HostCopy
from megainfer.disagg.expert_link import BUSY, FLAGS, LAYER, STEP, ExpertLink, record_bytes
from megainfer.disagg.staging_sizes import StagingBytes, answer_rows
from megainfer.disagg.latency import LatencyHistogram
from megainfer.disagg.node_timeline import Timeline
from megainfer.engine_config import EngineConfig
from megainfer.errors import DataPlaneError
from megainfer.messages import NodeRole, SpanKind
from megainfer.model.moe_model import MoEModel
from megainfer.model.weights import WeightSource
from megainfer.memory_profile import MemorySnapshot
from megainfer.model_runner import (CohortHiddenStates, MicroBatchState, StepHooks, StepResult, greedy_rows,
                                    load_and_size, profile_inputs, profile_sampling, sample_step,
                                    samples_by_micro_batch)
from megainfer.sampler import Sampler
from megainfer.scheduler import SchedulerOutput
from megainfer.step_layout import LayoutAhead, StepLayout
from megainfer.tensor_parallel import TensorParallelGroup

logger = logging.getLogger(__name__)


@dataclass
class PendingDispatch:
    """One (layer, micro-batch)'s routed tokens on their way to the host, not yet sent."""

    layer: int
    micro_batch: int
    # records [rows, record bytes] uint8 (not where every expert node takes device slots) and node
    # offsets [N + 1]; None: no tokens
    copy: HostCopy | None = None
    token_ids: torch.Tensor | None = None  # [rows] device: the tokens of the records, in send order
    node_offsets: torch.Tensor | None = None  # [N + 1] device: where each expert node's records begin
    records: torch.Tensor | None = None  # [rows, record bytes] device, where some expert node takes device slots
    records_ready: torch.cuda.Event | None = None  # CUDA: recorded on the compute stream after `records`

    def landed(self) -> bool:
        return self.copy is None or self.copy.landed()


@dataclass
class RoutedTokens:
    """What one (layer, micro-batch)'s dispatch sent the expert nodes: the answers' destination."""

    layer: int
    rows: torch.Tensor  # device indices of the tokens sent (this rank's share), expert-node order
    counts: np.ndarray  # int64 [N]: how many each expert node got


def rank_shares(bounds: np.ndarray, tp_size: int, tp_rank: int) -> tuple[np.ndarray, np.ndarray]:
    """[begin, end) of each expert node's tokens this rank carries, from the node offsets [N + 1]:
    `rank_share` of every node at once."""
    if tp_size == 1:
        return bounds[:-1], bounds[1:]
    base, extra = np.divmod(np.diff(bounds), tp_size)
    begins = bounds[:-1] + tp_rank * base + np.minimum(tp_rank, extra)
    return begins, begins + base + (tp_rank < extra)


def shared_positions_on(node_offsets: torch.Tensor, tp_size: int, tp_rank: int, total: int) -> torch.Tensor:
    """The positions [begin, end) of every node's share (`rank_shares`), end to end (what a
    rank's answers come back as), computed on the node offsets' device: device ops
    only (`total`, the rank's token count, is known on the host, so repeat_interleave needs no
    read back), where copying host-built positions to the device would wait for the copy."""
    offsets = node_offsets.to(torch.int64)
    counts = offsets[1:] - offsets[:-1]
    base, extra = counts // tp_size, counts % tp_size
    share = base + (extra > tp_rank).to(torch.int64)
    begins = offsets[:-1] + tp_rank * base + extra.clamp(max=tp_rank)
    starts = torch.cumsum(share, 0) - share
    return torch.arange(total, device=offsets.device) + torch.repeat_interleave(begins - starts, share,
                                                                                output_size=total)


def expert_node_map(num_experts: int, expert_nodes: list[str], expert_assignment: list[list[int]]) -> torch.Tensor:
    """[num_experts] int64: the index of the expert node each expert lives on."""
    if len(expert_nodes) != len(expert_assignment):
        raise ValueError("one expert-id list per expert node")
    node_of = torch.full((num_experts,), -1, dtype=torch.int64)
    for k, ids in enumerate(expert_assignment):
        node_of[ids] = k
    if (node_of < 0).any():
        raise ValueError(f"experts {(node_of < 0).nonzero().flatten().tolist()} are on no expert node")
    return node_of


class PipelinedModelRunner:
    steps_when_idle = True

    def __init__(self, model_config: ModelConfig, config: EngineConfig, weights: WeightSource, max_model_len: int,
                 *, link: ExpertLink, expert_nodes: list[str], expert_assignment: list[list[int]],
                 micro_batches: int, tp_group: TensorParallelGroup | None = None,
                 staging_bytes: StagingBytes | int = 0, name: str = "attention", device_slot_bytes: int = 0) -> None:
        """With a `tp_group` this is one rank of a tensor-parallel node: rank 0 schedules and
        samples and sends each step to the others; every rank runs its heads and dispatches its
        share of the routed tokens. `staging_bytes`: pinned host memory reserved up front per micro-
        batch and direction on CUDA, for the largest messages (0: allocated as the first steps need it).
        `device_slot_bytes`: the largest answer one expert node sends in a (layer, micro-batch);
        non-zero: answers and dispatches go straight between the devices of expert nodes on this
        host that use them too (device_slots.py; tensor-parallel size 1 only)."""
        self.model_config = model_config
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = getattr(torch, config.dtype)
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.link = link
        self.expert_nodes = list(expert_nodes)
        self.peers = tuple(expert_nodes)  # every round goes to all of them, in this order
        self.answer_row_bytes = model_config.hidden_size * self.dtype.itemsize
        self.record_size = record_bytes(model_config.hidden_size, model_config.top_k, self.dtype)
        self.m = micro_batches
        node_of = expert_node_map(model_config.num_experts, expert_nodes, expert_assignment).to(self.device)
        self.tp_group = tp_group
        self.tp_rank, self.tp_size = tp_rank, tp_size = (0, 1) if tp_group is None else (tp_group.rank, tp_group.size)
        capture = decode_graphs.decode_capture(self.device, config.enforce_eager, name)
        # Each rank caches its own KV heads; all ranks agree on the block count (with CUDA graphs
        # one more, past the scheduler's, for the padding rows: decode_graphs.py).
        load_and_size(self, lambda: self._attention_model(max_model_len, node_of), weights, max_model_len, tp_group,
                      spare_blocks=int(capture is not None))
        self.decode_graphs = self._capture(capture, max_model_len)
        self.sampler = Sampler(config.seed, self.device, model_config.eos_token_ids)
        self.staging = DeviceStaging(self.device, micro_batches, staging_bytes)
        for buffer in self.staging.send_buffers():
            link.register(buffer)
        self.slots = device_slots_for(name, self.peers, self.device, micro_batches, device_slot_bytes, tp_size)
        self._slots_wired = False  # offers traded with this wiring's expert nodes
        self.step_id = 0
        self.deployment_busy = False  # did any attention node send tokens in the last step?
        self.cohort_hidden = CohortHiddenStates()  # layered prefill: the cohort between its groups
        self.block_tables = BlockTableRows(config.max_num_seqs, -(-max_model_len // config.block_size))
        self.layouts = LayoutAhead()  # the next step's layout, worked out while this one runs
        self._outbox: deque[PendingDispatch] = deque()  # dispatches copying to the host, oldest first
        self._routed: list[RoutedTokens | None] = [None] * micro_batches  # per micro-batch: its last dispatch sent
        self._no_records = torch.empty(0, dtype=torch.uint8)  # an empty step's dispatch
        # Seconds, summed over steps: "attention" is device time of the attention halves (CUDA events;
        # wall time on the CPU); "send" the host's time getting dispatches out (waiting for their
        # copies included); "wait_experts" its time waiting for answers.
        self.timing = {"attention": 0.0, "send": 0.0, "wait_experts": 0.0}
        self.attention_timer = ComputeTimer(self.device)
        # Per round, for the metrics endpoint: posting a dispatch to every expert node, and the
        # wait for all their answers.
        self.m2n = {"send": LatencyHistogram(), "receive_wait": LatencyHistogram()}
        # When each (layer, micro-batch) ran and waited, and each message left and arrived (off
        # until `bench pipeline` switches it on). The node loop records the steps themselves.
        self.timeline = Timeline(name, NodeRole.ATTENTION, self.device)
        self.step_tokens = (0, 0)  # the last step's tokens and, of them, prompt tokens
        self._compute_mark = None  # where the running (layer, micro-batch)'s compute began

    def _capture(self, capture: decode_graphs.Capture | None, max_model_len: int) -> decode_graphs.AttentionGraphs | None:
        """Decode's graphs, every (layer, micro-batch, size) (decode_graphs.py); None: eager. Sets
        `expert_counts`, the step's tokens routed to each expert of each layer, which the graphs
        add to (so it lives as long as they do)."""
        cfg = self.model_config
        self.expert_counts = torch.zeros(cfg.num_layers, cfg.num_experts, dtype=torch.int64, device=self.device)
        if capture is None:
            self.kernels = dataclasses.replace(self.kernels, decode=decode_graphs.eager_reason(
                self.device, self.config.enforce_eager))
            return None
        sizes = decode_graphs.capture_sizes(-(-self.config.max_num_seqs // self.m), self.config.cuda_graph_sizes)
        graphs = decode_graphs.AttentionGraphs(
            self.model, self.kv_caches, self.expert_counts, sizes, self.m, -(-max_model_len // self.config.block_size),
            self.config.block_size, self.num_blocks, len(self.expert_nodes), self.record_size, self.tp_size)
        with torch.inference_mode():
            report = decode_graphs.capture_timed(graphs, capture, self.device)
        self.kernels = dataclasses.replace(self.kernels, decode=report.status())
        return graphs

    def _attention_model(self, max_model_len: int, node_of: torch.Tensor) -> MoEModel:
        """This rank's attention halves (its heads), routing tokens out per expert node."""
        model = MoEModel(self.model_config, self.dtype, self.device, max_model_len, with_experts=False,
                         tp_rank=self.tp_rank, tp_size=self.tp_size)
        for layer in model.attention_layers:
            layer.set_expert_nodes(node_of, len(self.expert_nodes))
        return model

    def profile_memory(self, before: MemorySnapshot | None, max_model_len: int) -> int | None:
        """The KV budget gpu_memory_utilization leaves this rank after `profile_step`, the least
        over the node's ranks (bytes); None without a baseline (the CPU, or a cache sized by the
        config). See megainfer/memory_profile.py."""
        if before is None:
            return None
        found = memory_profile.profile(memory_profile.CudaMemory(self.device), before, self.profile_step,
                                       self.config.gpu_memory_utilization)
        agreed = None if self.tp_size == 1 else self.tp_group.min_over_ranks(memory_profile.offered_budget(found))
        need = self.config.min_kv_cache_bytes(self.model_config, max_model_len, self.tp_size)
        return memory_profile.kv_budget_bytes(found, need, agreed)

    @torch.inference_mode()
    def profile_step(self) -> None:
        """The largest micro-batch through every layer's attention half, as a step runs it but with
        nothing sent: config.max_step_tokens tokens (one micro-batch may carry a whole step), its
        dispatch records packed, the most answer rows this rank can receive added back (zeros;
        all-reduced over a tensor-parallel node, as a step does), then the sampler on the leader.
        Writes a scratch KV cache only; keeps nothing; runs on every rank of a node at once."""
        cfg = self.model_config
        (ids, positions, batch), cache, last_rows = profile_inputs(cfg, self.config, self.device, self.dtype,
                                                                   self.tp_size)
        hidden = self.model.embed(ids)
        rows = answer_rows(hidden.shape[0], cfg.top_k, len(self.expert_nodes), self.tp_size)
        counts = torch.zeros(cfg.num_experts, dtype=torch.int64, device=self.device)
        for layer in self.model.attention_layers:
            parts = attend_and_pack(layer, self.model.rotary, cache, hidden, positions, batch, counts, self.tp_size)
            answered = parts.token_ids[:rows]
            answers = torch.zeros(answered.numel(), cfg.hidden_size, dtype=self.dtype, device=self.device)
            y = torch.zeros_like(parts.residual).index_add_(0, answered, answers)
            if self.tp_size > 1:
                self.tp_group.all_reduce(y)
            hidden = parts.residual + y
            del parts, answers, y  # freed before the next layer's, as the step's outbox drains
        if self.tp_rank == 0:
            profile_sampling(self.model.compute_logits(self.model.norm(hidden[last_rows])), self.config.seed,
                             cfg.eos_token_ids)

    takes_step_hooks = True  # the engine may schedule asynchronously (`StepHooks`)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, hooks: StepHooks | None = None) -> StepResult:
        if self.tp_size > 1:
            step_sync.broadcast_step(self.tp_group, out)  # the follower ranks run the same step
        return self._run(out, hooks)

    @torch.inference_mode()
    def execute_follower(self) -> None:
        """A follower rank's step: the leader's batch, this rank's heads, no sampling."""
        out = step_sync.receive_step(self.tp_group)
        start, step = time.perf_counter(), self.step_id
        self._run(out)
        self.record_step(step, start)

    def record_step(self, step: int, start: float) -> None:
        """The timeline's STEP span of step `step`, begun at `start` (the node loop's clock)."""
        self.timeline.span(SpanKind.STEP, step, -1, -1, start, time.perf_counter(), *self.step_tokens)

    def _run(self, out: SchedulerOutput, hooks: StepHooks | None = None) -> StepResult:
        """Every micro-batch through every layer, ping-ponging with the expert nodes. With layered
        prefill, micro-batch j also carries its share of the cohort inside this step's layer
        group: it joins j's tokens at the group's first layer and leaves after its last."""
        layout = self.layouts.of(out, self.m)
        seqs = out.all_seqs
        self.step_tokens = (out.total_tokens, out.total_tokens - out.num_single_token)
        self.cohort_hidden.forget_departed(seqs, layout)
        self.block_tables.retain(seqs)
        states: list[MicroBatchState | None] = [None] * self.m  # each prepared just before its first layer
        # A plain greedy decode step samples each micro-batch as its last answers arrive, while
        # the expert nodes still work on the later ones (the leader: followers do not sample).
        early = [] if not self.tp_rank and samples_by_micro_batch(seqs, layout) else None
        expert_counts = self._pass_layers(layout, states, seqs, early, hooks or StepHooks())
        # Every rank keeps the cohort's hidden states for the next group (followers too: each
        # rank's attention needs them whole); after the last group, completed prompts sample.
        for state in states:
            self.cohort_hidden.keep(seqs, layout, state)
        if self.tp_rank:  # followers: the leader samples
            return StepResult([None] * layout.num_sequences, [])
        result = StepResult(layout.place_samples(early), []) if early is not None else \
            sample_step(self.model, self.sampler, seqs, layout, states)
        result.expert_counts = expert_counts.cpu().numpy()  # the step's one read of the counts
        self.timeline.end_step()
        return result

    def _pass_layers(self, layout: StepLayout, states: list[MicroBatchState | None], seqs: list,
                     early: list[int] | None, hooks: StepHooks) -> torch.Tensor:
        """The ping-pong: per layer, each micro-batch takes its expert answers of the layer
        before, then runs this layer's attention and dispatches. Returns tokens routed to each
        expert, [layer, expert], on the device. Micro-batch j's inputs are prepared (into
        `states[j]`) right before its first layer: the expert nodes, idle between steps, get
        micro-batch 0's dispatch without waiting for the others' inputs, which are built while
        they work on it."""
        cfg = self.model_config
        residual: list[torch.Tensor | None] = [None] * self.m
        expert_counts = self.expert_counts.zero_()
        self._busy = False
        if self.slots is not None and not self._slots_wired:
            self._wire_slots()
        self._outbox.clear()  # a failed step's dispatches are not this step's
        self._routed = [None] * self.m
        for layer in range(cfg.num_layers):
            for j, state in enumerate(states):
                if layer:
                    state.hidden = self._combine(layer - 1, j, residual[j])
                else:
                    states[j] = state = MicroBatchState.prepare(self.model, seqs, layout, layout.micro_batches[j],
                                                                self.cohort_hidden, self.config.block_size,
                                                                self.device, self.block_tables)
                    if self.decode_graphs is not None:  # a decode-only micro-batch replays graphs
                        self.decode_graphs.load(j, None if state.layout.cohort_sequences else state.decode_inputs,
                                                state.layout.num_decode_rows)
                state.cross(layout, layer)
                residual[j] = self._attend_and_dispatch(layer, j, state.hidden, state.inputs_at(layout, layer),
                                                        expert_counts)
            if not layer:  # every micro-batch's inputs built and its first layer under way:
                # the step before settled, the next one scheduled and laid out
                self.layouts.keep(hooks.run_lookahead(), self.m)
        for j, state in enumerate(states):
            state.hidden = self._combine(cfg.num_layers - 1, j, residual[j])
            state.cross(layout, cfg.num_layers)
            if early is not None and state.hidden is not None:  # `early`: this step's tokens, micro-batch by micro-batch
                early.extend(greedy_rows(self.model, self.sampler, state.hidden))
        self.timing["attention"] += self.attention_timer.collect()
        self.deployment_busy = self._busy
        self.step_id = (self.step_id + 1) & 0xFFFFFFFF
        return expert_counts

    def _attend_and_dispatch(self, layer: int, j: int, hidden, inp, expert_counts: torch.Tensor):
        """Launch micro-batch j's attention half of `layer` and the copy of its routed tokens to
        the host; the dispatch leaves once that copy has landed. Returns the residual stream."""
        mark, self._compute_mark = self._compute_mark, None
        if hidden is None:
            self._outbox.append(PendingDispatch(layer, j))
            self._flush_landed()
            return None
        if mark is None:  # layer 0: no answers came before
            mark = self.timeline.compute_start()
        self.attention_timer.start()
        parts = self._attend(layer, j, hidden, inp, expert_counts)
        self.attention_timer.stop()
        records, node_offsets, token_ids = parts.records, parts.node_offsets, parts.token_ids
        direct = self.slots is not None and self.slots.any_direct
        ready = torch.cuda.current_stream(self.device).record_event() if direct and self.staging.on_cuda else None
        if direct and self.slots.direct.all():  # the records go device to device: only the offsets to the host
            copy = self.staging.to_host([node_offsets], slot=j)
        else:
            copy = self.staging.to_host([records, node_offsets], slot=j)
        self._outbox.append(PendingDispatch(layer, j, copy, token_ids, node_offsets, records if direct else None,
                                            ready))
        self._flush_landed()
        self.timeline.compute_end(mark, self.step_id, layer, j, hidden.shape[0])
        return parts.residual

    def _attend(self, layer: int, j: int, hidden: torch.Tensor, inp, expert_counts: torch.Tensor) -> DispatchParts:
        """Micro-batch j's attention half of `layer`: its graph where this step loaded one, else eager."""
        graphs = self.decode_graphs
        if graphs is not None and graphs.active[j] is not None:
            return graphs.run(layer, j, hidden)
        _, positions, batch = inp
        return attend_and_pack(self.model.attention_layers[layer], self.model.rotary, self.kv_caches[layer], hidden,
                               positions, batch, expert_counts[layer], self.tp_size)

    def _flush_landed(self) -> None:
        """Send, oldest first, every dispatch whose copy has reached the host; never waits."""
        while self._outbox and self._outbox[0].landed():
            self._send_dispatch(self._outbox.popleft())

    def _flush_through(self, layer: int, j: int) -> RoutedTokens:
        """Send (layer, j)'s dispatch and every older one, waiting for their copies: its answers
        cannot come before it leaves."""
        while (routed := self._routed[j]) is None or routed.layer != layer:
            if not self._outbox:
                raise RuntimeError(f"no dispatch of layer {layer}, micro-batch {j} to combine")
            self._send_dispatch(self._outbox.popleft())
        return routed

    def _send_dispatch(self, pending: PendingDispatch) -> None:
        """Every expert node's records, this rank's share of them, in one round: a contiguous
        byte range of the records buffer each."""
        t0 = time.perf_counter()
        layer, j = pending.layer, pending.micro_batch
        if pending.copy is None:
            records, bounds = self._no_records, np.zeros(len(self.peers) + 1, dtype=np.int64)
        else:
            *parts, offsets = pending.copy.wait()
            records = parts[0] if parts else self._no_records
            bounds = offsets.numpy()  # pinned host memory, landed: no device access
        begins, ends = rank_shares(bounds, self.tp_size, self.tp_rank)
        counts = ends - begins
        row = self.record_size
        try:
            if self.slots is not None and self.slots.any_direct:
                if pending.records is not None:
                    self.slots.write(j, pending.records.view(-1), begins * row, ends * row, ready=pending.records_ready)
                host_begins, host_ends = self.slots.host_ranges(begins * row, ends * row)
                self.link.post_round(self.peers, records, host_begins, host_ends, counts, step=self.step_id,
                                     layer=layer, micro_batch=j)
            elif self.tp_size == 1:  # every node's records, end to end
                self.link.post_rows(self.peers, records, counts, row, step=self.step_id, layer=layer, micro_batch=j)
            else:
                self.link.post_round(self.peers, records, begins * row, ends * row, counts, step=self.step_id,
                                     layer=layer, micro_batch=j)
        except Exception as exc:
            raise DataPlaneError(f"cannot reach the expert nodes (layer {layer}): {exc}") from exc
        if pending.token_ids is None:
            rows = None
        elif self.tp_size == 1:  # the shares are the whole segments: the tokens sent are a prefix
            rows = pending.token_ids[:int(bounds[-1])]
        else:  # this rank's share of every node's segment, found on the device: no copy, no sync
            rows = pending.token_ids[shared_positions_on(pending.node_offsets, self.tp_size, self.tp_rank,
                                                         int(counts.sum()))]
        self._routed[j] = RoutedTokens(layer, rows, counts)
        if self.timeline.enabled:
            for tokens in counts.tolist():
                self.timeline.instant(SpanKind.SEND, self.step_id, layer, j, tokens)
        elapsed = time.perf_counter() - t0
        self.m2n["send"].observe(elapsed)
        self.timing["send"] += elapsed

    def reset(self) -> None:
        """After the deployment re-wired: every node starts again from step 0."""
        self.step_id = 0
        self.deployment_busy = False
        self._outbox.clear()
        self._slots_wired = False  # new peers, perhaps: offers are traded again at the first step

    def _wire_slots(self) -> None:
        """Trade device-slot offers with the expert nodes (the first round of a wiring)."""
        self.slots.exchange(self.link)
        self._slots_wired = True

    def _combine(self, layer: int, j: int, residual: torch.Tensor | None) -> torch.Tensor | None:
        """Micro-batch j's answers of `layer` added into its residual stream: gathered end to end
        into one host buffer, one copy to the device and one `index_add_` over every routed
        token, in expert-node order."""
        routed = self._flush_through(layer, j)
        waited = time.perf_counter()
        arrivals = self._receive(layer, j)
        self.timeline.span(SpanKind.WAIT, self.step_id, layer, j, waited, time.perf_counter())
        if layer + 1 < self.model_config.num_layers:  # the next layer's compute of j starts here
            self._compute_mark = self.timeline.compute_start()
        try:
            total = self._check_answers(arrivals, routed, layer, j)
            y = None
            if residual is not None:
                y = torch.zeros_like(residual)
                if total:
                    values = land_round(arrivals, j, self.answer_row_bytes, self.staging, self.slots)
                    y.index_add_(0, routed.rows, values.view(self.dtype).view(-1, y.shape[1]))
        finally:
            arrivals.release()  # gathered: the slots are free at once
        if y is None:
            return None
        if self.tp_size > 1:  # every rank added its share of the answers: sum them
            self.tp_group.all_reduce(y)
        return residual + y

    def _check_answers(self, arrivals, routed: RoutedTokens, layer: int, j: int) -> int:
        """The answers belong to (this step, `layer`) and carry the tokens sent; returns their
        total. Notes the BUSY flag."""
        k = round_mismatch(arrivals, self.step_id, layer, self.answer_row_bytes, self.slots, routed.counts)
        fields, counts = arrivals.fields, arrivals.token_counts
        if k >= 0:
            node = self.peers[k]
            if fields[k, STEP] != self.step_id or fields[k, LAYER] != layer:
                raise DataPlaneError(f"expert node {node} answered (step {fields[k, STEP]}, layer {fields[k, LAYER]}) "
                                     f"where (step {self.step_id}, layer {layer}) was due: the nodes are out of step")
            if counts[k] != routed.counts[k]:
                raise DataPlaneError(f"expert node {node} answered {counts[k]} tokens of layer {layer}, micro-batch "
                                     f"{j}, where {routed.counts[k]} were sent")
            raise DataPlaneError(f"expert node {node} answered {counts[k]} tokens of layer {layer} in "
                                 f"{arrivals.byte_lengths[k]} bytes, not {self.answer_row_bytes} per token")
        if not self._busy:
            self._busy = bool((fields[:, FLAGS] & BUSY).any())
        if self.timeline.enabled:
            for tokens in counts.tolist():
                self.timeline.instant(SpanKind.ARRIVE, self.step_id, layer, j, tokens)
        return int(counts.sum())

    def _receive(self, layer: int, j: int):
        """Every expert node's answer for (layer, j), one round; while it is awaited,
        dispatches whose copies land are sent."""
        t0, sending = time.perf_counter(), self.timing["send"]
        try:
            arrivals = None
            while arrivals is None and self._outbox:
                arrivals = self.link.poll_round(self.peers, micro_batch=j)
                if arrivals is None:
                    self._flush_landed()
            if arrivals is None:
                arrivals = self.link.collect_round(self.peers, micro_batch=j)
        except DataPlaneError:
            raise
        except Exception as exc:
            raise DataPlaneError(f"the expert nodes did not answer (layer {layer}): {exc}") from exc
        waited = time.perf_counter() - t0 - (self.timing["send"] - sending)  # dispatches sent meanwhile are "send"
        self.timing["wait_experts"] += waited
        self.m2n["receive_wait"].observe(waited)
        return arrivals
