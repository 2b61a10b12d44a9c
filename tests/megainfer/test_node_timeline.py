"""A node's timeline recorder (megainfer/disagg/node_timeline.py) and what the pipeline bench
derives from timelines (megainfer/tools/bench/pipeline_overlap.py): the decode window, each
node's busy time in it (STEP minus WAIT, clipped), the bottleneck and the pipeline's
efficiency, a reader's clock offset, and the Gantt chart."""

from __future__ import annotations

import time

import pytest

from megainfer.tools.bench.pipeline_overlap import decode_window, overlap, plot_measured_gantt
from megainfer.disagg import node_timeline as timeline_module
from megainfer.disagg.node_timeline import Timeline
from megainfer.errors import MegaInferError
from megainfer.messages import NodeRole, NodeTimeline, Span, SpanKind

STEP, COMPUTE, WAIT, SEND, ARRIVE = SpanKind.STEP, SpanKind.COMPUTE, SpanKind.WAIT, SpanKind.SEND, SpanKind.ARRIVE


# -- the recorder ------------------------------------------------------------------------------
def test_a_disabled_timeline_records_nothing():
    t = Timeline("attention0", NodeRole.ATTENTION)
    t.span(STEP, 0, -1, -1, 1.0, 2.0, tokens=4)
    t.instant(SEND, 0, 1, 0, tokens=4)
    assert t.compute_start() is None
    t.compute_end(time.perf_counter(), 0, 1, 0, 4)  # a mark taken elsewhere is ignored too
    read = t.read()
    assert read.spans == [] and read.dropped == 0


def test_switching_on_clears_earlier_spans_and_read_returns_spans_with_their_fields():
    t = Timeline("expert0", NodeRole.EXPERT)
    t.switch(True)
    t.span(WAIT, 9, 9, 9, 0.0, 1.0)
    t.switch(True)
    t.span(STEP, 3, -1, -1, 10.0, 10.5, tokens=12, prefill_tokens=8)
    read = t.read()
    assert read.name == "expert0" and read.role is NodeRole.EXPERT
    assert read.spans == [Span(STEP, 3, -1, -1, 10.0, 10.5, 12, 8)]
    t.switch(False)
    t.span(STEP, 4, -1, -1, 11.0, 11.5)
    assert t.read().spans == []


def test_a_cpu_compute_span_is_host_timed_with_its_fields():
    t = Timeline("attention0", NodeRole.ATTENTION, device="cpu")
    t.switch(True)
    before = time.perf_counter()
    mark = t.compute_start()
    t.compute_end(mark, step=5, layer=2, micro_batch=1, tokens=7)
    after = time.perf_counter()
    (span,) = t.read().spans
    assert (span.kind, span.step, span.layer, span.micro_batch, span.tokens, span.prefill_tokens) == \
        (COMPUTE, 5, 2, 1, 7, 0)
    assert before <= span.start <= span.end <= after


def test_an_instant_starts_where_it_ends():
    t = Timeline("attention0", NodeRole.ATTENTION)
    t.switch(True)
    t.instant(ARRIVE, 1, 3, 0, tokens=6)
    (span,) = t.read().spans
    assert span.kind is ARRIVE and (span.step, span.layer, span.micro_batch, span.tokens) == (1, 3, 0, 6)
    assert span.start == span.end


def test_past_its_capacity_the_oldest_spans_are_dropped_and_counted(monkeypatch):
    monkeypatch.setattr(timeline_module, "CAPACITY", 3)
    t = Timeline("attention0", NodeRole.ATTENTION)
    t.switch(True)
    for step in range(5):
        t.span(STEP, step, -1, -1, float(step), step + 0.5, tokens=1)
    read = t.read()
    assert [s.step for s in read.spans] == [2, 3, 4]
    assert read.dropped == 2
    t.switch(True)
    assert t.read().dropped == 0


# -- overlap -----------------------------------------------------------------------------------
def step(n: int, start: float, end: float, tokens: int, prefill: int = 0) -> Span:
    return Span(STEP, n, -1, -1, start, end, tokens, prefill)


