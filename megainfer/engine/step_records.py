"""What an engine keeps of the steps it has finished, for two readers:

- its statistics (`Engine.stats`): running totals of steps and tokens, the tokens routed to
  each (layer, expert), expert activations and the expert-weight bytes they read, the energy
  drawn since the engine was built;
- a router (`Engine.node_state`): each step's work and measured time, and the lengths of the
  requests it finished, held until the router drains them (bounded if nobody does), and fed at
  once to the engine's own step-time model when it balances its steps by time.
"""

from __future__ import annotations

import copy
from collections import deque
from typing import TYPE_CHECKING

import numpy as np

from kernels.compile_watch import WATCH
from megainfer.config import ModelConfig
from megainfer.engine.expert_load_window import ExpertLoadWindow
from megainfer.messages import EngineStats, ExpertLoad, StepSample
from megainfer.routing.online_step_model import OnlineStepModel
from megainfer.runner.energy import EnergyMeter
from megainfer.runner.model_runner import StepResult
from megainfer.scheduling.node_state import step_sample
from megainfer.scheduling.scheduler import Scheduler
from megainfer.scheduling.scheduler_output import SchedulerOutput
from megainfer.scheduling.sequence import STATUS, Sequence, SequenceStatus


if TYPE_CHECKING:
    from kernels.startup import KernelReport


class StepRecords:
    """One engine's records of its finished steps (the module's docstring says who reads them)."""

    def __init__(self, model_config: ModelConfig, dtype: str, device: str, num_kv_blocks: int,
                 step_model: OnlineStepModel | None = None, expert_load_window: int = 64) -> None:
        """step_model: the engine's own model of its step time (attention balancing), or None.
        expert_load_window: the steps whose routed tokens per expert it keeps (expert_load_window.py)."""
        self.num_layers = model_config.num_layers
        self.step_model = step_model
        self.totals = EngineStats(num_kv_blocks=num_kv_blocks)
        # Tokens routed to each (layer, expert) so far, and the last step's: arrays, into the
        # stats' lists when they are asked for.
        self.expert_tokens = np.zeros((model_config.num_layers, model_config.num_experts), dtype=np.int64)
        self.last_expert_counts: np.ndarray | None = None
        self.expert_window = ExpertLoadWindow(model_config.num_layers, model_config.num_experts, expert_load_window)
        self.expert_bytes = model_config.expert_bytes(dtype)
        self.energy = EnergyMeter(device)  # counts from here: the engine's energy, not the process's
        # What a router learns from (drained by `drain`); bounded if nobody asks.
        self.measured_steps: deque[StepSample] = deque(maxlen=1024)
        self.finished_lengths: deque[tuple[int, int]] = deque(maxlen=1024)

    def step_finished(self, out: SchedulerOutput, result: StepResult, seconds: float, step_id: int,
                      advanced: list[Sequence]) -> None:
        """A step's statistics, once its sequences are advanced: its time for the router, the
        requests it finished, its expert loads."""
        measured = step_sample(out, seconds, self.num_layers, step_id)
        self.measured_steps.append(measured)
        if self.step_model is not None:
            self.step_model.observe((measured,))
        # Most steps finish none of their thousands: one C-level look at the statuses first.
        if SequenceStatus.FINISHED in map(STATUS, advanced):
            self.finished_lengths.extend((s.num_prompt_tokens, s.num_output_tokens) for s in advanced if s.is_finished)
        self._count(out, result)

    def _count(self, out: SchedulerOutput, result: StepResult) -> None:
        # Array work: the plan's models route to [94 layers x 128 experts] every step.
        t = self.totals
        t.num_steps += 1
        t.num_computed_tokens += out.total_tokens
        t.num_generated_tokens += len(result.sampled) - result.sampled.count(None)
        counts = np.asarray(result.expert_counts, dtype=np.int64)
        if counts.size:
            self.expert_tokens += counts
        node_load = result.expert_node_load
        if node_load is not None:  # the expert nodes' own counts: the whole deployment's, router-independent
            self.expert_window.observe(node_load.counts, node_load.prefill, node_load.node_pairs)
        else:
            self.expert_window.observe(counts, prefill=out.carries_prompt_tokens)
        num_activated = int(np.count_nonzero(counts))
        t.expert_activations += num_activated
        t.expert_bytes_read += num_activated * self.expert_bytes
        self.last_expert_counts = counts

    def drain(self) -> tuple[list[StepSample], list[tuple[int, int]]]:
        """The steps measured and the (prompt, output) lengths of the requests finished since the
        last call, for a router."""
        steps, finished = list(self.measured_steps), list(self.finished_lengths)
        self.measured_steps.clear()
        self.finished_lengths.clear()
        return steps, finished

    def stats(self, scheduler: Scheduler, kernels: KernelReport | None) -> EngineStats:
        """The totals so far, with the scheduler's present state and the runner's kernel report."""
        s = copy.deepcopy(self.totals)
        s.expert_tokens = self.expert_tokens.tolist()
        s.expert_window = self.expert_window.report()
        last = self.last_expert_counts
        if last is not None:
            s.last_step_expert_load = ExpertLoad([np.flatnonzero(row).tolist() for row in last],
                                                 int(np.count_nonzero(last)) * self.expert_bytes)
        s.num_preemptions = scheduler.num_preemptions
        s.num_running = scheduler.num_running
        s.num_waiting = scheduler.num_waiting
        s.kv_cache_usage = scheduler.block_manager.usage
        prefix = scheduler.block_manager.prefix
        if prefix is not None:
            s.prefix_caching, s.prefix_cache_queries, s.prefix_cache_hits = True, prefix.queries, prefix.hits
        s.energy_j = self.energy.joules()
        s.kernels = kernels
        s.kernel_builds_while_serving = WATCH.built_while_serving
        s.energy_unavailable = self.energy.reason
        if s.energy_j is not None and s.num_generated_tokens:
            s.energy_per_token_j = s.energy_j / s.num_generated_tokens
        return s
