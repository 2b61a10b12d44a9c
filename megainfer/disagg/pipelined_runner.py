"""An attention node's runner: the attention halves here, the experts on expert nodes.

A step's sequences are split into `m` micro-batches (balanced by tokens). Layer by layer,
micro-batch j's expert results of layer l-1 are received and added to its residual
stream, its layer-l attention runs, and its routed tokens go out to the expert nodes;
then j+1. While the experts work on j, this node computes j+1: the ping-pong. Every step,
even an empty one, exchanges one message per (layer, micro-batch, expert node), so expert
nodes never wait on a node with nothing to say.

Same `execute(SchedulerOutput) -> StepResult` as `ModelRunner`, so `Engine` drives it
unchanged; `steps_when_idle` tells the engine to step even with nothing scheduled.
"""

from __future__ import annotations

import logging
import time

import torch

from megainfer.config import EngineConfig, ModelConfig
from megainfer.disagg import step_sync
from megainfer.disagg.expert_link import BUSY, ExpertLink, pack_dispatch
from megainfer.disagg.latency import LatencyHistogram
from megainfer.errors import DataPlaneError
from megainfer.model.moe_model import MoEModel
from megainfer.model.weights import WeightSource
from megainfer.model_runner import (CohortHiddenStates, MicroBatchState, StepResult, allocate_kv_caches,
                                    sample_step)
from megainfer.sampler import Sampler
from megainfer.scheduler import SchedulerOutput
from megainfer.step_layout import StepLayout
from megainfer.tensor_parallel import TensorParallelGroup

logger = logging.getLogger(__name__)


