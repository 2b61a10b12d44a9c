"""An expert node's work: for each (layer, micro-batch), in the fixed order every node
follows, take the tokens of every attention node, run this node's experts on their union,
and answer each attention node with its slice.

A (layer, micro-batch) is one transport round each way (attention_exchange.py: the receive,
the checks, the outbox of answers): one call collects every attention node's message, one
gathers their records end to end into a pinned buffer (device_staging.py) that enters the
device in one copy, so the transport slots are released at once, and one call answers every
attention node; the next micro-batch's experts are launched while the last one's answers are
still copying. Token counts come from the headers: nothing is read back from the device to
size anything. On the CPU the same code runs with the copies elided.
"""

from __future__ import annotations

import dataclasses
import time
from functools import partial

import torch
from tqdm.auto import tqdm

from megainfer.config import GPU_MEMORY_UTILIZATION, ModelConfig
from megainfer.disagg import decode_graphs
from megainfer.disagg.attention_exchange import AttentionExchange
from megainfer.disagg.device_slots import land_round, some_direct
from megainfer.disagg.expert_link import FLAGS, ExpertLink, RecordViews, record_bytes, unpack_dispatch
from megainfer.disagg.expert_load_round import PREFILL, ServedPairs, post_load
from megainfer.disagg.node_timeline import Timeline
from megainfer.disagg.staging_sizes import StagingBytes
from megainfer.messages import NodeRole, SpanKind
from megainfer.disagg.expert_switch import ExpertSwitch, node_slots
from megainfer.expert_replicas import ExpertReplicas
from megainfer.model.expert_layer import ExpertLayer, NodeSlots
from megainfer.model.weights import WeightSource
from megainfer.runner import memory_profile
from megainfer.runner.kernel_warmup import warm_up_expert_node
from megainfer.tensor_parallel import TensorParallelGroup

CONTROL_FIELDS = 4  # a follower's header: layer, micro-batch, tokens, the expert placement serving