def attention_timeline() -> NodeTimeline:
    """Prefill steps end at 2.0 (a decode-only step between them is before the window), decode
    steps run 2.0 to 5.0, then an idle step (no tokens). Busy in the window: 3.0 - 0.3."""
    return NodeTimeline("attention0", NodeRole.ATTENTION, [
        step(0, 0.0, 1.0, tokens=10, prefill=10),
        step(1, 1.0, 1.5, tokens=4),  # decode-only, but a prefill step follows it
        step(2, 1.5, 2.0, tokens=9, prefill=5),
        step(3, 2.0, 3.0, tokens=4),
        step(4, 3.0, 4.0, tokens=4),
        step(5, 4.0, 5.0, tokens=4),
        step(6, 5.0, 6.0, tokens=0),  # idle: not in the window
        Span(WAIT, 2, 0, 0, 1.6, 1.9),  # before the window
        Span(WAIT, 3, 0, 0, 2.5, 2.7),
        Span(WAIT, 4, 0, 1, 3.5, 3.6),
        Span(COMPUTE, 2, 0, 0, 1.9, 2.05),  # starts before the window: not counted
        Span(COMPUTE, 3, 0, 0, 2.1, 2.3, tokens=4),
        Span(COMPUTE, 4, 0, 1, 3.1, 3.4, tokens=4),
        Span(COMPUTE, 6, 0, 0, 5.0, 5.1),  # starts at the window's end: not counted
        Span(SEND, 3, 0, 0, 2.3, 2.3, tokens=4),
        Span(ARRIVE, 3, 0, 0, 2.45, 2.45, tokens=4),
    ])


def expert_timeline(clock_offset: float) -> NodeTimeline:
    """On its own clock, 100 s ahead of the attention node's: with clock_offset -100 it steps
    from 1.8 to 5.2 and waits 0.9 before the window and 0.1 inside it (busy 2.9 of 3.0)."""
    return NodeTimeline("expert0", NodeRole.EXPERT, [
        step(0, 101.8, 105.2, tokens=8),
        Span(WAIT, 0, 0, 0, 101.0, 101.9),
        Span(WAIT, 0, 0, 0, 104.9, 105.1),
        Span(COMPUTE, 3, 0, 0, 102.3, 102.5, tokens=4),
        Span(ARRIVE, 3, 0, 0, 102.31, 102.31, tokens=4),
        Span(SEND, 3, 0, 0, 102.4, 102.4, tokens=4),
    ], clock_offset=clock_offset)


def test_the_decode_window_starts_after_the_last_prefill_and_ends_with_the_last_decode():
    (lo, hi), steps = decode_window([attention_timeline(), expert_timeline(-100.0)])
    assert (lo, hi) == (2.0, 5.0)
    assert steps == 3


def test_busy_time_is_steps_minus_waits_inside_the_window_and_the_bottleneck_sets_the_efficiency():
    result = overlap([attention_timeline(), expert_timeline(-100.0)])
    attention, expert = result.nodes
    assert result.window == (2.0, 5.0) and result.wall_s == pytest.approx(3.0)
    assert attention.busy_s == pytest.approx(3.0 - 0.2 - 0.1)
    assert attention.busy_fraction == pytest.approx(2.7 / 3.0)
    assert expert.busy_s == pytest.approx(3.0 - 0.1)
    assert expert.busy_fraction == pytest.approx(2.9 / 3.0)
    assert result.bottleneck is expert
    assert result.efficiency == pytest.approx(2.9 / 3.0)
    assert (attention.computes, attention.compute_s) == (2, pytest.approx(0.5))
    assert attention.mean_compute_ms == pytest.approx(250.0)
    assert (expert.computes, expert.mean_compute_ms) == (1, pytest.approx(200.0))


def test_without_its_clock_offset_a_node_lies_outside_the_window():
    result = overlap([attention_timeline(), expert_timeline(0.0)])
    expert = result.nodes[1]
    assert expert.busy_s == 0.0 and expert.computes == 0 and expert.mean_compute_ms == 0.0
    assert result.bottleneck.name == "attention0"
    assert result.efficiency == pytest.approx(0.9)


def test_several_attention_nodes_widen_the_window_and_the_first_counts_the_steps():
    second = NodeTimeline("attention1", NodeRole.ATTENTION, [
        step(0, 0.0, 1.2, tokens=8, prefill=8),
        step(1, 2.5, 3.5, tokens=2),
        step(2, 3.5, 5.5, tokens=2),
    ])
    (lo, hi), steps = decode_window([attention_timeline(), second])
    assert (lo, hi) == (2.0, 5.5)
    assert steps == 3


def test_no_decode_only_step_after_the_last_prefill_is_an_error():
    only_prefill = NodeTimeline("attention0", NodeRole.ATTENTION, [
        step(0, 0.0, 1.0, tokens=4),  # decode-only, but before the last prefill
        step(1, 1.0, 2.0, tokens=8, prefill=8),
        step(2, 2.0, 3.0, tokens=0),  # after it, but empty
    ])
    with pytest.raises(MegaInferError, match="no decode-only step"):
        decode_window([only_prefill])
    with pytest.raises(MegaInferError):
        overlap([only_prefill, expert_timeline(-100.0)])


def test_plot_gantt_writes_a_png_for_two_runs(tmp_path):
    one = [attention_timeline(), expert_timeline(-100.0)]
    two = [attention_timeline(), expert_timeline(0.0)]
    path = tmp_path / "gantt.png"
    plot_measured_gantt([("aligned", one, overlap(one)), ("unaligned", two, overlap(two))], str(path), title="test")
    assert path.is_file()
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
