"""An attention rank's rounds with the expert nodes (pipelined_runner.py runs the layers).

A dispatch is one device buffer of records (every expert node's tokens in node order, see
expert_link.py) plus the node offsets, copied to pinned memory on a copy stream
(device_staging.py); it waits in the outbox while the host launches the next micro-batch's
work, and goes out once its copy has landed, when the host first reads the offsets. The node
offsets are the only counts the host needs, and they arrive with the records; answers say
their token counts in their headers. Answers enter the device in one copy per micro-batch and
are added with one `index_add_`. Every step, even an empty one, exchanges one message per
(layer, micro-batch, expert node), so expert nodes never wait on a node with nothing to say.
"""

from __future__ import annotations

import time
from collections import deque
from functools import partial
from dataclasses import dataclass

import numpy as np
import torch

from megainfer.disagg.attention_dispatch import DispatchParts
from megainfer.disagg.device_slots import (device_slots_for, land_round, link_post, round_mismatch,
                                          sends_from_device, some_direct)
from megainfer.disagg.device_staging import DeviceStaging, HostCopy
from megainfer.disagg.expert_link import BUSY, FLAGS, LAYER, STEP, ExpertLink
from megainfer.disagg.expert_load_round import LoadRound
from megainfer.disagg.latency import LatencyHistogram
from megainfer.disagg.node_timeline import Timeline
from megainfer.disagg.staging_sizes import StagingBytes
from megainfer.errors import DataPlaneError
from megainfer.messages import SpanKind
from megainfer.tensor_parallel import TensorParallelGroup


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
    total: int  # their sum: what the answers, checked against `counts`, hold


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


def answer_mismatch(arrivals, k: int, node: str, routed: RoutedTokens, step: int, layer: int, j: int,
                    row_bytes: int) -> DataPlaneError:
    """What is wrong with expert node `node`'s answer (the k-th of `arrivals`) to (`step`, `layer`, j)."""
    fields, counts = arrivals.fields, arrivals.token_counts
    if fields[k, STEP] != step or fields[k, LAYER] != layer:
        return DataPlaneError(f"expert node {node} answered (step {fields[k, STEP]}, layer {fields[k, LAYER]}) "
                              f"where (step {step}, layer {layer}) was due: the nodes are out of step")
    if counts[k] != routed.counts[k]:
        return DataPlaneError(f"expert node {node} answered {counts[k]} tokens of layer {layer}, micro-batch "
                              f"{j}, where {routed.counts[k]} were sent")
    return DataPlaneError(f"expert node {node} answered {counts[k]} tokens of layer {layer} in "
                          f"{arrivals.byte_lengths[k]} bytes, not {row_bytes} per token")


