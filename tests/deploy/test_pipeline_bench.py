"""`megainfer bench pipeline` on the real path (Ray actors, M2N): the nodes' timelines come
back on the driver's clock and pair every message with its arrival, and the bench prints and
writes the busy fractions, the efficiency and the Gantt chart. One Ray session."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter

import pytest

ray = pytest.importorskip("ray")

from deploy import bench_pipeline  # noqa: E402
from megainfer.messages import NodeRole, SpanKind  # noqa: E402
from megainfer.plan import PipelineSpec, Plan  # noqa: E402

LAYERS = 4  # megainfer-demo, tiny-cpu.yaml's model


@pytest.fixture(scope="module", autouse=True)
def ray_session():
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_timelines_pair_every_message_and_count_every_compute():
    plan = Plan.load("deploy/plans/tiny-cpu.yaml")
    plan = dataclasses.replace(plan, pipeline=PipelineSpec(micro_batches=2, global_batch=8))
    row, (timelines, result) = bench_pipeline.measure(plan, requests=8, prompt_len=8, output_len=12)
    by_role = {t.role: t for t in timelines}
    assert set(by_role) == {NodeRole.ATTENTION, NodeRole.EXPERT}
    attention, expert = by_role[NodeRole.ATTENTION], by_role[NodeRole.EXPERT]
    # The nodes switch tracing on and are read at slightly different moments: compare the steps
    # both recorded whole. In those, every dispatch arrived at the expert node, and every answer back.
    whole = ({s.step for s in attention.spans if s.kind is SpanKind.STEP}
             & {s.step for s in expert.spans if s.kind is SpanKind.STEP})
    whole -= {min(whole), max(whole)}

    def keys(timeline, kind):
        return Counter((s.step, s.layer, s.micro_batch) for s in timeline.spans if s.kind is kind and s.step in whole)

    assert len(whole) > 5
    assert keys(attention, SpanKind.SEND) == keys(expert, SpanKind.ARRIVE) != Counter()
    assert keys(expert, SpanKind.SEND) == keys(attention, SpanKind.ARRIVE) != Counter()
    # On one clock, an answer never arrives before its dispatch left.
    left = {(s.step, s.layer, s.micro_batch): s.start + attention.clock_offset
            for s in attention.spans if s.kind is SpanKind.SEND}
    for s in attention.spans:
        if s.kind is SpanKind.ARRIVE and s.step in whole:
            assert s.start + attention.clock_offset >= left[(s.step, s.layer, s.micro_batch)]
    # A decode step computes every layer of both micro-batches on each side (8 requests: 4 each).
    decode_steps = [s.step for s in attention.spans if s.kind is SpanKind.STEP and s.tokens and not s.prefill_tokens]
    computes = Counter(s.step for s in expert.spans if s.kind is SpanKind.COMPUTE)
    assert decode_steps and all(computes[step] == LAYERS * 2 for step in decode_steps)
    # The window's steps: the decode-only steps after the last one with prompt tokens (a prompt
    # that reached the node late, say, under asynchronous scheduling a step later still).
    last_prefill = max(s.step for s in attention.spans if s.kind is SpanKind.STEP and s.prefill_tokens)
    assert result.steps == len([s for s in decode_steps if s > last_prefill]) > 0
    assert 0 < result.efficiency <= 1.0 + 1e-6
    assert all(0 <= n.busy_fraction <= 1.0 + 1e-6 for n in result.nodes)
    assert row["overlap"]["bottleneck"] in {attention.name, expert.name}


def test_bench_prints_efficiency_and_writes_json_and_chart(tmp_path, capsys):
    out_json, out_png = tmp_path / "pipeline.json", tmp_path / "gantt.png"
    assert bench_pipeline.run("deploy/plans/tiny-cpu.yaml", [1, 2], 8, 8, 10, str(out_json), str(out_png)) == 0
    printed = capsys.readouterr().out
    assert "efficiency" in printed and "attention0" in printed and "expert0" in printed
    report = json.loads(out_json.read_text())
    assert [r["micro_batches"] for r in report["results"]] == [1, 2]
    for r in report["results"]:
        nodes = r["overlap"]["nodes"]
        assert set(nodes) == {"attention0", "expert0"}
        assert r["overlap"]["efficiency"] == max(n["busy_fraction"] for n in nodes.values())
        assert all(n["computes"] > 0 and n["mean_compute_ms"] > 0 for n in nodes.values())
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
