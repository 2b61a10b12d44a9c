"""What the scheduler decides for one step (`SchedulerOutput`, with the layered cohort's part,
`LayeredPass`): read by the runners, the step layout, the token recorder, the simulator and the
step broadcast of a tensor-parallel node. Plain data, apart from the scheduler that fills it."""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

from megainfer.scheduling.sequence import COMPUTED, TOKEN_IDS, Sequence, SequenceStatus


@dataclass
class LayeredPass:
    """This step's part of a layered prefill: the cohort's chunks through one layer group."""

    seqs: list[Sequence]  # cohort members, one-token chunks first
    num_tokens: list[int]  # chunk tokens of each, from seq.num_computed_tokens on
    layers: tuple[int, int]  # [start, end) layers this step
    group: int  # which of the cohort's groups this is, from 0
    num_groups: int  # groups the cohort passes in all

    @property
    def last(self) -> bool:
        """The final group: the chunks are complete after this step (and may sample)."""
        return self.group == self.num_groups - 1


@dataclass
class SchedulerOutput:
    """What one step computes. Sequences with one query token come first (decodes, and
    one-token prefill chunks), then multi-token prefill chunks: attention kernels rely on
    that order."""

    seqs: list[Sequence] = field(default_factory=list)
    # Tokens computed this step for each entry of `seqs` (same order): the tokens from
    # seq.num_computed_tokens up to num_computed_tokens + n.
    num_scheduled_tokens: list[int] = field(default_factory=list)
    # Leading entries of `seqs` with exactly one scheduled token.
    num_single_token: int = 0
    # Sequences preempted (blocks freed, back to waiting) while forming this step.
    preempted: list[Sequence] = field(default_factory=list)
    # Layered prefill: the cohort passing one layer group this step (not in `seqs`).
    layered: LayeredPass | None = None

    @property
    def total_tokens(self) -> int:
        return sum(self.num_scheduled_tokens) + (sum(self.layered.num_tokens) if self.layered else 0)

    @property
    def is_empty(self) -> bool:
        return not self.seqs and self.layered is None

    @property
    def carries_prompt_tokens(self) -> bool:
        """A prefill step, to the expert-load windows: an entry of more than one token (a prompt
        chunk: the entries are ordered `single_tokens_first`), or a layered cohort."""
        return self.num_single_token < len(self.seqs) or self.layered is not None

    @property
    def all_seqs(self) -> list[Sequence]:
        """Every sequence this step touches: `seqs`, then the layered cohort."""
        return self.seqs + (self.layered.seqs if self.layered else [])

    def single_tokens_first(self) -> SchedulerOutput:
        """Puts the one-token entries first (stable) and counts them in `num_single_token`."""
        counts = self.num_scheduled_tokens
        single = counts.count(1)
        if counts[:single] != [1] * single:  # some prompt chunk before a one-token entry
            order = sorted(range(len(self.seqs)), key=lambda j: counts[j] > 1)
            self.seqs = [self.seqs[j] for j in order]
            self.num_scheduled_tokens = [counts[j] for j in order]
        self.num_single_token = single
        return self

    def samples(self) -> list[bool]:
        """Whether each sequence reaches its last token this step (and so samples a new one)."""
        seqs = self.seqs
        return list(map(operator.eq, map(operator.add, map(COMPUTED, seqs), self.num_scheduled_tokens),
                        map(len, map(TOKEN_IDS, seqs))))

    def all_samples(self) -> list[bool]:
        """`samples()` for `all_seqs`: a cohort's chunks that end their prompt sample a first
        token when its last group runs (and not before)."""
        samples = self.samples()
        cohort = self.layered
        if cohort is not None:
            samples += [cohort.last and s.num_computed_tokens + n == s.num_tokens
                        for s, n in zip(cohort.seqs, cohort.num_tokens)]
        return samples


def without_finished(out: SchedulerOutput) -> SchedulerOutput:
    """A step scheduled ahead without the sequences that finished since (their blocks are free):
    the others keep their order and tokens."""
    kept = [(seq, n) for seq, n in zip(out.seqs, out.num_scheduled_tokens) if seq.status is not SequenceStatus.FINISHED]
    counts = [n for _, n in kept]
    return SchedulerOutput([seq for seq, _ in kept], counts, counts.count(1), out.preempted, out.layered)
