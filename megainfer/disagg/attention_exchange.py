"""An expert node's rounds with the attention nodes (expert_worker.py runs the experts).

A (layer, micro-batch) is one transport round each way: one call collects every attention
node's message, and one call answers every attention node from one buffer of answers (node i's
rows a byte range of it); the answers leave on the copy stream and wait in an outbox until that
copy has landed: they are sent while the node waits for its next messages (or at the step's
end), so the host never waits for the device inside a layer.

An answer of (layer, j) is always sent before slot j's pinned buffer is written again: the
next use of slot j is (layer + 1, j), whose messages cannot come before the attention nodes
have (layer, j)'s answers.
"""

from __future__ import annotations

from collections import deque
from functools import partial
from dataclasses import dataclass

import numpy as np
import torch

from megainfer.disagg.device_slots import device_slots_for, link_post, round_mismatch, sends_from_device, some_direct
from megainfer.disagg.device_staging import DeviceStaging, HostCopy
from megainfer.disagg.expert_link import BUSY, LAYER, STEP, ExpertLink, row_ranges
from megainfer.disagg.node_timeline import Timeline
from megainfer.disagg.staging_sizes import StagingBytes
from megainfer.messages import SpanKind


@dataclass
class PendingAnswer:
    """One (layer, micro-batch)'s answers on their way to the host, not yet sent."""

    step: int
    layer: int
    micro_batch: int
    counts: np.ndarray  # int64: tokens of each attention node, in `attention_nodes` order
    copy: HostCopy | None  # [total, hidden] answers for the host's peers; None: nothing to copy
    busy: bool  # some attention node had tokens

    def landed(self) -> bool:
        return self.copy is None or self.copy.landed()


class AttentionExchange:
    """One expert node's side of the M2N rounds: every attention node's message of a (layer,
    micro-batch) received and checked, and the answers sent through an outbox, each once its
    copy to the host has landed."""

    def __init__(self, link: ExpertLink | None, attention_nodes: list[str], device: torch.device, *,
                 micro_batches: int, record_size: int, answer_row_bytes: int, staging_bytes: StagingBytes | int,
                 device_slot_bytes: int, tp_size: int, name: str, timeline: Timeline) -> None:
        """`link`: None on a tensor-parallel follower, which exchanges nothing. `timeline`: the
        worker's, where messages are recorded too."""
        self.link = link
        self.peers = tuple(attention_nodes)  # every round goes to all of them, in this order
        self.record_size, self.answer_row_bytes = record_size, answer_row_bytes
        self.staging = DeviceStaging(device, micro_batches, staging_bytes)
        if link is not None:
            for buffer in self.staging.send_buffers():
                link.register(buffer)
        self.slots = device_slots_for(name, self.peers, device, micro_batches, device_slot_bytes, tp_size)
        self._slots_wired = False  # offers traded with this wiring's attention nodes
        self._answers: deque[PendingAnswer] = deque()
        self._no_answers = torch.empty(0, dtype=torch.uint8)  # an empty (layer, micro-batch)'s answers
        self.timeline = timeline

    def start_step(self) -> None:
        """Before a step's first round: nothing left of a failed step (its answers are not this
        step's), and device-slot offers traded at a wiring's first step."""
        self._answers.clear()
        if self.slots is not None and not self._slots_wired:
            # trade offers with the attention nodes
            self.slots.exchange(self.link, partial(self.staging.device_send_buffers, self.link))
            self._slots_wired = True

    def finish_step(self) -> None:
        """Every answer still in the outbox sent: the attention nodes end their step on these."""
        while self._answers:
            self._send_answer(self._answers.popleft())

    def rewired(self) -> None:
        """After the deployment re-wired: offers are traded again at the next step."""
        self._slots_wired = False

    def receive(self, j: int):
        """Every attention node's message for micro-batch j, one round; while it is awaited,
        answers whose copies land are sent (the round may be waiting on one of them)."""
        while self._answers:
            arrivals = self.link.poll_round(self.peers, micro_batch=j)
            if arrivals is not None:
                return arrivals
            if self._answers[0].landed():
                self._send_answer(self._answers.popleft())
        return self.link.collect_round(self.peers, micro_batch=j)

    def check(self, arrivals, layer: int) -> int:
        """The step every attention node's message belongs to; each must be (that step, `layer`)
        and hold exactly its header's records."""
        a = round_mismatch(arrivals, -1, layer, self.record_size, self.slots)
        if a < 0:
            return int(arrivals.fields[0, STEP])
        fields, step = arrivals.fields, arrivals.fields[0, STEP]
        if fields[a, LAYER] != layer or fields[a, STEP] != step:
            raise RuntimeError(f"attention node {self.peers[a]} sent (step {fields[a, STEP]}, layer "
                               f"{fields[a, LAYER]}) where (step {step}, layer {layer}) was due")
        raise RuntimeError(f"attention node {self.peers[a]} sent {arrivals.byte_lengths[a]} bytes for "
                           f"{arrivals.token_counts[a]} tokens of {self.record_size}-byte records (layer {layer})")

    def hold(self, step: int, layer: int, j: int, counts: np.ndarray, y: torch.Tensor | None) -> None:
        """(layer, j)'s answers `y` ([total, hidden], None: no tokens) into the outbox: to peers on
        device slots straight away, to the others once their copy to the host has landed."""
        copy = None
        if y is not None and some_direct(self.slots):
            begins, ends = row_ranges(counts, self.answer_row_bytes)
            self.slots.write(j, y.contiguous().view(-1).view(torch.uint8), begins, ends)  # once the experts ran
            if self.slots.needs_host_copy:  # some peer's bytes leave through the link (from GPU memory where it can)
                copy = self.staging.to_host([y], slot=j, device_first=sends_from_device(self.slots))
        elif y is not None:
            copy = self.staging.to_host([y], slot=j)
        self._answers.append(PendingAnswer(step, layer, j, counts, copy, busy=y is not None))

    def flush_landed(self) -> None:
        """Send, oldest first, every answer whose copy has reached the host; never waits."""
        while self._answers and self._answers[0].landed():
            self._send_answer(self._answers.popleft())

    def _send_answer(self, pending: PendingAnswer) -> None:
        """Each attention node's rows of one (layer, micro-batch)'s answers, one round (waiting
        for their copy only if it has not landed)."""
        answers = pending.copy.wait()[0] if pending.copy is not None else self._no_answers
        flags = BUSY if pending.busy else 0
        if some_direct(self.slots):  # local peers' rows went by device slots; rdma peers' go into their regions
            begins, ends, targets, mark = link_post(self.slots, pending.micro_batch,
                                                    *row_ranges(pending.counts, self.answer_row_bytes),
                                                    step=pending.step, layer=pending.layer)
            self.link.post_round(self.peers, answers, begins, ends, pending.counts, step=pending.step,
                                 layer=pending.layer, micro_batch=pending.micro_batch, flags=flags, targets=targets,
                                 mark=mark)
        else:
            self.link.post_rows(self.peers, answers, pending.counts, self.answer_row_bytes, step=pending.step,
                                layer=pending.layer, micro_batch=pending.micro_batch, flags=flags)
        if self.timeline.enabled:
            for n in pending.counts.tolist():
                self.timeline.instant(SpanKind.SEND, pending.step, pending.layer, pending.micro_batch, n)
