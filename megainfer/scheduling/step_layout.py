"""Where every row of a step sits: computed once from a `SchedulerOutput`, read by the colocated
runner, the pipelined (attention node) runner, a tensor-parallel node's follower ranks and the
simulator, so none of them re-derives it. Plain Python, no torch.

A step computes tokens for two kinds of sequences:
- its own sequences (`SchedulerOutput.seqs`, called *decodes* here: decodes, and under chunked
  prefill also prompt chunks), which pass every layer;
- under layered prefill, a *cohort* of prompt chunks (`SchedulerOutput.layered`), which passes
  only this step's layer group: it joins the decodes at the group's first layer and leaves
  them at the group's end layer.

Both are split into `m` micro-batches, each balanced by tokens separately and each keeping the
step's order (one-token sequences first), as the attention kernels expect. The colocated
runner and the simulator are the m = 1 case.

Names used throughout:
- *sequence index*: a position in `SchedulerOutput.all_seqs` (the decodes, then the cohort),
  which is also the position of its token in `StepResult.sampled`;
- *row*: one token's hidden state. A micro-batch's rows are its decodes' rows, then, while the
  cohort is inside its group, its cohort members' rows (the *combined* batch).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from functools import cached_property
from itertools import accumulate, chain
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megainfer.scheduling.scheduler_output import SchedulerOutput


def split_micro_batches(num_tokens: list[int], m: int) -> list[list[int]]:
    """Indices into `num_tokens` for each of m micro-batches, balanced by tokens (each entry goes
    to the least loaded one so far, the first of equals); each keeps the input's order. Some
    may be empty."""
    if m == 1:
        return [list(range(len(num_tokens)))]
    # The leading one-token entries (a step's decodes come first) go round-robin, which is what
    # the rule gives them (the loads stay equal, or the first ones one ahead), built in C.
    ones = _leading_ones(num_tokens)
    groups = [list(range(j, ones, m)) for j in range(m)]
    load = [len(g) for g in groups]
    for i in range(ones, len(num_tokens)):
        j = load.index(min(load))
        groups[j].append(i)
        load[j] += num_tokens[i]
    return groups


def _leading_ones(num_tokens: list[int]) -> int:
    """How many entries at the start are 1 (all the ones, counted in C, when they lead)."""
    ones = num_tokens.count(1)
    return ones if num_tokens[:ones] == [1] * ones else 0


def _query_starts(num_tokens: tuple[int, ...], indices: list[int], start: int = 0, ones: int = 0) -> list[int]:
    """Offsets (rows) at which each of `indices` begins, from `start`, plus the end. Indices
    below `ones` are known to compute one token each (the step's leading decodes)."""
    if not indices or indices[-1] < ones:  # every one a one-token decode: consecutive rows
        return list(range(start, start + len(indices) + 1))
    return list(accumulate((num_tokens[i] for i in indices), initial=start))


@dataclass(frozen=True)
class MicroBatchLayout:
    """One micro-batch of a step: its sequences and where their rows sit."""

    # Sequence indices of the decodes in this micro-batch (all below the step's number of
    # decodes), in the step's order.
    decode_sequences: tuple[int, ...]
    # Sequence indices of the cohort members in this micro-batch (all at or past the step's
    # number of decodes), in the cohort's order; empty without a cohort.
    cohort_sequences: tuple[int, ...]
    # Query start offsets (rows from 0) of the decode-only batch: one per decode, then the end;
    # entry k + 1 minus entry k is the k-th decode's tokens this step.
    decode_query_starts: tuple[int, ...]
    # Query start offsets (rows from 0) of the combined batch (the decodes, then the cohort
    # members) that runs inside the cohort's group; equals `decode_query_starts` without a cohort.
    combined_query_starts: tuple[int, ...]

    @property
    def sequences(self) -> tuple[int, ...]:
        """Sequence indices of the combined batch: decodes, then cohort members."""
        return self.decode_sequences + self.cohort_sequences

    @property
    def num_decode_rows(self) -> int:
        """Rows (tokens) of the decode-only batch."""
        return self.decode_query_starts[-1]

    @property
    def num_cohort_rows(self) -> int:
        """Rows (tokens) the cohort members add inside their group."""
        return self.combined_query_starts[-1] - self.num_decode_rows

    @property
    def cohort_row_ranges(self) -> list[tuple[int, int]]:
        """Each cohort member's [start, end) rows within the cohort's own rows (the combined
        batch's rows past the decodes), in `cohort_sequences` order."""
        offsets = self.combined_query_starts[len(self.decode_sequences):]
        base = self.num_decode_rows
        return [(begin - base, end - base) for begin, end in zip(offsets, offsets[1:])]


@dataclass(slots=True)  # not frozen: a step makes one per sampling sequence, and frozen ones cost 4x
class SampledRow:
    """A row whose hidden state, after the last layer, gives a sequence its next token. Read-only
    by convention."""

    # Sequence index of the sequence that samples (its entry in `StepResult.sampled`).
    sequence: int
    # Micro-batch whose rows hold it.
    micro_batch: int
    # True: the row is among the micro-batch's cohort rows (counted from the first cohort row,
    # after the cohort left the decodes); False: among its decode rows.
    in_cohort: bool
    # Index of the row (the sequence's last token this step) within those rows.
    row: int


@dataclass(frozen=True)
class StepLayout:
    """A step's micro-batches, the cohort's passage through its layer group, and the rows that
    sample. Build it with `StepLayout.of(scheduler_output, m)`. The micro-batches and the
    sampled rows are worked out when first read: the simulator prices millions of steps and
    reads neither."""

    # Micro-batches the step is split into (m).
    num_micro_batches: int
    # Tokens each sequence computes this step, by sequence index.
    num_tokens: tuple[int, ...]
    # How many of the step's sequences are decodes (`len(SchedulerOutput.seqs)`); the sequence
    # indices from here on are the cohort's.
    num_decode_sequences: int
    # First layer of the cohort's group this step: before this layer's attention its rows join
    # the decodes. 0 when the step has no cohort.
    cohort_join_layer: int
    # End layer (exclusive) of the cohort's group: before this layer's attention (or after the
    # last layer, when it equals the model's layer count) its rows leave the decodes.
    # 0 when the step has no cohort.
    cohort_leave_layer: int
    # The group is the cohort's last: its members' hidden states are not kept for a next group,
    # and those whose chunk completes their prompt sample their first token.
    cohort_last_group: bool
    # Whether each sequence (by sequence index) samples a token this step.
    samples: tuple[bool, ...]

    @classmethod
    def of(cls, out: SchedulerOutput, m: int) -> "StepLayout":
        """The layout of `out` split into `m` micro-batches. A sequence samples where
        `out.all_samples()` says so: decodes that reach their last token, and cohort chunks that
        complete their prompt in the cohort's last group."""
        if m < 1:
            raise ValueError(f"a step needs at least one micro-batch, got {m}")
        cohort = out.layered
        num_tokens = tuple(out.num_scheduled_tokens) + (tuple(cohort.num_tokens) if cohort is not None else ())
        join, leave = cohort.layers if cohort is not None else (0, 0)
        last = cohort is not None and cohort.last
        return cls(m, num_tokens, len(out.seqs), join, leave, last, tuple(out.all_samples()))

    @cached_property
    def micro_batches(self) -> tuple[MicroBatchLayout, ...]:
        """The m micro-batches, in the order they run; any may be empty (the node still
        exchanges a zero-token message for it with every expert node)."""
        num_decodes, m = self.num_decode_sequences, self.num_micro_batches
        decode_tokens = list(self.num_tokens[:num_decodes])
        ones = _leading_ones(decode_tokens)
        batches = []
        for decodes, members in zip(split_micro_batches(decode_tokens, m),
                                    split_micro_batches(list(self.num_tokens[num_decodes:]), m)):
            members = [num_decodes + i for i in members]
            decode_starts = _query_starts(self.num_tokens, decodes, 0, ones)
            combined_starts = decode_starts + _query_starts(self.num_tokens, members, decode_starts[-1])[1:]
            batches.append(MicroBatchLayout(tuple(decodes), tuple(members), tuple(decode_starts),
                                            tuple(combined_starts)))
        return tuple(batches)

    @cached_property
    def sampled_rows(self) -> tuple[SampledRow, ...]:
        """The rows that sample: decode rows micro-batch by micro-batch (each in the step's
        order), then cohort rows micro-batch by micro-batch. This is the order of the sampler's
        rows."""
        return _sampled_rows(self.micro_batches, self.samples)

    @cached_property
    def every_row_samples(self) -> bool:
        """A plain decode step: no cohort, one token per sequence, each sampling, so each
        micro-batch's rows are its decodes' in order and all of them sample."""
        return not self.has_cohort and all(self.samples) and self.num_tokens.count(1) == len(self.num_tokens)

    @cached_property
    def sampled_sequences(self) -> list[int]:
        """The sequence index of each sampled row, in `sampled_rows` order (in a plain decode
        step, without making the rows)."""
        if self.every_row_samples:
            return list(chain.from_iterable(batch.decode_sequences for batch in self.micro_batches))
        return [row.sequence for row in self.sampled_rows]

    @property
    def num_sampled(self) -> int:
        return sum(self.samples)

    @property
    def num_sequences(self) -> int:
        """Sequences in the step, decodes and cohort members."""
        return len(self.num_tokens)

    @property
    def has_cohort(self) -> bool:
        return self.num_sequences > self.num_decode_sequences

    @property
    def cohort_group_layers(self) -> int:
        """Layers the cohort passes this step (0 without a cohort)."""
        return self.cohort_leave_layer - self.cohort_join_layer

    def cohort_inside(self, layer: int) -> bool:
        """Whether `layer` is in the cohort's group: micro-batches with cohort members run their
        combined batch there, and their decode-only batch everywhere else."""
        return self.cohort_join_layer <= layer < self.cohort_leave_layer

    def place_samples(self, tokens: list[int]) -> list[int | None]:
        """One entry per sequence index: the token sampled from its row (`tokens` in
        `sampled_rows` order), None for a sequence that did not sample."""
        sequences = self.sampled_sequences
        if len(tokens) != len(sequences):
            raise ValueError(f"{len(tokens)} tokens for {len(sequences)} sampled rows")
        placed: list[int | None] = [None] * self.num_sequences
        deque(map(placed.__setitem__, sequences, tokens), maxlen=0)  # placed[sequence] = token, in C
        return placed


def _sampled_rows(batches: tuple[MicroBatchLayout, ...], samples: tuple[bool, ...]) -> tuple[SampledRow, ...]:
    """Each sampling sequence's last row: all decodes first, then all cohort members."""
    rows = []
    for j, batch in enumerate(batches):
        ends = batch.decode_query_starts[1:]
        rows += [SampledRow(i, j, False, end - 1) for i, end in zip(batch.decode_sequences, ends) if samples[i]]
    for j, batch in enumerate(batches):
        ranges = batch.cohort_row_ranges
        rows += [SampledRow(i, j, True, end - 1) for i, (_, end) in zip(batch.cohort_sequences, ranges) if samples[i]]
    return tuple(rows)


class LayoutAhead:
    """A runner's layout of the step scheduled ahead (asynchronous scheduling), worked out while
    the step before runs, so the next step's first inputs do not wait for it."""

    def __init__(self) -> None:
        self._kept: tuple[SchedulerOutput, StepLayout] | None = None

    def keep(self, out: SchedulerOutput | None, m: int) -> None:
        if out is None or out.is_empty:
            self._kept = None
            return
        layout = StepLayout.of(out, m)
        for worked_out in ("micro_batches", "sampled_sequences"):  # cached properties: worked out now
            getattr(layout, worked_out)
        self._kept = (out, layout)

    def peek(self) -> tuple[SchedulerOutput, StepLayout] | None:
        """The step kept and its layout, left kept (None: none)."""
        return self._kept

    def of(self, out: SchedulerOutput, m: int) -> StepLayout:
        """`out`'s layout: the one kept if `out` is the step kept (not one filtered since)."""
        kept, self._kept = self._kept, None
        return kept[1] if kept is not None and kept[0] is out else StepLayout.of(out, m)

