"""What the routers see of an engine, read from its scheduler: a step's work (`StepSample`), the
scheduling settings a forecast reproduces (`SchedulingKnobs`) and a node's snapshot
(`NodeState`). The types are plain data in messages.py, which imports no engine object; these
constructors read the engine's objects, so they live with them."""

from __future__ import annotations

from megainfer.messages import NodeState, RequestLengths, SchedulingKnobs, StepSample
from megainfer.scheduling.scheduler import Scheduler, chunk_work
from megainfer.scheduling.scheduler_output import SchedulerOutput
from megainfer.scheduling.sequence import Sequence


def step_sample(out: SchedulerOutput, seconds: float = 0.0, num_layers: int = 1, step: int = -1) -> StepSample:
    """The step's work averaged over layers: a layered-prefill cohort passes only its group."""
    tokens, pairs, kv = chunk_work(out.seqs, out.num_scheduled_tokens)
    seqs = len(out.seqs)
    lp = out.layered
    if lp is not None:
        share = (lp.layers[1] - lp.layers[0]) / max(num_layers, 1)
        c_tokens, c_pairs, c_kv = chunk_work(lp.seqs, lp.num_tokens)
        tokens, pairs, kv = tokens + share * c_tokens, pairs + share * c_pairs, kv + share * c_kv
        seqs += len(lp.seqs)
    return StepSample(round(tokens), seqs, kv, pairs, seconds, step)


def scheduling_knobs(scheduler: Scheduler) -> SchedulingKnobs:
    bm, policy = scheduler.block_manager, scheduler.policy
    return SchedulingKnobs(bm.num_blocks, bm.block_size, scheduler.max_num_seqs, scheduler.max_num_batched_tokens,
                           scheduler.max_model_len, policy.name, policy.layered_settings())


def snapshot(scheduler: Scheduler, now: float, steps: list[StepSample] = (), finished: list[tuple[int, int]] = (),
               steps_done: int = -1) -> NodeState:
    """The node's snapshot at `now`: its queues' lengths, free blocks, and the steps measured and
    requests finished since the last one."""
    prefix = scheduler.block_manager.prefix
    return NodeState(scheduling_knobs(scheduler), [_lengths(s) for s in scheduler.running],
                     [_lengths(s) for s in scheduler.waiting], scheduler.block_manager.num_free_blocks,
                     list(steps), list(finished), now, steps_done,
                     prefix.take_summary() if prefix is not None else None)


def _lengths(s: Sequence) -> RequestLengths:
    return RequestLengths(s.num_prompt_tokens, s.num_tokens, s.num_computed_tokens, s.params.max_tokens)