class ExpertExchange:
    """One attention rank's side of the M2N rounds: its dispatches, through an outbox that sends
    each once its copy to the host has landed, and the expert nodes' answers, checked and added
    into the residual stream. Owns the step id every message carries."""

    def __init__(self, link: ExpertLink, expert_nodes: list[str], device: torch.device, dtype: torch.dtype,
                 hidden_size: int, *, micro_batches: int, num_layers: int, num_experts: int, record_size: int,
                 tp_group: TensorParallelGroup | None, staging_bytes: StagingBytes | int, device_slot_bytes: int,
                 name: str, timing: dict[str, float], timeline: Timeline) -> None:
        """`timing`: the runner's seconds, summed over steps, where this adds "send" (the host's time
        getting dispatches out, waiting for their copies included) and "wait_experts" (its time
        waiting for answers). `timeline`: the runner's, where rounds are recorded too."""
        self.link = link
        self.peers = tuple(expert_nodes)  # every round goes to all of them, in this order
        self.dtype = dtype
        self.answer_row_bytes = hidden_size * dtype.itemsize
        self.record_size = record_size
        self.num_layers = num_layers
        self.tp_group = tp_group
        self.tp_rank, self.tp_size = (0, 1) if tp_group is None else (tp_group.rank, tp_group.size)
        self.staging = DeviceStaging(device, micro_batches, staging_bytes)
        for buffer in self.staging.send_buffers():
            link.register(buffer)
        self.slots = device_slots_for(name, self.peers, device, micro_batches, device_slot_bytes, self.tp_size)
        self._slots_wired = False  # offers traded with this wiring's expert nodes
        self.step_id = 0
        self.busy, self.dispatch_flags = False, 0  # tokens sent in this step (so far)? its flags (PREFILL: prompts)
        self.load_round = LoadRound(self.peers, num_layers, num_experts)  # each step's last round, into `node_load`
        self.deployment_busy = False  # ... in the last step?
        self._outbox: deque[PendingDispatch] = deque()  # dispatches copying to the host, oldest first
        self._routed: list[RoutedTokens | None] = [None] * micro_batches  # per micro-batch: its last dispatch sent
        self._no_records = torch.empty(0, dtype=torch.uint8)  # an empty step's dispatch
        self.timing = timing
        # Per round, for the metrics endpoint: posting a dispatch to every expert node, and the
        # wait for all their answers.
        self.m2n = {"send": LatencyHistogram(), "receive_wait": LatencyHistogram()}
        self.timeline = timeline
        self.compute_mark = None  # where the next (layer, micro-batch)'s compute began: its answers' arrival

    def start_step(self) -> None:
        """Before a step's first dispatch: device-slot offers traded at a wiring's first step, and
        nothing left of a failed step (its dispatches are not this step's)."""
        self.busy = False
        if self.slots is not None and not self._slots_wired:
            self.slots.exchange(self.link, partial(self.staging.device_send_buffers, self.link))  # offers, expert nodes
            self._slots_wired = True
        self._outbox.clear()
        self._routed = [None] * len(self._routed)

    def end_step(self) -> None:
        """After a step's last answers: the load round collected, the busy flag kept, the next id."""
        self.node_load = self.load_round.collect(self.link, self.step_id)
        self.deployment_busy = self.busy
        self.step_id = (self.step_id + 1) & 0xFFFFFFFF

    def reset(self) -> None:
        """After the deployment re-wired: every node starts again from step 0."""
        self.step_id = 0
        self.deployment_busy = False
        self._outbox.clear()
        self._slots_wired = False  # new peers, perhaps: offers are traded again at the first step

    def dispatch(self, layer: int, j: int, parts: DispatchParts | None) -> None:
        """Micro-batch j's routed tokens of `layer` (None: it has none) to the host on the copy
        stream, into the outbox; they leave once that copy has landed."""
        if parts is None:
            pending = PendingDispatch(layer, j)
        else:
            records, node_offsets = parts.records, parts.node_offsets
            direct = some_direct(self.slots)
            ready = torch.cuda.current_stream(self.staging.device).record_event() if direct and self.staging.on_cuda \
                else None
            # where every expert node takes device slots on this host, only the offsets go to the host
            staged = [node_offsets] if direct and not self.slots.needs_host_copy else [records, node_offsets]
            copy = self.staging.to_host(staged, j, device_first=len(staged) == 2 and sends_from_device(self.slots))
            pending = PendingDispatch(layer, j, copy, parts.token_ids, node_offsets, records if direct else None, ready)
        self._outbox.append(pending)
        self.flush_landed()  # inline, not `post`: one call less per round

    def post(self, pending: PendingDispatch) -> None:
        """`pending` into the outbox, and every dispatch whose copy has landed sent (as `dispatch`
        does: `megainfer bench host` posts its own)."""
        self._outbox.append(pending)
        self.flush_landed()

    def flush_landed(self) -> None:
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
        row, header = self.record_size, dict(step=self.step_id, layer=layer, micro_batch=j, flags=self.dispatch_flags)
        try:
            if some_direct(self.slots):
                if pending.records is not None:
                    self.slots.write(j, pending.records.view(-1), begins * row, ends * row, ready=pending.records_ready)
                *ranges, targets, mark = link_post(self.slots, j, begins * row, ends * row, step=self.step_id,
                                                   layer=layer)
                self.link.post_round(self.peers, records, *ranges, counts, targets=targets, mark=mark, **header)
            elif self.tp_size == 1:  # every node's records, end to end
                self.link.post_rows(self.peers, records, counts, row, **header)
            else:
                self.link.post_round(self.peers, records, begins * row, ends * row, counts, **header)
        except Exception as exc:
            raise DataPlaneError(f"cannot reach the expert nodes (layer {layer}): {exc}") from exc
        total = int(bounds[-1]) if self.tp_size == 1 else sum(counts.tolist())
        if pending.token_ids is None:
            rows = None
        elif self.tp_size == 1:  # the shares are the whole segments: the tokens sent are a prefix (or all)
            rows = pending.token_ids if pending.token_ids.shape[0] == total else pending.token_ids[:total]
        else:  # this rank's share of every node's segment, found on the device: no copy, no sync
            rows = pending.token_ids[shared_positions_on(pending.node_offsets, self.tp_size, self.tp_rank, total)]
        self._routed[j] = RoutedTokens(layer, rows, counts, total)
        if self.timeline.enabled:
            for tokens in counts.tolist():
                self.timeline.instant(SpanKind.SEND, self.step_id, layer, j, tokens)
        elapsed = time.perf_counter() - t0
        self.m2n["send"].observe(elapsed)
        self.timing["send"] += elapsed

    def combine(self, layer: int, j: int, residual: torch.Tensor | None) -> torch.Tensor | None:
        """Micro-batch j's answers of `layer` added into its residual stream: gathered end to end
        into one host buffer, one copy to the device and one `index_add_` over every routed
        token, in expert-node order."""
        routed = self._flush_through(layer, j)
        waited = time.perf_counter()
        arrivals = self._receive(layer, j)
        self.timeline.span(SpanKind.WAIT, self.step_id, layer, j, waited, time.perf_counter())
        if layer + 1 < self.num_layers:  # the next layer's compute of j starts here
            self.compute_mark = self.timeline.compute_start()
        try:
            total = self._check_answers(arrivals, routed, layer, j)
            y = None
            if residual is not None:
                y = torch.zeros_like(residual)
                if total:
                    values = land_round(arrivals, j, self.answer_row_bytes, self.staging, self.slots, total)
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
        if k >= 0:
            raise answer_mismatch(arrivals, k, self.peers[k], routed, self.step_id, layer, j, self.answer_row_bytes)
        if not self.busy:
            self.busy = bool((arrivals.fields[:, FLAGS] & BUSY).any())
        if self.timeline.enabled:
            for tokens in arrivals.token_counts.tolist():
                self.timeline.instant(SpanKind.ARRIVE, self.step_id, layer, j, tokens)
        return routed.total  # the counts were checked equal to those sent

    def _receive(self, layer: int, j: int):
        """Every expert node's answer for (layer, j), one round; while it is awaited,
        dispatches whose copies land are sent."""
        t0, sending = time.perf_counter(), self.timing["send"]
        try:
            arrivals = None
            while arrivals is None and self._outbox:
                arrivals = self.link.poll_round(self.peers, micro_batch=j)
                if arrivals is None:
                    self.flush_landed()
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
