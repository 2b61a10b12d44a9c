"""How well a deployment's nodes overlapped, read from their own timelines
(megainfer/disagg/node_timeline.py, gathered by deploy/timeline_calls.py): the decode window, each
node's busy time in it, the pipeline's efficiency, and the Gantt chart of MegaScale-Infer's
Figure 4 (attention and expert lanes, micro-batches coloured, messages drawn between them).

Definitions, all on the driver's clock:
- the decode window runs from the first decode-only step that starts after the last step
  with prompt tokens ends, to the end of the last step with tokens (attention nodes' STEP
  spans; several attention nodes: the earliest start, the latest end);
- a node is busy while it runs a step and is not waiting for a peer: its STEP spans minus
  its WAIT spans, each clipped to the window (an idle node between steps is not busy);
- its compute is its COMPUTE spans in the window (on CUDA: device time, from CUDA events);
- the bottleneck is the node with the most busy time, and the pipeline's efficiency is its
  busy time over the window: 1.0 when the slowest node never waits.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from megainfer.errors import MegaInferError
from megainfer.messages import NodeRole, NodeTimeline, Span, SpanKind


@dataclass
class NodeOverlap:
    name: str
    role: NodeRole
    busy_s: float  # stepping and not waiting for a peer, inside the window
    compute_s: float  # COMPUTE spans inside the window
    computes: int  # (layer, micro-batch) computes that started in the window
    busy_fraction: float

    @property
    def mean_compute_ms(self) -> float:
        """One (layer, micro-batch)'s compute on this node, on average."""
        return 1e3 * self.compute_s / max(self.computes, 1)


@dataclass
class PipelineOverlap:
    window: tuple[float, float]  # the decode window (driver clock)
    steps: int  # decode-only steps in it (on the first attention node)
    nodes: list[NodeOverlap]

    @property
    def wall_s(self) -> float:
        return self.window[1] - self.window[0]

    @property
    def bottleneck(self) -> NodeOverlap:
        return max(self.nodes, key=lambda n: n.busy_s)

    @property
    def efficiency(self) -> float:
        return self.bottleneck.busy_fraction


def _shifted(timeline: NodeTimeline, kind: SpanKind) -> list[Span]:
    off = timeline.clock_offset
    return [Span(s.kind, s.step, s.layer, s.micro_batch, s.start + off, s.end + off, s.tokens, s.prefill_tokens)
            for s in timeline.spans if s.kind is kind]


def _clipped(spans: list[Span], lo: float, hi: float) -> float:
    return sum(max(0.0, min(s.end, hi) - max(s.start, lo)) for s in spans)


def decode_window(timelines: list[NodeTimeline]) -> tuple[tuple[float, float], int]:
    """The decode window and its step count (see the module's docstring)."""
    attention = [t for t in timelines if t.role is NodeRole.ATTENTION]
    steps = [(t.name, s) for t in attention for s in _shifted(t, SpanKind.STEP) if s.tokens]
    last_prefill = max((s.end for _, s in steps if s.prefill_tokens), default=float("-inf"))
    decode = [(name, s) for name, s in steps if not s.prefill_tokens and s.start >= last_prefill]
    if not decode:
        raise MegaInferError("the nodes' timelines hold no decode-only step after the last prefill: "
                             "nothing to measure (more output tokens per request?)")
    window = (min(s.start for _, s in decode), max(s.end for _, s in decode))
    return window, sum(1 for name, _ in decode if name == attention[0].name)


def overlap(timelines: list[NodeTimeline]) -> PipelineOverlap:
    (lo, hi), steps = decode_window(timelines)
    nodes = []
    for t in timelines:
        busy = _clipped(_shifted(t, SpanKind.STEP), lo, hi) - _clipped(_shifted(t, SpanKind.WAIT), lo, hi)
        computes = [s for s in _shifted(t, SpanKind.COMPUTE) if lo <= s.start < hi]
        nodes.append(NodeOverlap(t.name, t.role, busy, sum(s.end - s.start for s in computes), len(computes),
                                 busy / (hi - lo)))
    return PipelineOverlap((lo, hi), steps, nodes)


