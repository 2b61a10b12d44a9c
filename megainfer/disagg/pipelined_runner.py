"""An attention node's runner: the attention halves here, the experts on expert nodes.

A step's sequences are split into `m` micro-batches (balanced by tokens). Layer by layer,
micro-batch j's expert results of layer l-1 are received and added to its residual
stream, its layer-l attention runs, and its routed tokens go out to the expert nodes;
then j+1. While the experts work on j, this node computes j+1: the ping-pong. Every step,
even an empty one, exchanges one message per (layer, micro-batch, expert node), so expert
nodes never wait on a node with nothing to say.

No host synchronisation inside a layer: the rounds with the expert nodes (dispatches through an
outbox, answers added into the residual stream) are expert_exchange.py's. Tokens routed per
expert are summed on the device and read once per step. On the CPU the same code runs with
the copies elided.

Same `execute(SchedulerOutput) -> StepResult` as `ModelRunner`, so `Engine` drives it
unchanged; `steps_when_idle` tells the engine to step even with nothing scheduled.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import torch

from megainfer.config import ModelConfig
from megainfer.disagg import decode_graphs, step_sync
from megainfer.disagg.attention_halves import AttentionHalves
from megainfer.disagg.attention_profile import attention_kv_budget, profile_attention_step
from megainfer.disagg.device_staging import ComputeTimer
from megainfer.disagg.expert_exchange import ExpertExchange
from megainfer.disagg.expert_link import ExpertLink, record_bytes
from megainfer.disagg.expert_load_round import PREFILL
from megainfer.disagg.expert_slot_maps import SlotMaps
from megainfer.disagg.node_timeline import Timeline
from megainfer.disagg.staging_sizes import StagingBytes
from megainfer.engine_config import EngineConfig
from megainfer.expert_replicas import ExpertReplicas
from megainfer.messages import NodeRole, SpanKind
from megainfer.model.moe_model import MoEModel
from megainfer.model.weights import WeightSource
from megainfer.runner.inputs_ahead import InputsAhead
from megainfer.runner.memory_profile import MemorySnapshot
from megainfer.runner.model_runner import (CohortHiddenStates, MicroBatchState, StepResult,
                                          device_and_dtype, greedy_rows, load_and_size, sample_step,
                                          samples_by_micro_batch)
from megainfer.runner.sampler import Sampler
from megainfer.runner.step_hooks import StepHooks
from megainfer.scheduling.block_table_rows import BlockTableRows
from megainfer.scheduling.scheduler_output import SchedulerOutput
from megainfer.scheduling.step_layout import LayoutAhead, StepLayout
from megainfer.tensor_parallel import TensorParallelGroup

logger = logging.getLogger(__name__)


class PipelinedModelRunner:
    steps_when_idle = True

    def __init__(self, model_config: ModelConfig, config: EngineConfig, weights: WeightSource, max_model_len: int,
                 *, link: ExpertLink, expert_nodes: list[str], replicas: ExpertReplicas,
                 micro_batches: int, tp_group: TensorParallelGroup | None = None,
                 staging_bytes: StagingBytes | int = 0, name: str = "attention", device_slot_bytes: int = 0,
                 movable_experts: bool = False) -> None:
        """With a `tp_group` this is one rank of a tensor-parallel node: rank 0 schedules and
        samples and sends each step to the others; every rank runs its heads and dispatches its
        share of the routed tokens. `staging_bytes`: pinned host memory reserved up front per micro-
        batch and direction on CUDA, for the largest messages (0: allocated as the first steps need it).
        `device_slot_bytes`: the largest answer one expert node sends in a (layer, micro-batch);
        non-zero: answers and dispatches go straight between the devices of expert nodes on this
        host that use them too (device_slots.py; tensor-parallel size 1 only). `replicas`: where
        each expert's slots live (megainfer/expert_replicas.py); `movable_experts`: they may move
        while serving (`slot_maps.switch_at`)."""
        self.model_config, self.config = model_config, config
        self.device, self.dtype = device_and_dtype(config)
        self.expert_nodes = list(expert_nodes)
        self.record_size = record_bytes(model_config.hidden_size, model_config.top_k, self.dtype)
        self.m = micro_batches
        replicas.check(model_config.num_experts, model_config.num_layers, len(expert_nodes))
        self.slot_maps = SlotMaps(replicas, model_config.num_experts, self.device, movable_experts)
        self.tp_group = tp_group
        self.tp_rank, self.tp_size = (0, 1) if tp_group is None else (tp_group.rank, tp_group.size)
        capture = decode_graphs.decode_capture(self.device, config.enforce_eager, name)
        # Each rank caches its own KV heads; all ranks agree on the block count (with CUDA graphs
        # one more, past the scheduler's, for the padding rows: decode_graphs.py).
        load_and_size(self, lambda: self._attention_model(max_model_len), weights, max_model_len, tp_group,
                      spare_blocks=int(capture is not None))
        self.attention_halves = self._attention_halves(capture, max_model_len)
        self.sampler = Sampler(config.seed, self.device, model_config.eos_token_ids)
        # Seconds, summed over steps: "attention" is device time of the attention halves (CUDA events;
        # wall time on the CPU); the exchange adds its "send" and "wait_experts".
        self.timing = {"attention": 0.0, "send": 0.0, "wait_experts": 0.0}
        self.attention_timer = ComputeTimer(self.device)
        # When each (layer, micro-batch) ran and waited, and each message left and arrived (off
        # until `bench pipeline` switches it on). The node loop records the steps themselves.
        self.timeline = Timeline(name, NodeRole.ATTENTION, self.device)
        self.exchange = ExpertExchange(link, expert_nodes, self.device, self.dtype, model_config.hidden_size,
                                       micro_batches=micro_batches, num_layers=model_config.num_layers,
                                       num_experts=model_config.num_experts, record_size=self.record_size, name=name,
                                       tp_group=tp_group, staging_bytes=staging_bytes, timing=self.timing,
                                       device_slot_bytes=device_slot_bytes, timeline=self.timeline)
        self.slots = self.exchange.slots  # the device slots, where some expert node takes them
        self.m2n = self.exchange.m2n  # per round latencies, for the metrics endpoint
        self.cohort_hidden = CohortHiddenStates()  # layered prefill: the cohort between its groups
        blocks = -(-max_model_len // config.block_size)
        self.block_tables = BlockTableRows(config.max_num_seqs, blocks, windowed=bool(model_config.kv_window))
        self.layouts = LayoutAhead()  # the next step's layout, worked out while this one runs
        self.inputs_ahead = InputsAhead()  # its micro-batch 0's inputs, while this one's last layer runs
        self.step_tokens = (0, 0)  # the last step's tokens and, of them, prompt tokens

    @property
    def step_id(self) -> int:
        """The step the next messages belong to (the exchange keeps it)."""
        return self.exchange.step_id

    @property
    def deployment_busy(self) -> bool:
        """Did any attention node send tokens in the last step?"""
        return self.exchange.deployment_busy

    def _attention_halves(self, capture: decode_graphs.Capture | None, max_model_len: int) -> AttentionHalves:
        """The attention halves, by decode's graphs, every (layer, micro-batch, size), where `capture`
        (decode_graphs.py), else eager; with the step's tokens routed to each expert of each layer."""
        cfg = self.model_config
        expert_counts = torch.zeros(cfg.num_layers, cfg.num_experts, dtype=torch.int64, device=self.device)
        graphs, decode = decode_graphs.capture_attention(capture, self.model, self.kv_caches, expert_counts,
                                                         self.config, self.m, max_model_len, self.num_blocks,
                                                         len(self.expert_nodes), self.record_size, self.tp_size)
        self.kernels = dataclasses.replace(self.kernels, decode=decode)
        return AttentionHalves(self.model, self.kv_caches, graphs, expert_counts, self.tp_size)

    def _attention_model(self, max_model_len: int) -> MoEModel:
        """This rank's attention halves (its heads), routing tokens out per expert node."""
        model = MoEModel(self.model_config, self.dtype, self.device, max_model_len, with_experts=False,
                         tp_rank=self.tp_rank, tp_size=self.tp_size)
        self.slot_maps.install(model.attention_layers)
        return model

    def profile_memory(self, before: MemorySnapshot | None, max_model_len: int) -> int | None:
        """The KV budget gpu_memory_utilization leaves this rank after `profile_step`, the least
        over the node's ranks (bytes); None without a baseline (the CPU, or a cache sized by the
        config). See attention_profile.py."""
        return None if before is None else attention_kv_budget(self.device, self.model_config, self.config,
                                                                self.tp_group, before, max_model_len, self.profile_step)

    def profile_step(self) -> None:
        """The largest micro-batch through every layer's attention half, nothing sent (attention_profile.py)."""
        profile_attention_step(self.model, self.model_config, self.config, self.device, self.dtype, self.tp_group,
                               len(self.expert_nodes))

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
        self.slot_maps.apply_due(self.step_id, self.model.attention_layers)  # before the step's first dispatch
        layout, seqs = self.layouts.of(out, self.m), out.all_seqs
        self.step_tokens = (out.total_tokens, out.total_tokens - out.num_single_token)
        self.cohort_hidden.forget_departed(seqs, layout)
        self.block_tables.retain(seqs)
        states: list[MicroBatchState | None] = [None] * self.m  # each prepared just before its first layer
        # A plain greedy decode step samples each micro-batch as its last answers arrive, while
        # the expert nodes still work on the later ones (the leader: followers do not sample).
        early = [] if not self.tp_rank and samples_by_micro_batch(seqs, layout) else None
        self.exchange.dispatch_flags = PREFILL if out.carries_prompt_tokens else 0  # the load windows split by it
        expert_counts = self._pass_layers(out, layout, states, seqs, early, hooks or StepHooks())
        # Every rank keeps the cohort's hidden states for the next group (each attends with them whole).
        for state in states:
            self.cohort_hidden.keep(seqs, layout, state)
        if self.tp_rank:  # followers: the leader samples
            return StepResult([None] * layout.num_sequences, [])
        result = StepResult(layout.place_samples(early), []) if early is not None else \
            sample_step(self.model, self.sampler, seqs, layout, states)
        result.expert_counts, result.expert_node_load = expert_counts.cpu().numpy(), self.exchange.node_load  # one read
        self.timeline.end_step()
        return result

    def _pass_layers(self, out: SchedulerOutput, layout: StepLayout, states: list[MicroBatchState | None],
                     seqs: list, early: list[int] | None, hooks: StepHooks) -> torch.Tensor:
        """The ping-pong: per layer, each micro-batch takes its expert answers of the layer before,
        then runs this layer's attention and dispatches; returns tokens per [layer, expert] (device).
        Micro-batch j's inputs are prepared right before its first layer (0's during the step
        before, where it was scheduled ahead: `InputsAhead`), so 0's dispatch need not wait for 1..'s."""
        cfg = self.model_config
        residual: list[torch.Tensor | None] = [None] * self.m
        expert_counts = self.attention_halves.expert_counts.zero_()
        combine = self.exchange.combine
        self.exchange.start_step()
        first_moe = cfg.first_k_dense  # DeepSeek's dense first layers run whole here, with no round
        for layer in range(cfg.num_layers):
            for j, state in enumerate(states):
                if layer > first_moe:
                    state.hidden = combine(layer - 1, j, residual[j])
                elif not layer:
                    states[j] = state = (j == 0 and self.inputs_ahead.take(self.model, out, layout, self.device)) or \
                        MicroBatchState.prepare(self.model, seqs, layout, layout.micro_batches[j], self.cohort_hidden,
                                                self.config.block_size, self.device, self.block_tables)
                    self.attention_halves.load(j, state)
                state.cross(layout, layer)
                if layer >= first_moe:
                    residual[j] = self._attend_and_dispatch(layer, j, state.hidden, state.inputs_at(layout, layer))
                else:
                    state.hidden = self.attention_halves.dense(layer, state.hidden, state.inputs_at(layout, layer))
            # A piece of the work beside the layers after each layer's dispatches (step_hooks.py).
            if hooks.run_piece(everything=layer == cfg.num_layers - 1):
                self.layouts.keep(hooks.ahead, self.m)
        # While the expert nodes answer the last layer: the next step's micro-batch 0, but its tokens.
        self.inputs_ahead.prepare(self.layouts.peek(), self.config.block_size, self.device, self.block_tables)
        for j, state in enumerate(states):
            state.hidden = combine(cfg.num_layers - 1, j, residual[j])
            state.cross(layout, cfg.num_layers)
            if early is not None and state.hidden is not None:  # `early`: this step's tokens, micro-batch by micro-batch
                tokens = greedy_rows(self.model, self.sampler, state.hidden)  # placed for the step ahead at once
                early.extend(self.inputs_ahead.sampled(tokens, state.layout.decode_sequences, hooks, self.model))
        self.timing["attention"] += self.attention_timer.collect()
        self.exchange.end_step()
        return expert_counts

    def _attend_and_dispatch(self, layer: int, j: int, hidden, inp):
        """Micro-batch j's attention half of `layer` and its dispatch (once on the host): the residual."""
        exchange = self.exchange
        mark, exchange.compute_mark = exchange.compute_mark, None
        if hidden is None:
            exchange.dispatch(layer, j, None)
            return None
        if mark is None:  # layer 0: no answers came before
            mark = self.timeline.compute_start()
        self.attention_timer.start()
        parts = self.attention_halves(layer, j, hidden, inp)
        self.attention_timer.stop()
        exchange.dispatch(layer, j, parts)
        self.timeline.compute_end(mark, exchange.step_id, layer, j, hidden.shape[0])
        return parts.residual

    def reset(self) -> None:
        """After the deployment re-wired: every node starts again from step 0."""
        self.exchange.reset()
