"""`bench soak`'s figures, from the requests' records, the nodes' resource samples and the faults:
requests by status, unended requests, leaks after the drain, RSS growth per node, p99 TTFT and
TBT over time windows, each fault's outcome; a printed table, the JSON and the plot.

Definitions (every time in seconds since the soak's start):
- a window is 1/`WINDOWS` of the duration; a request counts in the window it started in (its
  TTFT too), a gap between two token chunks of one completion in the window it ended in
  (TBT); what ended during the drain counts in the last window;
- a window has a fault when it overlaps [at_s, at_s + recovery_s] of one (bound_s where the
  fault did not recover); `fault_ttft_ratio` is p99 TTFT of the requests started in such
  windows over that of the others (a peer in the same run); `late_vs_early_ttft_ratio` that of
  the requests started in the second half over the first half after the warm-up, windows with
  a fault left out (whether serving slows down as it runs);
- RSS growth of a node = (RSS after the drain - baseline) / baseline, the baseline its first
  sample at least `warm_s` into its incarnation: into the soak for a process there from the
  start, after its first sample for a process chaos replaced (a new pid, listed in
  `pid_changes`); an incarnation sampled too briefly has its first sample as baseline
  (`baseline_warm` false);
- a fault's in-flight requests are those started before at_s and not ended by it;
  `in_flight_end_s` is how long after at_s the last of them ended (None while one is
  unended); a fault is ok when it recovered within bound_s and that end came within bound_s.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from megainfer.tools.bench.report import format_table, write_json
from megainfer.tools.bench.soak_traffic import CLEAN, RequestRecord, Status
from megainfer.messages import NodeResources

WINDOWS = 24
WARM_FRACTION = 0.1  # of the duration: the warm-up before the RSS baseline
MIB = 1 << 20
EXAMPLES = 3  # failed requests shown per status in the JSON
# Failures a fault or an overload explains (a deployment re-wiring, a full queue); any other
# failure status, for the soak's valid requests, is a bug and fails the soak.
EXPECTED = CLEAN | {Status.UNAVAILABLE, Status.RESOURCE_EXHAUSTED}


@dataclass
class ResourceSample:
    t_s: float
    nodes: list[NodeResources]


@dataclass
class Fault:
    """One injected fault, on the soak's clock."""

    kind: str
    target: str
    at_s: float
    recovery_s: float | None  # None: not recovered within bound_s
    bound_s: float
    detail: str = ""
    noticed_s: float | None = None  # after at_s, when the deployment noticed it (None: never seen)
    during_recovery: bool = False  # injected while the previous fault was still recovering

    @property
    def until_s(self) -> float:
        return self.at_s + (self.recovery_s if self.recovery_s is not None else self.bound_s)


@dataclass
class FaultOutcome:
    fault: Fault
    in_flight: int  # requests in flight at at_s
    in_flight_by_status: dict[str, int]
    in_flight_end_s: float | None  # after at_s, when the last of them ended; None: one is unended

    @property
    def ok(self) -> bool:
        bound = self.fault.bound_s
        return (self.fault.recovery_s is not None and self.fault.recovery_s <= bound
                and self.in_flight_end_s is not None and self.in_flight_end_s <= bound)

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self.fault), "in_flight": self.in_flight,
                "in_flight_by_status": self.in_flight_by_status, "in_flight_end_s": self.in_flight_end_s,
                "ok": self.ok}


@dataclass
class Window:
    t_s: float  # its start
    requests: int  # started in it
    failed: int  # of those, ended with a failure status or unended
    p99_ttft_ms: float | None  # None: no first token in it
    p99_tbt_ms: float | None
    fault: bool = False


@dataclass
class NodeMemory:
    pid: int  # the latest incarnation's
    born_s: float  # when that incarnation was first sampled (0: there from the start)
    baseline_bytes: int
    baseline_t_s: float
    final_bytes: int
    baseline_warm: bool = False  # the baseline was taken warm_s into the incarnation
    pid_changes: list[dict] = field(default_factory=list)  # {"t_s", "old_pid", "new_pid"}
    series: list[tuple[float, int]] = field(default_factory=list)  # (t_s, rss bytes), every sample

    @property
    def growth(self) -> float:
        return (self.final_bytes - self.baseline_bytes) / self.baseline_bytes if self.baseline_bytes else 0.0