class PipelinedModelRunner:
    steps_when_idle = True

    def __init__(self, model_config: ModelConfig, config: EngineConfig, weights: WeightSource, max_model_len: int,
                 *, link: ExpertLink, expert_nodes: list[str], expert_assignment: list[list[int]],
                 micro_batches: int, tp_group: TensorParallelGroup | None = None) -> None:
        """With a `tp_group` this is one rank of a tensor-parallel node: rank 0 schedules and
        samples and sends each step to the others; every rank runs its heads and dispatches its
        share of the routed tokens."""
        if len(expert_nodes) != len(expert_assignment):
            raise ValueError("one expert-id list per expert node")
        self.model_config = model_config
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = getattr(torch, config.dtype)
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.link = link
        self.expert_nodes = list(expert_nodes)
        self.m = micro_batches
        node_of = torch.full((model_config.num_experts,), -1, dtype=torch.int64)
        for k, ids in enumerate(expert_assignment):
            node_of[ids] = k
        if (node_of < 0).any():
            raise ValueError(f"experts {(node_of < 0).nonzero().flatten().tolist()} are on no expert node")
        node_of = node_of.to(self.device)
        self.tp_group = tp_group
        tp_rank, tp_size = (0, 1) if tp_group is None else (tp_group.rank, tp_group.size)
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.model = MoEModel(model_config, self.dtype, self.device, max_model_len, with_experts=False,
                              tp_rank=tp_rank, tp_size=tp_size)
        for layer in self.model.attention_layers:  # routing lays tokens out per expert node
            layer.set_expert_nodes(node_of, len(self.expert_nodes))
        with torch.inference_mode():
            self.model.load_weights(weights, show_progress=config.show_progress)
        # Each rank caches its own KV heads; all ranks agree on the block count.
        self.num_blocks, self.kv_caches = allocate_kv_caches(model_config, config, max_model_len, self.device,
                                                             tp_group)
        self.sampler = Sampler(config.seed, self.device)
        self.step_id = 0
        self.deployment_busy = False  # did any attention node send tokens in the last step?
        self.cohort_hidden = CohortHiddenStates()  # layered prefill: the cohort between its groups
        # Seconds spent, summed over steps: where this node's step time goes.
        self.timing = {"attention": 0.0, "send": 0.0, "wait_experts": 0.0}
        # Per message, for the metrics endpoint: one send, and the wait for one expert node's answer.
        self.m2n = {"send": LatencyHistogram(), "receive_wait": LatencyHistogram()}

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> StepResult:
        if self.tp_size > 1:
            step_sync.broadcast_step(self.tp_group, out)  # the follower ranks run the same step
        return self._run(out)

    @torch.inference_mode()
    def execute_follower(self) -> None:
        """A follower rank's step: the leader's batch, this rank's heads, no sampling."""
        self._run(step_sync.receive_step(self.tp_group))

    def _run(self, out: SchedulerOutput) -> StepResult:
        """Every micro-batch through every layer, ping-ponging with the expert nodes. With layered
        prefill, micro-batch j also carries its share of the cohort inside this step's layer
        group: it joins j's tokens at the group's first layer and leaves after its last."""
        layout = StepLayout.of(out, self.m)
        seqs = out.all_seqs
        self.cohort_hidden.forget_departed(seqs, layout)
        states = [MicroBatchState.prepare(self.model, seqs, layout, batch, self.cohort_hidden, self.config.block_size,
                                          self.device) for batch in layout.micro_batches]
        expert_counts = self._pass_layers(layout, states)
        # Every rank keeps the cohort's hidden states for the next group (followers too: each
        # rank's attention needs them whole); after the last group, completed prompts sample.
        for state in states:
            self.cohort_hidden.keep(seqs, layout, state)
        if self.tp_rank:  # followers: the leader samples
            return StepResult([None] * layout.num_sequences, [])
        return StepResult(sample_step(self.model, self.sampler, seqs, layout, states), expert_counts.tolist())

    def _pass_layers(self, layout: StepLayout, states: list[MicroBatchState]) -> torch.Tensor:
        """The ping-pong: per layer, each micro-batch takes its expert answers of the layer
        before, then runs this layer's attention and dispatches. Returns tokens routed to each
        expert, [layer, expert]."""
        cfg = self.model_config
        residual: list[torch.Tensor | None] = [None] * self.m
        routes: list[list[torch.Tensor] | None] = [None] * self.m
        expert_counts = torch.zeros(cfg.num_layers, cfg.num_experts, dtype=torch.int64)
        self._busy = False
        for layer in range(cfg.num_layers):
            for j, state in enumerate(states):
                if layer:
                    state.hidden = self._combine(layer - 1, j, residual[j], routes[j])
                state.cross(layout, layer)
                residual[j], routes[j] = self._attend_and_dispatch(layer, j, state.hidden,
                                                                   state.inputs_at(layout, layer), expert_counts)
        for j, state in enumerate(states):
            state.hidden = self._combine(cfg.num_layers - 1, j, residual[j], routes[j])
            state.cross(layout, cfg.num_layers)
        self.deployment_busy = self._busy
        self.step_id = (self.step_id + 1) & 0xFFFFFFFF
        return expert_counts

    def _attend_and_dispatch(self, layer: int, j: int, hidden, inp, expert_counts):
        if hidden is None:
            for node in self.expert_nodes:
                self._send(node, torch.empty(0, dtype=torch.uint8), layer, j, 0)
            return None, None
        _, positions, batch = inp
        t0 = time.perf_counter()
        a = self.model.attention_layers[layer](hidden, positions, self.model.rotary, self.kv_caches[layer], batch)
        self.timing["attention"] += time.perf_counter() - t0
        g = a.gating
        expert_counts[layer] += g.expert_counts.cpu()
        bounds = g.node_offsets.tolist()
        routes = []
        for k, node in enumerate(self.expert_nodes):
            idx = g.node_token_ids[bounds[k]:bounds[k + 1]]  # each token once per node, in send order
            if self.tp_size > 1:  # each rank carries its share of the traffic
                idx = idx.tensor_split(self.tp_size)[self.tp_rank]
            routes.append(idx)
            payload = pack_dispatch(a.expert_input[idx], a.topk_ids[idx], a.topk_weights[idx])
            self._send(node, payload, layer, j, idx.numel())
        return a.residual, routes

    def _send(self, node: str, payload: torch.Tensor, layer: int, j: int, tokens: int) -> None:
        t0 = time.perf_counter()
        try:
            self.link.send(node, payload, step=self.step_id, layer=layer, micro_batch=j, token_count=tokens)
        except Exception as exc:
            raise DataPlaneError(f"cannot reach expert node {node} (layer {layer}): {exc}") from exc
        elapsed = time.perf_counter() - t0
        self.timing["send"] += elapsed
        self.m2n["send"].observe(elapsed)

    def reset(self) -> None:
        """After the deployment re-wired: every node starts again from step 0."""
        self.step_id = 0
        self.deployment_busy = False

    def _combine(self, layer: int, j: int, residual, routes):
        h = self.model_config.hidden_size
        y = torch.zeros_like(residual) if residual is not None else None
        for k, node in enumerate(self.expert_nodes):
            t0 = time.perf_counter()
            try:
                msg = self.link.recv(node, micro_batch=j)
                waited = time.perf_counter() - t0
                self.timing["wait_experts"] += waited
                self.m2n["receive_wait"].observe(waited)
            except Exception as exc:
                raise DataPlaneError(f"expert node {node} did not answer (layer {layer}): {exc}") from exc
            header = msg.header
            if header.layer != layer or header.step != self.step_id:
                raise DataPlaneError(f"expert node {node} answered (step {header.step}, layer {header.layer}) where "
                                 f"(step {self.step_id}, layer {layer}) was due: the nodes are out of step")
            self._busy |= bool(header.flags & BUSY)
            n = header.token_count
            if n:
                y.index_add_(0, routes[k], msg.tensor(self.dtype).view(n, h).to(self.device))
            msg.release()
        if residual is None:
            return None
        if self.tp_size > 1:  # every rank added its share of the answers: sum them
            self.tp_group.all_reduce(y)
        return residual + y
