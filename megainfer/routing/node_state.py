"""What an attention node (or a colocated engine) tells the router about itself.

A snapshot of its scheduler (every unfinished request's lengths so far, the KV cache, the
scheduling knobs), the steps it ran since the last snapshot with their measured seconds, and
the requests that finished since then. Plain tuples and numbers, so a snapshot crosses Ray
cheaply; the predictive router rebuilds a scheduler from it to forecast the node.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megainfer.scheduler import LayeredPrefill, Scheduler, SchedulerOutput, chunk_work
from megainfer.sequence import Sequence


@dataclass(frozen=True)
class StepSample:
    """One step's work (what the step-time model reads) and, once run, its seconds."""

    tokens: int  # tokens computed, every sequence together
    seqs: int  # sequences in the step
    kv_tokens: float  # cached tokens attention reads, summed over sequences
    score_pairs: float  # query-key pairs attention scores (causal inside a chunk)
    seconds: float = 0.0
    # The replica-wide number of the step on a disaggregated node, whose attention nodes all run
    # every numbered step together; -1 on a colocated engine.
    step: int = -1
    # Nodes in lockstep: the largest of any one node's (tokens, kv_tokens, score_pairs), since
    # the attention nodes compute side by side; None for one node's step (its own work).
    peak: tuple[float, float, float] | None = None

    @classmethod
    def of(cls, out: SchedulerOutput, seconds: float = 0.0, num_layers: int = 1, step: int = -1) -> "StepSample":
        """The step's work averaged over layers: a layered-prefill cohort passes only its group."""
        tokens, pairs, kv = chunk_work(out.seqs, out.num_scheduled_tokens)
        seqs = len(out.seqs)
        lp = out.layered
        if lp is not None:
            share = (lp.layers[1] - lp.layers[0]) / max(num_layers, 1)
            c_tokens, c_pairs, c_kv = chunk_work(lp.seqs, lp.num_tokens)
            tokens, pairs, kv = tokens + share * c_tokens, pairs + share * c_pairs, kv + share * c_kv
            seqs += len(lp.seqs)
        return cls(round(tokens), seqs, kv, pairs, seconds, step)

    @classmethod
    def lockstep(cls, samples: list["StepSample"]) -> "StepSample":
        """One step of nodes in lockstep: their work adds up (the expert nodes compute it all),
        the busiest node's share bounds the attention half, and the step lasts as long as the
        slowest node saw it last."""
        return cls(sum(s.tokens for s in samples), sum(s.seqs for s in samples),
                   sum(s.kv_tokens for s in samples), sum(s.score_pairs for s in samples),
                   max(s.seconds for s in samples), samples[0].step,
                   (float(max(s.tokens for s in samples)), max(s.kv_tokens for s in samples),
                    max(s.score_pairs for s in samples)))

    def work(self) -> tuple[float, float, float, float]:
        """(tokens, seqs, kv_tokens, score_pairs): one node's row in a lockstep forecast."""
        return (float(self.tokens), float(self.seqs), self.kv_tokens, self.score_pairs)


@dataclass(frozen=True)
class SchedulingKnobs:
    """The scheduler settings a forecast must reproduce."""

    num_blocks: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    prefill_policy: str = "chunked"
    num_layers: int = 1
    group_tokens: int = 512
    num_layer_groups: int | None = None
    layered_chunk_tokens: int = 512

    @classmethod
    def of(cls, scheduler: Scheduler) -> "SchedulingKnobs":
        bm, policy = scheduler.block_manager, scheduler.policy
        layered = isinstance(policy, LayeredPrefill)
        return cls(bm.num_blocks, bm.block_size, scheduler.max_num_seqs, scheduler.max_num_batched_tokens,
                   scheduler.max_model_len, policy.name,
                   num_layers=policy.num_layers if layered else 1,
                   group_tokens=policy.group_tokens if layered else 512,
                   num_layer_groups=policy.num_layer_groups if layered else None,
                   layered_chunk_tokens=policy.chunk_tokens if layered else 512)


# A request as (prompt tokens, tokens so far (prompt + generated), tokens cached, max_tokens).
RequestLengths = tuple[int, int, int, int]


@dataclass
class NodeState:
    knobs: SchedulingKnobs
    running: list[RequestLengths] = field(default_factory=list)  # in the scheduler's order
    waiting: list[RequestLengths] = field(default_factory=list)  # queue order
    free_blocks: int = 0
    steps: list[StepSample] = field(default_factory=list)  # measured since the last snapshot
    finished: list[tuple[int, int]] = field(default_factory=list)  # (prompt, output tokens) since the last one
    time: float = 0.0  # the node's clock when taken (seconds; the router's clock must agree)
    steps_done: int = -1  # lockstep nodes: every step numbered below this one has run (-1: colocated)

    @classmethod
    def of(cls, scheduler: Scheduler, now: float, steps: list[StepSample] = (),
           finished: list[tuple[int, int]] = (), steps_done: int = -1) -> "NodeState":
        def lengths(s: Sequence) -> RequestLengths:
            return (s.num_prompt_tokens, s.num_tokens, s.num_computed_tokens, s.params.max_tokens)

        return cls(SchedulingKnobs.of(scheduler), [lengths(s) for s in scheduler.running],
                   [lengths(s) for s in scheduler.waiting], scheduler.block_manager.num_free_blocks,
                   list(steps), list(finished), now, steps_done)

    def load(self) -> dict:
        """The heuristic routers' view (NodeLoad's fields)."""
        k = self.knobs
        pending = sum(n - c for _, n, c, _ in self.waiting) + sum(n - c for _, n, c, _ in self.running if n - c > 1)
        return {"capacity_tokens": k.num_blocks * k.block_size, "used_tokens": sum(c for _, _, c, _ in self.running),
                "pending_prefill_tokens": pending, "running": len(self.running), "waiting": len(self.waiting)}