def p99_ms(seconds: list[float]) -> float | None:
    return float(np.percentile(seconds, 99)) * 1e3 if seconds else None


def _slot(t: float, width: float, count: int) -> int:
    return min(max(int(t // width), 0), count - 1)


def windows(records: list[RequestRecord], duration_s: float, faults: list[Fault], count: int = WINDOWS) -> list[Window]:
    width = duration_s / count
    started: list[list[RequestRecord]] = [[] for _ in range(count)]
    gaps: list[list[float]] = [[] for _ in range(count)]
    for r in records:
        started[_slot(r.start_s, width, count)].append(r)
        for when, gap in r.tbt_gaps():
            gaps[_slot(when, width, count)].append(gap)
    out = []
    for k in range(count):
        lo, hi = k * width, (k + 1) * width
        ttfts = [r.ttft_s for r in started[k] if r.ttft_s is not None]
        out.append(Window(t_s=lo, requests=len(started[k]), failed=sum(r.status not in CLEAN for r in started[k]),
                          p99_ttft_ms=p99_ms(ttfts), p99_tbt_ms=p99_ms(gaps[k]),
                          fault=any(f.at_s < hi and f.until_s >= lo for f in faults)))
    return out


def fault_ttft_ratio(records: list[RequestRecord], marks: list[Window], duration_s: float) -> float | None:
    """p99 TTFT of requests started in windows with a fault over that of the other windows."""
    width = duration_s / len(marks)
    with_fault: list[float] = []
    without: list[float] = []
    for r in records:
        if r.ttft_s is not None:
            (with_fault if marks[_slot(r.start_s, width, len(marks))].fault else without).append(r.ttft_s)
    if not with_fault or not without:
        return None
    return p99_ms(with_fault) / p99_ms(without)


def keyed(nodes: list[NodeResources]) -> list[tuple[str, NodeResources]]:
    """Each rank with a name of its own: replicas of one plan repeat their nodes' names, so a
    repeated name gets its replica's number in the order listed (attention0@1, ...)."""
    seen: Counter[str] = Counter()
    repeated = {name for name, n in Counter(node.name for node in nodes).items() if n > 1}
    out = []
    for node in nodes:
        out.append((f"{node.name}@{seen[node.name]}" if node.name in repeated else node.name, node))
        seen[node.name] += 1
    return out


def late_vs_early_ttft_ratio(records: list[RequestRecord], marks: list[Window], duration_s: float,
                             warm_s: float) -> float | None:
    width = duration_s / len(marks)
    early: list[float] = []
    late: list[float] = []
    for r in records:
        if r.ttft_s is None or r.start_s < warm_s or marks[_slot(r.start_s, width, len(marks))].fault:
            continue
        (late if r.start_s >= duration_s / 2 else early).append(r.ttft_s)
    if not early or not late:
        return None
    return p99_ms(late) / p99_ms(early)


def node_memory(samples: list[ResourceSample], final: ResourceSample, warm_s: float) -> dict[str, NodeMemory]:
    """Each node's RSS baseline and growth up to `final`; a node replaced by chaos (a new pid)
    is measured from its new incarnation's warm baseline."""
    out: dict[str, NodeMemory] = {}
    timeline = [*samples, final]
    for sample in timeline:
        for name, node in keyed(sample.nodes):
            memory = out.get(name)
            if memory is None or memory.pid != node.pid:
                born = 0.0 if memory is None and sample is timeline[0] else sample.t_s
                changes = [] if memory is None else \
                    [*memory.pid_changes, {"t_s": sample.t_s, "old_pid": memory.pid, "new_pid": node.pid}]
                series = [] if memory is None else memory.series
                memory = out[name] = NodeMemory(node.pid, born, node.rss_bytes, sample.t_s, node.rss_bytes,
                                                     pid_changes=changes, series=series)
            if not memory.baseline_warm and sample.t_s >= memory.born_s + warm_s:
                memory.baseline_bytes, memory.baseline_t_s, memory.baseline_warm = node.rss_bytes, sample.t_s, True
            memory.final_bytes = node.rss_bytes
            memory.series.append((sample.t_s, node.rss_bytes))
    return out


def fault_outcomes(faults: list[Fault], records: list[RequestRecord]) -> list[FaultOutcome]:
    out = []
    for fault in faults:
        caught = [r for r in records if r.start_s <= fault.at_s and (r.end_s is None or r.end_s > fault.at_s)]
        ends = [r.end_s for r in caught]
        end = None if None in ends else max(ends, default=fault.at_s) - fault.at_s
        out.append(FaultOutcome(fault, len(caught), dict(Counter(str(r.status) for r in caught)), end))
    return out


@dataclass
class SoakRun:
    """What the soak measured, the report's input."""

    plan: str
    duration_s: float
    concurrency: int
    seed: int
    chaos: bool
    records: list[RequestRecord]
    samples: list[ResourceSample]  # during the soak
    final: ResourceSample  # after the drain
    faults: list[Fault] = field(default_factory=list)
    idle_after_s: float | None = None  # how long after the drain every node was idle and serving; None: never
    idle_bound_s: float = 0.0
    client_restarts: list[float] = field(default_factory=list)


@dataclass
class SoakSummary:
    run: SoakRun
    requests_by_status: dict[str, int]
    unended_requests: int
    failed: int  # ended with a status outside CLEAN (unended not counted)
    unexpected: dict[str, int]  # failures outside EXPECTED, by status (unended not counted)
    examples: dict[str, list[str]]  # a few failed requests per status: what the client saw
    leaked_kv_blocks: int
    leaked_slots: int
    leaks_by_node: dict[str, dict[str, int]]  # nodes holding anything after the drain
    memory: dict[str, NodeMemory]
    windows: list[Window]
    faults: list[FaultOutcome]
    fault_ttft_ratio: float | None
    late_vs_early_ttft_ratio: float | None
    p99_ttft_ms: float | None
    p99_tbt_ms: float | None

    @property
    def failures(self) -> list[str]:
        """Why the soak fails (exit status 1), empty when it passes."""
        out = []
        if self.unended_requests:
            out.append(f"{self.unended_requests} request(s) without an end")
        if self.unexpected:
            out.append("request(s) ended with an unexpected status: "
                       + ", ".join(f"{status} {n}" for status, n in self.unexpected.items()))
        if self.leaked_kv_blocks or self.leaked_slots:
            out.append(f"leaked after the drain: {self.leaked_kv_blocks} KV block(s), {self.leaked_slots} slot(s)")
        if self.run.idle_after_s is None:
            out.append(f"the deployment did not report idle and serving within {self.run.idle_bound_s:g} s")
        out += [f"fault {o.fault.kind} on {o.fault.target} at {o.fault.at_s:.0f} s: recovery {o.fault.recovery_s} s, "
                f"in-flight end {o.in_flight_end_s} s, bound {o.fault.bound_s:g} s" for o in self.faults if not o.ok]
        return out

    def to_json(self) -> dict:
        run = self.run
        return {
            "benchmark": "soak", "plan": run.plan, "duration_s": run.duration_s, "concurrency": run.concurrency,
            "seed": run.seed, "chaos": run.chaos, "passed": not self.failures, "failures": self.failures,
            "requests_started": len(run.records),
            "requests_finished": len(run.records) - self.unended_requests, "requests_failed": self.failed,
            "requests_by_status": self.requests_by_status, "unended_requests": self.unended_requests,
            "unexpected_statuses": self.unexpected, "failure_examples": self.examples,
            "unended": [_request_json(r) for r in run.records if r.status is Status.UNENDED],
            "leaked_kv_blocks": self.leaked_kv_blocks, "leaked_slots": self.leaked_slots,
            "leaks_by_node": self.leaks_by_node, "idle_after_drain_s": run.idle_after_s,
            "rss_growth": {name: m.growth for name, m in self.memory.items()},
            "rss": {name: {"pid": m.pid, "baseline_bytes": m.baseline_bytes, "baseline_t_s": m.baseline_t_s,
                           "baseline_warm": m.baseline_warm, "final_bytes": m.final_bytes,
                           "pid_changes": m.pid_changes, "series": [[t, b] for t, b in m.series]}
                    for name, m in self.memory.items()},
            "p99_ttft_ms": self.p99_ttft_ms, "p99_tbt_ms": self.p99_tbt_ms,
            "windows": [dataclasses.asdict(w) for w in self.windows],
            "faults": [o.to_json() for o in self.faults], "fault_ttft_ratio": self.fault_ttft_ratio,
            "late_vs_early_ttft_ratio": self.late_vs_early_ttft_ratio,
            "client_restarts_s": run.client_restarts,
        }


def _request_json(r: RequestRecord) -> dict:
    return {"request_id": r.request_id, "frontend": r.frontend.value, "prompt": r.prompt_kind, "stream": r.stream,
            "n": r.n, "ending": r.ending.value, "start_s": r.start_s, "phase": r.phase,
            "first_token_s": r.first_token_s,
            "last_token_s": max((t[-1] for t in r.token_times if t), default=None),
            "token_chunks": sum(map(len, r.token_times))}


def summarize(run: SoakRun) -> SoakSummary:
    faults = sorted(run.faults, key=lambda f: f.at_s)
    marks = windows(run.records, run.duration_s, faults)
    by_status = Counter(str(r.status) for r in run.records)
    leaks = {name: {"kv_blocks": n.kv_blocks_used, "slots": n.slots_held + n.slots_unreleased}
             for name, n in keyed(run.final.nodes) if n.kv_blocks_used or n.slots_held or n.slots_unreleased}
    examples: dict[str, list[str]] = {}
    for r in run.records:
        if r.status not in CLEAN and len(examples.setdefault(str(r.status), [])) < EXAMPLES:
            examples[str(r.status)].append(
                f"{r.request_id}: {r.frontend.value} {r.prompt_kind} {'stream' if r.stream else 'whole'} n={r.n} "
                f"{r.ending.value}, started at {r.start_s:.1f} s, {sum(map(len, r.token_times))} token chunk(s): "
                f"{r.detail}")
    ttfts = [r.ttft_s for r in run.records if r.ttft_s is not None]
    gaps = [gap for r in run.records for _, gap in r.tbt_gaps()]
    return SoakSummary(
        run=run, requests_by_status=dict(by_status.most_common()), unended_requests=by_status[str(Status.UNENDED)],
        failed=sum(r.status not in CLEAN and r.status is not Status.UNENDED for r in run.records),
        unexpected={s: n for s, n in by_status.items() if Status(s) not in EXPECTED and s != str(Status.UNENDED)},
        examples=examples,
        leaked_kv_blocks=sum(n.kv_blocks_used for n in run.final.nodes),
        leaked_slots=sum(n.slots_held + n.slots_unreleased for n in run.final.nodes), leaks_by_node=leaks,
        memory=node_memory(run.samples, run.final, WARM_FRACTION * run.duration_s), windows=marks,
        faults=fault_outcomes(faults, run.records),
        fault_ttft_ratio=fault_ttft_ratio(run.records, marks, run.duration_s) if faults else None,
        late_vs_early_ttft_ratio=late_vs_early_ttft_ratio(run.records, marks, run.duration_s,
                                                          WARM_FRACTION * run.duration_s),
        p99_ttft_ms=p99_ms(ttfts), p99_tbt_ms=p99_ms(gaps))


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def format_report(summary: SoakSummary) -> str:
    run = summary.run
    lines = [f"soak of {run.plan}: {run.duration_s:g} s, {run.concurrency} clients"
             f"{', with chaos' if run.chaos else ''}, seed {run.seed}", ""]
    lines.append(format_table(["status", "requests"], [[s, n] for s, n in summary.requests_by_status.items()]
                              + [["(started)", len(run.records)]]))
    lines.append("")
    lines.append(format_table(["t (s)", "requests", "failed", "p99 TTFT ms", "p99 TBT ms", "fault"],
                              [[f"{w.t_s:.1f}", w.requests, w.failed, _ms(w.p99_ttft_ms), _ms(w.p99_tbt_ms),
                                "yes" if w.fault else ""] for w in summary.windows]))
    lines.append("")
    if summary.memory:
        lines.append(format_table(["node", "pid", "baseline MiB", "after drain MiB", "RSS growth", "restarts"],
                                  [[name, m.pid, m.baseline_bytes / MIB, m.final_bytes / MIB,
                                    f"{100 * m.growth:+.1f}%" + ("" if m.baseline_warm else " (cold baseline)"),
                                    len(m.pid_changes)] for name, m in summary.memory.items()]))
    else:
        lines.append("no node answered a resource sample: RSS and leaks unknown")
    if summary.faults:
        lines.append("")
        lines.append(format_table(
            ["fault", "target", "at s", "noticed s", "recovery s", "bound s", "in flight", "in-flight end s", "ok"],
            [[o.fault.kind + (" (during recovery)" if o.fault.during_recovery else ""), o.fault.target,
              f"{o.fault.at_s:.1f}", "-" if o.fault.noticed_s is None else f"{o.fault.noticed_s:.1f}",
              "never" if o.fault.recovery_s is None else f"{o.fault.recovery_s:.1f}", f"{o.fault.bound_s:g}",
              o.in_flight, "unended" if o.in_flight_end_s is None else f"{o.in_flight_end_s:.1f}",
              "yes" if o.ok else "NO"] for o in summary.faults]))
        ratio = summary.fault_ttft_ratio
        lines.append(f"p99 TTFT in windows with a fault vs without: "
                     f"{'-' if ratio is None else f'{ratio:.2f}x'}")
    lines.append("")
    drift = summary.late_vs_early_ttft_ratio
    lines.append(f"p99 TTFT, second half vs first (windows without a fault): "
                 f"{'-' if drift is None else f'{drift:.2f}x'}")
    lines.append(f"p99 TTFT {_ms(summary.p99_ttft_ms)} ms, p99 TBT {_ms(summary.p99_tbt_ms)} ms; "
                 f"unended requests {summary.unended_requests}; leaked after the drain: "
                 f"{summary.leaked_kv_blocks} KV block(s), {summary.leaked_slots} slot(s)")
    failures = summary.failures
    lines.append("PASS" if not failures else "FAIL (exit status 1): " + "; ".join(failures))
    return "\n".join(lines)


def save_json(summary: SoakSummary, path: str | Path) -> None:
    write_json(path, summary.to_json())


def plot(summary: SoakSummary, path: str | Path) -> None:
    """p99 TTFT and TBT per window and RSS per node over time; faults as vertical lines (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    width = summary.run.duration_s / len(summary.windows)
    mids = [w.t_s + width / 2 for w in summary.windows]
    fig, axes = plt.subplots(3, 1, figsize=(10, 9), sharex=True)
    for ax, label, values in ((axes[0], "p99 TTFT (ms)", [w.p99_ttft_ms for w in summary.windows]),
                              (axes[1], "p99 TBT (ms)", [w.p99_tbt_ms for w in summary.windows])):
        ax.plot(mids, [np.nan if v is None else v for v in values], marker="o")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    for name, memory in summary.memory.items():
        times = [t for t, _ in memory.series if np.isfinite(t)]
        axes[2].plot(times, [b / MIB for t, b in memory.series if np.isfinite(t)], label=name)
    axes[2].set_ylabel("RSS (MiB)")
    axes[2].set_xlabel("seconds since the soak's start")
    axes[2].grid(alpha=0.3)
    if summary.memory:
        axes[2].legend(fontsize="small")
    for o in summary.faults:
        for ax in axes:
            ax.axvline(o.fault.at_s, color="red" if not o.ok else "tab:orange", linestyle="--", alpha=0.8)
        axes[0].annotate(o.fault.kind, (o.fault.at_s, 1.0), xycoords=("data", "axes fraction"), rotation=90,
                         va="top", ha="right", fontsize="x-small")
    run = summary.run
    fig.suptitle(f"soak of {run.plan}: {run.duration_s:g} s, {run.concurrency} clients"
                 f"{', chaos' if run.chaos else ''}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
