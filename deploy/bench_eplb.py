"""`megainfer bench eplb PLAN.yaml`: expert load balance before and after one re-placement of a
deployment's experts, under a steady decode load (deploy/expert_rebalance.py).

The plan is deployed and `--requests` greedy requests decode `--output-len` tokens each. Once
every prompt has its first token, the expert nodes' own pair counters (the (token, expert)
pairs each computed, per layer: `NodeHealth.pairs`) and the delivered tokens are read over a
window of `--window-s` seconds: the imbalance is the busiest expert node's pairs over the mean
node's, decode tokens/s the tokens delivered over the window. Then the experts are re-placed
from the attention nodes' window of routed tokens, under that same load (asked for once; a plan
with `experts.rebalance.interval_s` > 0 re-places by itself, and the bench waits for its first
periodic re-placement instead), and the window is measured again. Every request's tokens are
compared with the colocated engine's (same prompts, greedy): a re-placement must not change one.

What a request waits for the switch: every delta is timed as the driver delivers it, and the
longest wait between two decode tokens of one request while the switch was under way (from the
staging done to every node past the agreed step, and a few steps after; a wait that began
before counts from then) is set against the longest such wait of the window before, in steps
(a step: the window before's seconds over the tokens each request gained in it):
`switch_added_steps`. The same for the staging (`staging_added_steps`), where loading the moved
experts shares this machine's two cores with the serving nodes. A switch that held no request
back more than one step adds at most 1, or 2 where the window before had no delivery that
brought two steps' tokens at once (the driver polls the nodes' outboxes, so a step's tokens may
arrive with the next one's).
"""

from __future__ import annotations

import functools
import queue
import random
import threading
import time
from dataclasses import asdict, dataclass

import numpy as np

from deploy.deployment import Deployment
from megainfer.tools.bench.report import format_table, write_json
from megainfer.errors import DataPlaneError, PlanError
from megainfer.expert_replicas import imbalance
from megainfer.llm import LLM
from megainfer.messages import ExpertLoadReport, FinishReason, NodeRole, RebalanceReport
from megainfer.plan import Plan
from megainfer.sampling_params import SamplingParams
from megainfer.server.backend import RequestStream
from megainfer.server.metrics import MetricsSnapshot


@dataclass
class Window:
    """One measured window of the decode load."""

    seconds: float
    decode_tokens: int
    node_pairs: list[int]  # each expert node's pairs over the window, all layers
    layer_imbalance: list[float]  # per layer, the busiest node over the mean

    @property
    def imbalance(self) -> float:
        return imbalance(np.asarray(self.node_pairs, dtype=np.float64))

    @property
    def tokens_per_s(self) -> float:
        return self.decode_tokens / self.seconds


class SteadyLoad:
    """`concurrency` greedy requests kept running: each one that finishes is replaced at once by
    a new one (a fresh random prompt), so the decode batch and its contexts stay the same from
    one window to the next; a thread of its own reads every stream."""

    def __init__(self, deployment: Deployment, concurrency: int, prompt_len: int, params: SamplingParams,
                 seed: int) -> None:
        self.deployment, self.prompt_len, self.params = deployment, prompt_len, params
        self.concurrency = concurrency
        self.rng = random.Random(seed)
        self.prompts: list[list[int]] = []
        self.tokens: list[list[int]] = []
        self.arrivals: list[list[float]] = []  # when the driver delivered each delta with tokens, per request
        self.finished: list[bool] = []
        self.errors: list[str] = []
        self.delivered = 0  # tokens so far, every request
        self._stopping = threading.Event()
        self._woken: queue.SimpleQueue[tuple[int, float]] = queue.SimpleQueue()  # (request, delivered at)
        self._open: dict[int, RequestStream] = dict(self._submit() for _ in range(concurrency))
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _submit(self) -> tuple[int, RequestStream]:
        i = len(self.prompts)
        self.prompts.append([self.rng.randrange(self.deployment.model.vocab_size) for _ in range(self.prompt_len)])
        self.tokens.append([])
        self.arrivals.append([])
        self.finished.append(False)
        stream = self.deployment.submit(f"eplb-{i}", self.prompts[i], self.params)
        stream.listen(functools.partial(self._delivered, i))
        return i, stream

    def _delivered(self, i: int) -> None:
        """The driver's delivering thread, for each delta of request i: when it was delivered. Timed
        here rather than when the reader gets to the stream, so a gap is the driver's, not the
        reader's sweep over 24 streams (up to ~0.1 s on two busy cores)."""
        self._woken.put((i, time.perf_counter()))

    def _read(self) -> None:
        while self._open:
            try:
                i, at = self._woken.get(timeout=0.05)
            except queue.Empty:
                continue
            stream = self._open.get(i)
            delta = stream.pop() if stream is not None else None
            if delta is None:  # a delta announced twice (`RequestStream.listen`), or its request done
                continue
            if delta.new_token_ids:
                self.arrivals[i].append(at)
            self.tokens[i] += delta.new_token_ids
            self.delivered += len(delta.new_token_ids)
            if delta.finished:
                if delta.finish_reason is FinishReason.ERROR:
                    self.errors.append(f"{stream.request_id}: {delta.error}")
                self.finished[i] = True
                del self._open[i]
                if not self._stopping.is_set():
                    j, new = self._submit()
                    self._open[j] = new

    def longest_wait(self, start: float, end: float) -> float:
        """The longest a request waited within [start, end] between two consecutive token deltas
        (its first, the prompt's, left out): each gap counted for its part inside the span, so a
        wait that began before a phase is not laid to it, nor one that ends after it."""
        longest = 0.0
        for times in self.arrivals:
            t = np.asarray(times[1:])
            if len(t) > 1:
                inside = np.minimum(t[1:], end) - np.maximum(t[:-1], start)
                longest = max(longest, float(inside.max()))
        return longest

    def all_started(self) -> bool:
        return all(self.tokens[i] for i in list(self._open))

    def finish(self, timeout: float) -> None:
        """No new requests; wait for the open ones."""
        self._stopping.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise DataPlaneError(f"requests still open after {timeout:g} s")


