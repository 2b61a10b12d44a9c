"""Re-placing a deployment's experts while it serves (MegaScale-Infer §6, "Load balance"; vLLM
and SGLang call it EPLB): from the tokens each expert took over the attention nodes' last
window of steps, the redundancy plan (planner/expert_placement.py) decides each layer's replicas
and their shares; the experts that move are loaded on their new nodes beside the serving ones;
then every rank switches at one agreed step.

1. **Window.** The deployment's traffic: the expert nodes count the pairs they compute and send
   every attention rank the step's counts (megainfer/disagg/expert_load_round.py), so any
   attention leader's `ExpertLoadReport` holds all of it.
2. **Plan.** Per layer, the redundancy plan with the plan's spare slots (experts.redundant_per_node)
   and floor cost (`planner.expert_placement.re_place`); each node's new experts keep the rows of
   those it already holds (`aligned`), so only the experts that really move are loaded.
3. **Stage.** Every expert rank loads its new rows (from the checkpoint; CPU or device memory
   beside the serving weights) while the deployment keeps serving. Any failure: every rank
   drops the staged placement, and the old one keeps serving.
4. **Switch.** The step S is chosen ahead of every attention node's current step by a margin
   (steps covering SWITCH_AHEAD_S at the measured step rate, at least MIN_AHEAD_STEPS) and sent
   to every rank; attention ranks route by the new slot tables from S on, expert leaders serve
   S's rounds with the new weights, followers as their leader's header says. A rank reached
   after S began refuses (never routes old maps into new weights); the others are cancelled.

No request waits: staging runs beside the step loop, and the switch itself is a copy of the
changed rows and of the slot maps between two steps.
"""

from __future__ import annotations

import logging
import math
import threading
import time

import numpy as np

from deploy.node_group import NodeGroup
from deploy.ray_calls import gather
from megainfer.config import ModelConfig
from megainfer.errors import ConfigError, DataPlaneError
from megainfer.expert_replicas import ExpertReplicas, imbalance, placed_load
from megainfer.messages import ExpertLoadReport, RebalanceReport, StagedPlacement
from megainfer.plan import Plan
from planner.expert_placement import re_place

logger = logging.getLogger(__name__)

STAGE_TIMEOUT_S = 600.0  # loading the moved experts: a checkpoint read on a real cluster
CALL_TIMEOUT_S = 10.0
SWITCH_AHEAD_S = 0.5  # the switch step lies this far ahead of the fastest attention node
MIN_AHEAD_STEPS = 4
RATE_SAMPLE_S = 0.1  # how long the step rate is measured over
SWITCH_WAIT_S = 60.0  # for every attention node to pass the switch step
THIN_PHASE = 0.25  # a phase holding less of the window's pairs than this is too little to plan from


