"""Tokens routed to each expert of each layer over a sliding window of steps, decode steps and
steps with prompt tokens apart: MegaScale-Infer (§6) re-places experts from a previous window's
traffic, and finds decode's load stable across nearby batches while prefill's swings.

The counts are the gating kernel's own (the [layers, experts] pairs an engine step routes, read
back once per step with the step's results), so keeping the window costs two array additions
per step whatever the model's size (94 x 128 on Qwen3-235B). A step counts as prefill when it
carries any prompt tokens: a step's counts are not split by token.
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
        self._steps: deque[tuple[np.ndarray, bool]] = deque()
        self._sums = {False: np.zeros(self.shape, dtype=np.int64), True: np.zeros(self.shape, dtype=np.int64)}
        self._counts = {False: 0, True: 0}

    def observe(self, counts: np.ndarray, prefill: bool) -> None:
        """One step's [layers, experts] routed pairs (an empty array: the step routed none). Kept
        as a copy: a CPU runner's counts share memory with the tensor it zeroes every step."""
        counts = np.zeros(self.shape, dtype=np.int64) if counts.size == 0 else counts.copy()
        self._steps.append((counts, prefill))
        self._sums[prefill] += counts
        self._counts[prefill] += 1
        if len(self._steps) > self.window_steps:
            old, was_prefill = self._steps.popleft()
            self._sums[was_prefill] -= old
            self._counts[was_prefill] -= 1

    def report(self) -> ExpertLoadReport:
        return ExpertLoadReport(self._sums[False].copy(), self._sums[True].copy(), self._counts[False],
                                self._counts[True])
