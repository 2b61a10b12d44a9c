"""Tokens routed to each expert of each layer over a sliding window of steps, decode steps and
steps with prompt tokens apart: MegaScale-Infer (§6) re-places experts from a previous window's
traffic, and finds decode's load stable across nearby batches while prefill's swings.

The counts are a colocated engine's gating kernel's (the [layers, experts] pairs an engine step
routes, read back once per step with the step's results), or a disaggregated attention node's
expert nodes' own (their load round, megainfer/disagg/expert_load_round.py: the whole
deployment's, with each expert node's pairs per layer beside them). Keeping the window costs a
few array additions per step whatever the model's size (94 x 128 on Qwen3-235B). A step counts
as prefill when it carries any prompt tokens (disaggregated: when any attention node's does): a
step's counts are not split by token.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from megainfer.messages import ExpertLoadReport


class ExpertLoadWindow:
    def __init__(self, num_layers: int, num_experts: int, window_steps: int) -> None:
        if window_steps <= 0:
            raise ValueError(f"the expert-load window must hold at least one step, got {window_steps}")
        self.shape = (num_layers, num_experts)
        self.window_steps = window_steps
        self._steps: deque[tuple[np.ndarray, bool, np.ndarray | None]] = deque()
        self._sums = {False: np.zeros(self.shape, dtype=np.int64), True: np.zeros(self.shape, dtype=np.int64)}
        self._counts = {False: 0, True: 0}
        self._node_sum: np.ndarray | None = None  # [layers, expert nodes], where the expert nodes count

    def observe(self, counts: np.ndarray, prefill: bool, node_pairs: np.ndarray | None = None) -> None:
        """One step's [layers, experts] routed pairs (an empty array: the step routed none), and
        with the expert nodes' counts, each node's pairs per layer [layers, nodes]. Kept as copies:
        a CPU runner's counts share memory with the tensor it zeroes every step."""
        counts = np.zeros(self.shape, dtype=np.int64) if counts.size == 0 else counts.copy()
        nodes = None if node_pairs is None else node_pairs.copy()
        if nodes is not None and (self._node_sum is None or self._node_sum.shape != nodes.shape):
            # the first step, or another set of expert nodes: the node sums start from this step
            self._node_sum = np.zeros(nodes.shape, dtype=np.int64)
            self._steps = deque((c, p, None) for c, p, _ in self._steps)
        self._steps.append((counts, prefill, nodes))
        self._sums[prefill] += counts
        self._counts[prefill] += 1
        if nodes is not None:
            self._node_sum += nodes
        if len(self._steps) > self.window_steps:
            old, was_prefill, old_nodes = self._steps.popleft()
            self._sums[was_prefill] -= old
            self._counts[was_prefill] -= 1
            if old_nodes is not None:
                self._node_sum -= old_nodes

    def report(self) -> ExpertLoadReport:
        return ExpertLoadReport(self._sums[False].copy(), self._sums[True].copy(), self._counts[False],
                                self._counts[True], None if self._node_sum is None else self._node_sum.copy())