class ExpertRebalancer:
    """One node group's expert placement: what serves now, and the re-placements."""

    def __init__(self, group: NodeGroup, plan: Plan, model: ModelConfig) -> None:
        self.group, self.plan, self.model = group, plan, model
        self.current = group.expert_replicas = plan.expert_replicas(model)
        self.spec = plan.experts.rebalance
        self.reports: list[RebalanceReport] = []
        self._lock = threading.Lock()  # one re-placement at a time
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def load(self) -> ExpertLoadReport:
        """The deployment's window, from every attention leader's (ExpertLoadReport.deployment)."""
        reports = [r for r in gather([n.expert_load.remote() for n in self.group.attention], CALL_TIMEOUT_S)
                   if isinstance(r, ExpertLoadReport)]
        if not reports:
            raise DataPlaneError("no attention node reported its expert loads")
        return ExpertLoadReport.deployment(reports)

    def propose(self, loads: np.ndarray) -> ExpertReplicas:
        """Every layer's redundancy plan from `loads` [layers, experts], as the next version."""
        floor = self.spec.floor_tokens if self.spec is not None else 0.0
        return self.current.replaced(re_place(loads, self.current.held(), self.plan.experts.redundant_per_node, floor))

    def rebalance(self) -> RebalanceReport:
        """One re-placement from the present window; the report says what moved and when it switched."""
        if not self.plan.places_experts:
            raise ConfigError("this plan's experts cannot move: set experts.redundant_per_node or "
                              "experts.rebalance in the plan")
        with self._lock:
            start = time.perf_counter()
            window = self.load()
            phase = self._phase(window)
            loads = window.of(phase)
            new = self.propose(loads)
            before, after = (imbalance(placed_load(r, loads)[0]) for r in (self.current, new))
            report = RebalanceReport(new.version, phase, int(loads.sum()), before, after)
            try:
                staged = self._stage(new)
                report.bytes_moved = sum(s.bytes_loaded for s in staged)
                report.experts_moved = sum(s.experts_loaded for s in staged)
                report.stage_s = max((s.seconds for s in staged), default=0.0)
                switching = time.perf_counter()
                report.switch_step = self._switch(new)
                report.switch_s = time.perf_counter() - switching
                self.current = self.group.expert_replicas = new
            except DataPlaneError as exc:
                report.error = str(exc)
                logger.warning("expert re-placement %d not made, the old placement serves: %s", new.version, exc)
            report.seconds = time.perf_counter() - start
            self.reports.append(report)
            if not report.error:
                logger.info("%s", report.summary())
            return report

    def _phase(self, window: ExpertLoadReport) -> str:
        """The plan's phase, unless its steps hold under THIN_PHASE of the window's pairs (under a
        steady arrival of prompts nearly every step carries one): then all of them, said in the log."""
        phase = self.spec.phase if self.spec is not None else "decode"
        total = window.of("all").sum()
        if phase != "all" and window.of(phase).sum() < THIN_PHASE * total:
            logger.info("expert re-placement: the window's %s steps hold %d of its %d pairs; balancing all of them",
                        phase, window.of(phase).sum(), total)
            return "all"
        return phase

    # -- the two phases ----------------------------------------------------------------------------
    def _expert_ranks(self) -> list:
        return self.group.experts + self.group.expert_shards

    def _attention_ranks(self) -> list:
        return self.group.attention + self.group.shards

    def _stage(self, new: ExpertReplicas) -> list[StagedPlacement]:
        answers = gather([n.stage_experts.remote(new) for n in self._expert_ranks()], STAGE_TIMEOUT_S)
        failed = [a for a in answers if not isinstance(a, StagedPlacement)]
        if failed:
            self._cancel(new.version)
            raise DataPlaneError(f"staging expert placement {new.version} failed on {len(failed)} expert rank(s): "
                                 f"{failed[0]}")
        return answers

    def _switch(self, new: ExpertReplicas) -> int:
        step = self._switch_step()
        calls = [n.switch_experts.remote(step, new) for n in self._attention_ranks()]
        calls += [n.switch_experts.remote(step, new.version) for n in self.group.experts]
        failed = [a for a in gather(calls, CALL_TIMEOUT_S) if isinstance(a, BaseException)]
        if failed:
            self._cancel(new.version)
            raise DataPlaneError(f"switching to expert placement {new.version} at step {step} was refused: "
                                 f"{failed[0]}")
        self._wait_past(step)
        return step

    def _cancel(self, version: int) -> None:
        gather([n.cancel_experts.remote(version) for n in self._attention_ranks() + self._expert_ranks()],
               CALL_TIMEOUT_S)

    def _steps(self) -> list[int]:
        answers = gather([n.step_id.remote() for n in self.group.attention], CALL_TIMEOUT_S)
        steps = [a for a in answers if isinstance(a, int)]
        if len(steps) != len(answers):
            raise DataPlaneError("an attention node did not say which step it is at")
        return steps

    def _switch_step(self) -> int:
        """Far enough ahead of every attention node that the message reaches each rank first."""
        first, t0 = max(self._steps()), time.perf_counter()
        time.sleep(RATE_SAMPLE_S)
        now = max(self._steps())
        rate = (now - first) / (time.perf_counter() - t0)
        return now + max(MIN_AHEAD_STEPS, math.ceil(rate * SWITCH_AHEAD_S))

    def _wait_past(self, step: int) -> None:
        deadline = time.monotonic() + SWITCH_WAIT_S
        while min(self._steps()) <= step:
            if time.monotonic() > deadline:
                raise DataPlaneError(f"the attention nodes did not reach step {step} within {SWITCH_WAIT_S:g} s")
            time.sleep(0.01)

    # -- periodic ------------------------------------------------------------------------------------
    def start(self) -> None:
        """Re-place every `experts.rebalance.interval_s` (0: only when asked)."""
        if self.spec is None or not self.spec.interval_s:
            return
        self._thread = threading.Thread(target=self._every_interval, name="expert-rebalance", daemon=True)
        self._thread.start()

    def _every_interval(self) -> None:
        while not self._stop.wait(self.spec.interval_s):
            try:
                self.rebalance()
            except Exception as exc:  # a failed round is reported, the next one is tried
                logger.warning("expert re-placement failed: %s", exc)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