class ExpertWorker:
    def __init__(self, model_config: ModelConfig, expert_ids: list[int], dtype: str, device: str,
                 weights: WeightSource, *, attention_nodes: list[str], micro_batches: int, link: ExpertLink | None,
                 show_progress: bool = False, tp_group: TensorParallelGroup | None = None,
                 staging_bytes: StagingBytes | int = 0, name: str = "experts", profile_tokens: int = 0,
                 gpu_memory_utilization: float = GPU_MEMORY_UTILIZATION, device_slot_bytes: int = 0,
                 decode_graph_tokens: int = 0, cuda_graph_sizes: tuple[int, ...] | None = None,
                 replicas: ExpertReplicas | None = None, node: int = 0, load_reports: bool = True) -> None:
        """With a `tp_group` this is one rank of a tensor-parallel expert node: rank 0 exchanges
        every message with the attention nodes and broadcasts each (layer, micro-batch)'s records
        to the others (a header over the control group, the records over the activations'
        group); every rank runs its slice of each expert and the partial outputs are summed on
        rank 0. `staging_bytes`: pinned host memory reserved up front per micro-batch and
        direction on CUDA (staging_sizes.expert_staging: the largest messages; 0: allocated in
        the first steps, as they need it). `profile_tokens`: on CUDA, the most tokens of one
        (layer, micro-batch) from every attention node, run once after loading to check that
        the weights and that step fit `gpu_memory_utilization` of the GPU (memory_profile.py;
        0: not checked). `device_slot_bytes`: the largest dispatch one attention node sends in a
        (layer, micro-batch); non-zero: dispatches and answers go straight between the devices of
        attention nodes on this host that use them too (device_slots.py; tensor-parallel size 1).
        `decode_graph_tokens`, `cuda_graph_sizes`: decode's CUDA graphs (`_capture`). `replicas`:
        where each expert's slots live (megainfer/expert_replicas.py), this node being `node`;
        None: `expert_ids` in every layer, one slot each. `load_reports`: end steps with the load round."""
        self.cfg = model_config
        self.tp_group = tp_group
        tp_rank, tp_size = self.tp_rank, self.tp_size = (0, 1) if tp_group is None else (tp_group.rank, tp_group.size)
        placement = [(list(expert_ids), NodeSlots(list(expert_ids), model_config.num_experts, len(expert_ids)))
                     ] * model_config.num_layers if replicas is None else node_slots(replicas, node)
        # DeepSeek's dense first layers have no experts: held empty, never served.
        self.first_moe = model_config.first_k_dense
        self.placement = [(experts, slots) if model_config.is_moe_layer(layer) else
                          ([], NodeSlots([], slots.num_ids, 0)) for layer, (experts, slots) in enumerate(placement)]
        self.node = node
        self.switch = ExpertSwitch(0 if replicas is None else replicas.version)
        self.weights = weights  # where a re-placement loads the experts that move here from
        self.expert_ids = self.placement[self.first_moe][0]
        self.dtype = getattr(torch, dtype)
        self.device = torch.device(device)
        self.attention_nodes = list(attention_nodes)
        self.m = micro_batches
        self.record_size = record_bytes(model_config.hidden_size, model_config.top_k, self.dtype)
        # When each step and (layer, micro-batch) ran and waited, and each message arrived and left
        # (off until `bench pipeline` switches it on).
        self.timeline = Timeline(name, NodeRole.EXPERT, self.device)
        self.exchange = AttentionExchange(link, attention_nodes, self.device, micro_batches=micro_batches,
                                          record_size=self.record_size,
                                          answer_row_bytes=model_config.hidden_size * self.dtype.itemsize,
                                          staging_bytes=staging_bytes, device_slot_bytes=device_slot_bytes,
                                          tp_size=tp_size, name=name, timeline=self.timeline)
        self.slots = self.exchange.slots  # the device slots, where some attention node takes them
        self.record_views = RecordViews(model_config.hidden_size, model_config.top_k, self.dtype,
                                        self.device.type == "cpu")  # CPU: rounds land in reused slices
        # followers send no load round; step_prefill: some attention node's step carried prompt tokens
        self.load_reports, self.step_prefill = load_reports and link is not None, False
        self._load(model_config, weights, show_progress, profile_tokens, gpu_memory_utilization)
        self.decode_graphs = self._capture(decode_graph_tokens, cuda_graph_sizes, name)
        self.steps, self.tokens = 0, 0  # tokens: processed (per layer, summed), for stats
        # Seconds, summed over steps: "experts" from holding a (layer, micro-batch)'s messages to
        # holding its answers on the host (on CUDA: the copies and the experts' device time).
        self.timing = {"experts": 0.0, "wait_attention": 0.0}

    def _load(self, model_config: ModelConfig, weights: WeightSource, show_progress: bool, profile_tokens: int,
              gpu_memory_utilization: float) -> None:
        """The experts' weights, every kernel built and decided, and (on CUDA, with
        `profile_tokens`) the largest (layer, micro-batch) checked to fit. Sets `layers`, `kernels`, `served`."""
        before = memory_profile.baseline(self.device) if profile_tokens else None
        # The pairs each row computes, counted on the device; read once per step for the load round.
        self.served = ServedPairs(model_config.num_layers, max(slots.room for _, slots in self.placement),
                                  model_config.num_experts, self.device)
        self.layers = [ExpertLayer(model_config, layer, self.dtype, self.device, experts, self.tp_rank, self.tp_size,
                                   slots, self.served.row_view(layer, slots.room))
                       for layer, (experts, slots) in enumerate(self.placement)]
        with torch.inference_mode():
            for layer in tqdm(self.layers, desc=f"loading experts {self.expert_ids[0]}..{self.expert_ids[-1]}", unit="layer",
                              disable=not show_progress):
                layer.load_weights(weights)
        # Kernels built and decided before serving and before the memory profile (kernel_warmup.py).
        warmup = warm_up_expert_node(self.layers[self.first_moe], model_config.top_k, profile_tokens or None)
        if before is not None:
            memory_profile.check_fits(memory_profile.profile(memory_profile.CudaMemory(self.device), before,
                                                             partial(self.profile_step, profile_tokens),
                                                             gpu_memory_utilization))
        self.kernels = warmup.finish()

    def _capture(self, most_tokens: int, sizes: tuple[int, ...] | None, name: str) -> decode_graphs.ExpertGraphs | None:
        """Decode's graphs, every (layer, size), where (layer, micro-batch)s of up to `most_tokens`
        replay them (decode_graphs.capture_experts); None: eager."""
        reduce = None if self.tp_size == 1 else partial(self.tp_group.reduce, dst=0)
        graphs, decode = decode_graphs.capture_experts(most_tokens, sizes, self.layers, self.record_size, self.dtype,
                                                       self.device, reduce, name)
        self.kernels = dataclasses.replace(self.kernels, decode=decode)
        self.served.restart()  # the warm-up, profile and capture ran the layers: count serving only
        return graphs

    @torch.inference_mode()
    def profile_step(self, tokens: int) -> None:
        """The largest (layer, micro-batch) this node serves, as `_serve` runs it but with nothing
        received or sent: `tokens` records on the device, every choice of every token on this
        node's experts (the most rows its GEMMs compute), the answers. A tensor-parallel rank
        reduces nothing (no collective at start-up): NCCL's buffers go uncounted. Keeps nothing."""
        cfg = self.cfg
        records = torch.zeros(tokens * self.record_size, dtype=torch.uint8, device=self.device)
        x, _, weights = unpack_dispatch(records, tokens, cfg.hidden_size, cfg.top_k, self.dtype)
        first = self.layers[self.first_moe]
        local = torch.tensor(first.slots.ids, device=self.device)  # the records name slots
        choice = torch.arange(tokens, device=self.device)[:, None] + torch.arange(cfg.top_k, device=self.device)
        first(x, local[choice % len(local)], weights)

    @torch.inference_mode()
    def run_step(self) -> int:
        """One engine step of every attention node: all layers, all micro-batches. Returns the
        tokens this node processed in it."""
        self.exchange.start_step()
        start = time.perf_counter()
        served = [self._serve(layer, j) for layer in range(self.first_moe, self.cfg.num_layers) for j in range(self.m)]
        step_tokens = sum(tokens for _, tokens in served)
        self.exchange.finish_step()
        if self.load_reports:  # the answers' copies landed: the counters are final
            report = self.served.step_counts([layer.expert_ids for layer in self.layers], self.switch.version)
            post_load(self.exchange.link, self.exchange.peers, report, step=served[0][0], prefill=self.step_prefill)
        self.timeline.end_step()
        self.timeline.span(SpanKind.STEP, served[0][0], -1, -1, start, time.perf_counter(), step_tokens)
        self.steps, self.tokens = self.steps + 1, self.tokens + step_tokens
        return step_tokens

    def _serve(self, layer: int, j: int) -> tuple[int, int]:
        """(layer, j): every attention node's tokens through this node's experts, each node
        answered with its rows. Returns the attention nodes' step id and the tokens served."""
        exchange = self.exchange
        t0 = time.perf_counter()
        arrivals = exchange.receive(j)
        t1 = time.perf_counter()
        self.timing["wait_attention"] += t1 - t0
        try:
            step = exchange.check(arrivals, layer)
            if layer == self.first_moe and j == 0:  # a re-placement agreed for this step serves all of it
                self.switch.apply_due(step, self.layers)
                self.step_prefill = bool((arrivals.fields[:, FLAGS] & PREFILL).any())  # a sender's whole step
            counts = arrivals.token_counts.copy()  # the arrivals' fields are reused by the next round
            total = sum(counts.tolist())  # (a numpy reduction costs four times as much on 20 numbers)
            timeline = self.timeline
            if timeline.enabled:
                timeline.span(SpanKind.WAIT, step, layer, j, t0, t1)
                for n in counts.tolist():
                    timeline.span(SpanKind.ARRIVE, step, layer, j, t1, t1, n)
            mark = timeline.compute_start()
            records = land_round(arrivals, j, self.record_size, exchange.staging, exchange.slots,
                                 total) if total else None
        finally:
            arrivals.release()  # gathered: the slots are free at once
        if self.tp_size > 1:
            self._share(layer, j, total, records)
        landed = None if some_direct(self.slots) else j  # in slot j's landing buffer (`land_round`)
        exchange.hold(step, layer, j, counts, self._experts(layer, records, total, landed) if total else None)
        self.timing["experts"] += time.perf_counter() - t1
        exchange.flush_landed()
        timeline.compute_end(mark, step, layer, j, total)
        return step, total

    def rewired(self) -> None:
        """After the deployment re-wired: offers are traded again at the next step."""
        self.exchange.rewired()

    def _experts(self, layer: int, records: torch.Tensor, total: int, landed: int | None = None) -> torch.Tensor:
        """`total` tokens' answers of `layer` (on a tensor-parallel node: summed on the leader), by a graph
        where one holds them, else eager. `landed`: the slot whose landing buffer holds `records`, or None."""
        if self.decode_graphs is not None and (y := self.decode_graphs.run(layer, records, total)) is not None:
            return y
        x, ids, weights = self.record_views.of(records, total, landed)
        y = self.layers[layer](x, ids, weights)  # the ids as sent, int32: the layer indexes with them
        if self.tp_size > 1:  # each rank holds a slice of every expert: their outputs add up
            self.tp_group.reduce(y, dst=0)
        return y

    def _share(self, layer: int, j: int, total: int, records: torch.Tensor) -> None:
        """Leader: this (layer, micro-batch)'s records to the other ranks (a header, then the bytes)."""
        self.tp_group.broadcast_control(torch.tensor([layer, j, total, self.switch.version], dtype=torch.int64))
        if total:
            self.tp_group.broadcast(records)

    @torch.inference_mode()
    def run_follower_step(self) -> None:
        """A follower rank's unit of work: one (layer, micro-batch) the leader shares. The header
        names the layer, so a leader that restarts its step after a re-wire needs no resync."""
        header = torch.zeros(CONTROL_FIELDS, dtype=torch.int64)
        self.tp_group.broadcast_control(header)
        layer, j, total, version = header.tolist()  # a host tensor from the control group: no device access
        if not self.first_moe <= layer < self.cfg.num_layers:
            raise RuntimeError(f"expert rank {self.tp_rank}: the leader shared layer {layer}")
        self.switch.follow(version, self.layers)
        if total:
            mark = self.timeline.compute_start()
            records = torch.empty(total * self.record_size, dtype=torch.uint8, device=self.device)
            self.tp_group.broadcast(records)
            self._experts(layer, records, total)
            self.tokens += total
            self.timeline.compute_end(mark, self.steps, layer, j, total)  # steps: the follower's own count
        if layer == self.cfg.num_layers - 1 and j == self.m - 1:
            self.steps += 1
            self.timeline.end_step()
