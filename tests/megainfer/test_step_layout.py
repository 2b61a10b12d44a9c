"""StepLayout: the micro-batch split, the cohort's join and leave layers, row offsets and the rows
that sample, on hand-built steps."""

from __future__ import annotations

import pytest

from megainfer.sampling_params import SamplingParams
from megainfer.scheduling.scheduler_output import LayeredPass, SchedulerOutput
from megainfer.scheduling.sequence import Sequence
from megainfer.scheduling.step_layout import MicroBatchLayout, SampledRow, StepLayout, split_micro_batches

PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def decoding(name: str, length: int = 4) -> Sequence:
    """A sequence with one token left to compute: it samples this step."""
    return Sequence(name, [1] * length, PARAMS, num_computed_tokens=length - 1)


def prompt(name: str, length: int, computed: int = 0) -> Sequence:
    return Sequence(name, [2] * length, PARAMS, num_computed_tokens=computed)


def cohort_step(group: int, num_groups: int = 3, layers: tuple[int, int] = (2, 4)) -> SchedulerOutput:
    """Three decodes, and a cohort of a one-token chunk that ends its prompt, a 12-token chunk
    that ends its prompt and a 5-token chunk of a longer prompt (indices 3, 4, 5)."""
    decodes = [decoding("d0"), decoding("d1"), decoding("d2")]
    members = [prompt("one", 9, computed=8), prompt("whole", 12), prompt("part", 20)]
    return SchedulerOutput(seqs=decodes, num_scheduled_tokens=[1, 1, 1], num_single_token=3,
                           layered=LayeredPass(members, [1, 12, 5], layers, group, num_groups))


def test_split_balances_tokens_keeps_order_and_leaves_spare_micro_batches_empty():
    assert split_micro_batches([1, 1, 1, 30, 10], 2) == [[0, 2, 4], [1, 3]]
    assert split_micro_batches([5], 3) == [[0], [], []]
    assert split_micro_batches([], 2) == [[], []]


@pytest.mark.parametrize("m", [1, 2, 3])
def test_every_sequence_lands_in_exactly_one_micro_batch(m):
    layout = StepLayout.of(cohort_step(group=2), m)
    assert len(layout.micro_batches) == m
    placed = sorted(i for batch in layout.micro_batches for i in batch.sequences)
    assert placed == list(range(6))
    assert all(i < 3 for batch in layout.micro_batches for i in batch.decode_sequences)
    assert all(i >= 3 for batch in layout.micro_batches for i in batch.cohort_sequences)
    assert sum(batch.num_decode_rows + batch.num_cohort_rows for batch in layout.micro_batches) == 3 + 18


def test_one_micro_batch_without_a_cohort_is_the_plain_step():
    out = SchedulerOutput(seqs=[decoding("a"), decoding("b"), prompt("c", 10, computed=2), prompt("d", 6)],
                          num_scheduled_tokens=[1, 1, 5, 6], num_single_token=2)
    layout = StepLayout.of(out, 1)
    (batch,) = layout.micro_batches
    assert batch == MicroBatchLayout((0, 1, 2, 3), (), (0, 1, 2, 7, 13), (0, 1, 2, 7, 13))
    assert batch.cohort_row_ranges == []
    assert not layout.has_cohort and layout.cohort_group_layers == 0
    assert (layout.cohort_join_layer, layout.cohort_leave_layer, layout.cohort_last_group) == (0, 0, False)
    assert not any(layout.cohort_inside(layer) for layer in range(4))
    assert layout.num_tokens == (1, 1, 5, 6) and layout.num_decode_sequences == 4
    # c is mid-prompt (2 + 5 < 10); d's chunk ends its prompt.
    assert layout.sampled_rows == (SampledRow(0, 0, False, 0), SampledRow(1, 0, False, 1),
                                   SampledRow(3, 0, False, 12))
    assert layout.place_samples([7, 8, 9]) == [7, 8, None, 9]


def test_micro_batches_offset_their_rows_from_zero():
    out = SchedulerOutput(seqs=[decoding("a"), decoding("b"), decoding("c"), prompt("d", 30), prompt("e", 10)],
                          num_scheduled_tokens=[1, 1, 1, 30, 10], num_single_token=3)
    layout = StepLayout.of(out, 2)
    first, second = layout.micro_batches
    assert (first.decode_sequences, first.decode_query_starts) == ((0, 2, 4), (0, 1, 2, 12))
    assert (second.decode_sequences, second.decode_query_starts) == ((1, 3), (0, 1, 31))
    assert first.combined_query_starts == first.decode_query_starts
    # Decodes micro-batch by micro-batch, each row its sequence's last token.
    assert layout.sampled_rows == (SampledRow(0, 0, False, 0), SampledRow(2, 0, False, 1),
                                   SampledRow(4, 0, False, 11), SampledRow(1, 1, False, 0),
                                   SampledRow(3, 1, False, 30))
    assert layout.place_samples([10, 12, 14, 11, 13]) == [10, 11, 12, 13, 14]