def plot_measured_gantt(runs: list[tuple[str, list[NodeTimeline], PipelineOverlap]], path: str, seconds: float | None = None,
               title: str = "") -> None:
    """One panel per run (its label, timelines and overlap), lanes per node, on a common time
    span: `seconds` (default: two decode steps of the first run) from the middle of each run's
    decode window. COMPUTE bars are coloured by micro-batch and labelled with their layer,
    WAIT spans hatched, and each message a line from its SEND to its ARRIVE."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    if seconds is None:
        first = runs[0][2]
        seconds = 2 * first.wall_s / max(first.steps, 1)
    colours = plt.get_cmap("tab10").colors
    lanes_max = max(len(timelines) for _, timelines, _ in runs)
    fig, axes = plt.subplots(len(runs), 1, figsize=(12, 0.9 + 0.75 * lanes_max * len(runs)), squeeze=False)
    for ax, (label, timelines, result) in zip(axes[:, 0], runs):
        lo = (result.window[0] + result.window[1] - seconds) / 2
        hi = lo + seconds
        ordered = sorted(timelines, key=lambda t: (t.role is not NodeRole.ATTENTION, t.name))
        lane = {t.name: i for i, t in enumerate(ordered)}
        arrivals = defaultdict(list)  # (step, layer, micro-batch) -> (time, lane) of the other side's ARRIVEs
        for t in ordered:
            y = lane[t.name]
            for s in _shifted(t, SpanKind.WAIT):
                if s.end > lo and s.start < hi:
                    ax.barh(y, s.end - s.start, left=s.start - lo, height=0.5, color="none", edgecolor="0.6",
                            hatch="///", linewidth=0)
            for s in _shifted(t, SpanKind.COMPUTE):
                if s.end > lo and s.start < hi:
                    ax.barh(y, s.end - s.start, left=s.start - lo, height=0.7,
                            color=colours[s.micro_batch % len(colours)], edgecolor="black", linewidth=0.4)
                    if (s.end - s.start) / seconds > 0.025:
                        ax.text((s.start + s.end) / 2 - lo, y, f"L{s.layer}", ha="center", va="center", fontsize=7)
            for s in _shifted(t, SpanKind.ARRIVE):
                arrivals[(s.step, s.layer, s.micro_batch, t.role)].append((s.start, y))
        for t in ordered:
            other = NodeRole.EXPERT if t.role is NodeRole.ATTENTION else NodeRole.ATTENTION
            for s in _shifted(t, SpanKind.SEND):
                for at, y in arrivals.get((s.step, s.layer, s.micro_batch, other), []):
                    if lo < s.start < hi or lo < at < hi:
                        ax.plot([s.start - lo, at - lo], [lane[t.name], y], color="0.35", linewidth=0.5)
        ax.set_yticks(range(len(ordered)), [t.name for t in ordered])
        ax.set_ylim(len(ordered) - 0.4, -0.6)
        ax.set_xlim(0, seconds)
        ax.set_title(f"{label}: bottleneck {result.bottleneck.name} busy {result.efficiency:.0%}", fontsize=9)
    axes[-1, 0].set_xlabel("seconds (a window from the middle of the decode phase)")
    m_max = max(max((s.micro_batch for t in tl for s in t.spans if s.kind is SpanKind.COMPUTE), default=0)
                for _, tl, _ in runs)
    handles = [Patch(color=colours[j % len(colours)], label=f"micro-batch {j}") for j in range(m_max + 1)]
    handles.append(Patch(facecolor="none", edgecolor="0.6", hatch="///", label="waiting for a peer"))
    fig.legend(handles=handles, loc="upper right", fontsize=8, ncol=len(handles))
    if title:
        fig.suptitle(title, fontsize=10, x=0.01, ha="left")
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(path, dpi=130)
    plt.close(fig)
