"""A node's timeline: when each step ran, when each (layer, micro-batch) was computed, how long
the node waited for a peer, and when each message left and arrived, all on the node's
monotonic clock (`time.perf_counter`, CLOCK_MONOTONIC: one clock for every process of a
host; a reader on another host adds `NodeTimeline.clock_offset`, see deploy/timeline_calls.py).

Off by default: a disabled recorder costs one attribute test per span. `bench pipeline`
switches it on, reads it back after the run, and derives from it each node's busy time and
the pipeline's efficiency (`megainfer/tools/bench/pipeline_overlap.py`).

On CUDA the host runs ahead of the device, so a COMPUTE span timed on the host would be its
launches. There a COMPUTE span is a pair of CUDA events on the compute stream, put on the
host's clock once per step (`end_step`): an anchor event is recorded and waited for, the host
reads its clock, and each event's time is the anchor's minus their elapsed time. The anchor
is recorded where the step already waits for the device (its counts read, its last answers
landed), so the wait costs nothing more.
"""

from __future__ import annotations

import time
from collections import deque

import torch

from megainfer.messages import NodeRole, NodeTimeline, Span, SpanKind

CAPACITY = 400_000  # spans kept (the oldest are dropped): ~100 MB at most, hours of a small bench


class Timeline:
    def __init__(self, name: str, role: NodeRole, device: torch.device | str = "cpu") -> None:
        self.name = name
        self.role = role
        self.enabled = False
        self.on_cuda = torch.device(device).type == "cuda"
        self._spans: deque[tuple] = deque(maxlen=CAPACITY)
        self._recorded = 0
        self._pending: list[tuple] = []  # CUDA compute spans of this step: (events, fields)
        self._free_events: list[torch.cuda.Event] = []

    def switch(self, on: bool) -> None:
        """Start (clearing what was kept) or stop recording."""
        self._spans.clear()
        self._pending.clear()
        self._recorded = 0
        self.enabled = on

    # -- recording ----------------------------------------------------------------------------
    def span(self, kind: SpanKind, step: int, layer: int, micro_batch: int, start: float, end: float,
             tokens: int = 0, prefill_tokens: int = 0) -> None:
        """A host-timed span (times from `time.perf_counter()`)."""
        if self.enabled:
            self._spans.append((kind, step, layer, micro_batch, start, end, tokens, prefill_tokens))
            self._recorded += 1

    def instant(self, kind: SpanKind, step: int, layer: int, micro_batch: int, tokens: int = 0) -> None:
        if self.enabled:
            now = time.perf_counter()
            self.span(kind, step, layer, micro_batch, now, now, tokens)

    def compute_start(self):
        """A mark for `compute_end`: the host's clock, or on CUDA an event on the compute stream."""
        if not self.enabled:
            return None
        if not self.on_cuda:
            return time.perf_counter()
        return self._event()

    def compute_end(self, mark, step: int, layer: int, micro_batch: int, tokens: int) -> None:
        if mark is None or not self.enabled:
            return
        if not self.on_cuda:
            self.span(SpanKind.COMPUTE, step, layer, micro_batch, mark, time.perf_counter(), tokens)
            return
        self._pending.append((mark, self._event(), (step, layer, micro_batch, tokens)))

    def end_step(self) -> None:
        """On CUDA: this step's compute spans onto the host's clock (see the module's docstring)."""
        if not self._pending:
            return
        anchor = self._event()
        anchor.synchronize()
        now = time.perf_counter()
        for begin, end, (step, layer, j, tokens) in self._pending:
            self.span(SpanKind.COMPUTE, step, layer, j, now - begin.elapsed_time(anchor) / 1e3,
                      now - end.elapsed_time(anchor) / 1e3, tokens)
            self._free_events += [begin, end]
        self._free_events.append(anchor)
        self._pending.clear()

    def _event(self) -> torch.cuda.Event:
        event = self._free_events.pop() if self._free_events else torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    # -- reading ------------------------------------------------------------------------------
    def read(self) -> NodeTimeline:
        """What was recorded since tracing was switched on (it stays recorded)."""
        spans = [Span(*fields) for fields in list(self._spans)]
        return NodeTimeline(self.name, self.role, spans, dropped=self._recorded - len(spans))