def expert_pairs(deployment: Deployment) -> np.ndarray:
    """[expert nodes, layers] pairs each expert leader has computed so far."""
    return np.array([h.pairs for h in deployment.health() if h.role is NodeRole.EXPERT and h.rank == 0],
                    dtype=np.int64)


def measure_window(deployment: Deployment, load: SteadyLoad, seconds: float) -> Window:
    pairs, delivered, start = expert_pairs(deployment), load.delivered, time.perf_counter()
    time.sleep(seconds)
    pairs = expert_pairs(deployment) - pairs
    elapsed, tokens = time.perf_counter() - start, load.delivered - delivered
    per_layer = [imbalance(col) for col in pairs.T]
    return Window(elapsed, tokens, pairs.sum(axis=1).tolist(), per_layer)


def colocated_tokens(plan: Plan, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    llm = LLM(plan.model, dtype=plan.dtype, device="cpu", max_num_seqs=plan.scheduler.max_num_seqs,
              max_num_batched_tokens=plan.scheduler.max_num_batched_tokens)
    return [out.outputs[0].token_ids for out in llm.generate(prompts, params)]


@dataclass
class SwitchStall:
    """The longest waits for a decode token within a re-placement's two phases against the window
    before's (`SteadyLoad.longest_wait`: a wait counts for its part inside the phase)."""

    step_s: float  # one step in the window before: its seconds over the tokens each request gained
    longest_before_s: float  # the window before: the same load, nothing re-placed
    longest_staging_s: float  # while the moved experts were loaded
    longest_switch_s: float  # from the staging done to a few steps past the switch

    def added_steps(self, longest_s: float) -> float:
        return max(0.0, longest_s - self.longest_before_s) / self.step_s if self.step_s else float("inf")

    @property
    def switch_added_steps(self) -> float:
        return self.added_steps(self.longest_switch_s)

    @property
    def staging_added_steps(self) -> float:
        return self.added_steps(self.longest_staging_s)

    @classmethod
    def of(cls, load: SteadyLoad, before: tuple[float, float], window: Window, started: float,
           report: RebalanceReport, ended: float) -> "SwitchStall":
        # Every running request gains a token a step (a decode load), so a step is the window's time
        # over the tokens one request gained; not a median gap: a poll may bring two steps' tokens.
        step = window.seconds * load.concurrency / window.decode_tokens if window.decode_tokens else 0.0
        switching = ended - report.switch_s
        return cls(step, load.longest_wait(*before), load.longest_wait(started, switching),
                   load.longest_wait(switching, ended + SWITCH_TAIL_STEPS * step))


SWITCH_TAIL_STEPS = 3  # the switch's phase: up to this many steps after every node passed it


@dataclass
class EplbResult:
    before: Window
    report: RebalanceReport
    after: Window
    tokens_equal: bool  # every finished request's tokens equal the colocated engine's
    errors: list[str]  # failed requests
    metrics: MetricsSnapshot  # the deployment's /metrics source after the re-placement
    stall: SwitchStall
    periodic: bool  # the plan's own periodic re-placement was measured (else one asked for)
    window: ExpertLoadReport | None  # the deployment's expert-load window just before it


def measure(plan: Plan, requests: int, prompt_len: int, output_len: int, window_s: float,
            seed: int = 0) -> EplbResult:
    if not plan.places_experts:
        raise PlanError("bench eplb re-places experts: the plan needs experts.redundant_per_node or "
                        "experts.rebalance (e.g. deploy/plans/skewed-cpu.yaml)")
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    periodic = bool(plan.experts.rebalance is not None and plan.experts.rebalance.interval_s)
    deployment = Deployment(plan, show_progress=False).start()
    try:
        load = SteadyLoad(deployment, requests, prompt_len, params, seed)
        deadline = time.monotonic() + 120
        while not load.all_started():  # the first prompts in: the load is decode from here
            if time.monotonic() > deadline or load.errors:
                raise DataPlaneError(f"the prompts did not all start: {load.errors[:1]}")
            time.sleep(0.05)
        time.sleep(window_s)  # requests replaced at staggered times, and the attention window full
        before_start = time.perf_counter()
        before = measure_window(deployment, load, window_s)
        before_span = (before_start, time.perf_counter())
        if periodic and deployment.rebalancer.reports:
            raise DataPlaneError(
                f"the plan's first periodic re-placement came before the window before it was measured: set "
                f"experts.rebalance.interval_s (now {plan.experts.rebalance.interval_s:g}) above the time it takes to "
                f"start the load and measure one window")
        window = deployment.expert_load()  # what the re-placement reads (GET /admin/experts/load serves it)
        started = time.perf_counter()
        report = first_periodic_report(deployment) if periodic else deployment.rebalance_experts()
        ended = time.perf_counter()
        after = measure_window(deployment, load, window_s)
        metrics = deployment.metrics_snapshot()
        load.finish(600)
    finally:
        deployment.close()
    done = [i for i, f in enumerate(load.finished) if f]
    want = colocated_tokens(plan, [load.prompts[i] for i in done], params)
    # A periodic re-placement's own start is not seen here: its staging gaps are those from the
    # bench's wait on (the serving load only, until it began).
    stall = SwitchStall.of(load, before_span, before, started, report, ended)
    return EplbResult(before, report, after, [load.tokens[i] for i in done] == want, load.errors, metrics, stall,
                      periodic, window)


def first_periodic_report(deployment: Deployment, timeout_s: float = 120.0) -> RebalanceReport:
    """The report of the deployment's first periodic re-placement (`experts.rebalance.interval_s`)."""
    reports, deadline = deployment.rebalancer.reports, time.monotonic() + timeout_s
    while not reports:
        if time.monotonic() > deadline:
            raise DataPlaneError(f"no periodic re-placement within {timeout_s:g} s (experts.rebalance.interval_s "
                                 f"{deployment.plan.experts.rebalance.interval_s:g})")
        time.sleep(0.02)
    return reports[0]


def run(plan_path: str, requests: int, prompt_len: int, output_len: int, window_s: float,
        json_path: str | None) -> int:
    plan = Plan.load(plan_path)
    print(f"deploying {plan_path} ({plan.model}, {plan.experts.nodes} expert nodes, "
          f"{plan.experts.redundant_per_node} spare slots each); {requests} requests x {output_len} tokens ...",
          flush=True)
    result = measure(plan, requests, prompt_len, output_len, window_s)
    before, report, after, equal, errors = (result.before, result.report, result.after, result.tokens_equal,
                                            result.errors)
    if report.error:
        print(f"the re-placement failed: {report.error}")
    print(format_table(["", "imbalance (max/mean pairs)", "worst layer", "decode tok/s", "pairs per expert node"],
                       [[name, f"{w.imbalance:.3f}", f"{max(w.layer_imbalance):.3f}", f"{w.tokens_per_s:.1f}",
                         ", ".join(map(str, w.node_pairs))] for name, w in (("before", before), ("after", after))]))
    print(f"decode tok/s after / before: {after.tokens_per_s / before.tokens_per_s:.2f}x")
    print(report.summary() + (" (the plan's own periodic re-placement)" if result.periodic else ""))
    stall = result.stall
    print(f"longest wait between two tokens of a request: {stall.longest_before_s * 1e3:.1f} ms before (a step: "
          f"{stall.step_s * 1e3:.1f} ms), {stall.longest_staging_s * 1e3:.1f} ms while the experts were staged "
          f"(+{stall.staging_added_steps:.2f} steps), {stall.longest_switch_s * 1e3:.1f} ms around the switch "
          f"(+{stall.switch_added_steps:.2f} steps)")
    print(f"tokens equal to the colocated engine's: {equal}; failed requests: {len(errors)}")
    if json_path:
        write_json(json_path, {
            "benchmark": "eplb", "plan": plan_path, "model": plan.model, "expert_nodes": plan.experts.nodes,
            "redundant_per_node": plan.experts.redundant_per_node, "requests": requests, "output_len": output_len,
            "window_s": window_s, "imbalance_before": before.imbalance, "imbalance_after": after.imbalance,
            "layer_imbalance_before": before.layer_imbalance, "layer_imbalance_after": after.layer_imbalance,
            "decode_tokens_per_s_before": before.tokens_per_s, "decode_tokens_per_s_after": after.tokens_per_s,
            "node_pairs_before": before.node_pairs, "node_pairs_after": after.node_pairs,
            "tokens_equal": equal, "failed_requests": errors, "rebalance": asdict(report),
            "periodic": result.periodic, "step_ms": stall.step_s * 1e3, "longest_gap_before_ms": stall.longest_before_s * 1e3,
            "longest_gap_staging_ms": stall.longest_staging_s * 1e3, "longest_gap_switch_ms": stall.longest_switch_s * 1e3,
            "staging_added_steps": stall.staging_added_steps, "switch_added_steps": stall.switch_added_steps})
        print(f"wrote {json_path}")
    return 0 if equal and not errors and not report.error else 1