def test_cohort_joins_at_its_group_and_keeps_its_rows_apart():
    layout = StepLayout.of(cohort_step(group=1), 2)
    assert (layout.cohort_join_layer, layout.cohort_leave_layer) == (2, 4)
    assert layout.has_cohort and layout.cohort_group_layers == 2 and not layout.cohort_last_group
    assert [layout.cohort_inside(layer) for layer in range(6)] == [False, False, True, True, False, False]
    first, second = layout.micro_batches
    # Decodes [1, 1, 1] and the cohort's chunks [1, 12, 5] are balanced separately.
    assert (first.decode_sequences, first.cohort_sequences) == ((0, 2), (3, 5))
    assert (second.decode_sequences, second.cohort_sequences) == ((1,), (4,))
    assert first.decode_query_starts == (0, 1, 2) and first.combined_query_starts == (0, 1, 2, 3, 8)
    assert second.decode_query_starts == (0, 1) and second.combined_query_starts == (0, 1, 13)
    assert first.sequences == (0, 2, 3, 5)
    assert (first.num_decode_rows, first.num_cohort_rows) == (2, 6)
    assert first.cohort_row_ranges == [(0, 1), (1, 6)] and second.cohort_row_ranges == [(0, 12)]
    # Not the last group: only the decodes sample.
    assert [r.sequence for r in layout.sampled_rows] == [0, 2, 1]
    assert not any(r.in_cohort for r in layout.sampled_rows)


@pytest.mark.parametrize("m", [1, 2, 3])
def test_in_the_last_group_chunks_that_end_their_prompt_sample_after_the_decodes(m):
    out = cohort_step(group=2, layers=(4, 6))
    layout = StepLayout.of(out, m)
    assert layout.cohort_last_group and layout.cohort_leave_layer == 6
    flags = out.all_samples()
    assert sorted(r.sequence for r in layout.sampled_rows) == [i for i, f in enumerate(flags) if f] == [0, 1, 2, 3, 4]
    decode_rows = [r for r in layout.sampled_rows if not r.in_cohort]
    cohort_rows = [r for r in layout.sampled_rows if r.in_cohort]
    assert layout.sampled_rows == tuple(decode_rows + cohort_rows)
    assert [r.micro_batch for r in decode_rows] == sorted(r.micro_batch for r in decode_rows)
    assert [r.micro_batch for r in cohort_rows] == sorted(r.micro_batch for r in cohort_rows)
    for r in layout.sampled_rows:  # each row is its sequence's last token in its block
        batch = layout.micro_batches[r.micro_batch]
        if r.in_cohort:
            begin, end = batch.cohort_row_ranges[batch.cohort_sequences.index(r.sequence)]
        else:
            end = batch.decode_query_starts[batch.decode_sequences.index(r.sequence) + 1]
        assert r.row == end - 1
    placed = layout.place_samples(list(range(len(layout.sampled_rows))))
    assert [t is not None for t in placed] == flags


def test_one_micro_batch_lays_the_cohort_after_every_decode():
    layout = StepLayout.of(cohort_step(group=2), 1)
    (batch,) = layout.micro_batches
    assert batch.combined_query_starts == (0, 1, 2, 3, 4, 16, 21)
    assert batch.cohort_row_ranges == [(0, 1), (1, 13), (13, 18)]
    assert [(r.sequence, r.in_cohort, r.row) for r in layout.sampled_rows] == \
        [(0, False, 0), (1, False, 1), (2, False, 2), (3, True, 0), (4, True, 12)]


def test_a_cohort_without_decodes_and_spare_micro_batches():
    out = SchedulerOutput(layered=LayeredPass([prompt("p", 6)], [6], (0, 2), 0, 1))
    layout = StepLayout.of(out, 3)
    first, *spare = layout.micro_batches
    assert first == MicroBatchLayout((), (0,), (0,), (0, 6))
    assert (first.num_decode_rows, first.cohort_row_ranges) == (0, [(0, 6)])
    assert all(b == MicroBatchLayout((), (), (0,), (0,)) for b in spare)
    assert layout.sampled_rows == (SampledRow(0, 0, True, 5),)  # one group: it is the last


@pytest.mark.parametrize("m", [1, 2, 3])
def test_an_empty_step_has_empty_micro_batches(m):
    layout = StepLayout.of(SchedulerOutput(), m)
    assert layout.micro_batches == tuple(MicroBatchLayout((), (), (0,), (0,)) for _ in range(m))
    assert layout.num_sequences == 0 and layout.sampled_rows == () and layout.place_samples([]) == []


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="at least one micro-batch"):
        StepLayout.of(SchedulerOutput(), 0)
    layout = StepLayout.of(SchedulerOutput(seqs=[decoding("a")], num_scheduled_tokens=[1], num_single_token=1), 1)
    with pytest.raises(ValueError, match="2 tokens for 1 sampled rows"):
        layout.place_samples([1, 2])


@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize("group", [0, 1, 2])
def test_sampled_sequences_follow_the_sampled_rows_and_a_plain_decode_step_needs_none(m, group):
    plain = SchedulerOutput(seqs=[decoding(f"d{i}") for i in range(7)], num_scheduled_tokens=[1] * 7,
                            num_single_token=7)
    mixed = SchedulerOutput(seqs=[decoding("a"), decoding("b"), prompt("c", 10, computed=2)],
                            num_scheduled_tokens=[1, 1, 5], num_single_token=2)
    for out, every in ((plain, True), (mixed, False), (cohort_step(group=group), False)):
        layout = StepLayout.of(out, m)
        assert layout.every_row_samples is every
        assert layout.sampled_sequences == [r.sequence for r in layout.sampled_rows]
        tokens = list(range(100, 100 + len(layout.sampled_sequences)))
        placed = layout.place_samples(tokens)
        assert [placed[r.sequence] for r in layout.sampled_rows] == tokens
        assert sum(t is not None for t in placed) == len(tokens)
