"""prepare_batch's array build against the per-sequence build it replaced: the same ids,
positions and attention metadata, dtypes included, for decodes, prompt chunks and mixes."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels import PagedAttentionBatch
from megainfer.runner.model_runner import prepare_batch

BLOCK = 16


def reference_prepare_batch(seqs, num_tokens: list[int], num_single: int, block_size: int,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor, PagedAttentionBatch]:
    """The per-sequence build prepare_batch replaced (its arrays must equal these)."""
    token_ids: list[int] = []
    starts = [0]
    seq_lens = []
    for seq, n in zip(seqs, num_tokens):
        begin = seq.num_computed_tokens
        token_ids.extend(seq.token_ids[begin:begin + n])
        starts.append(starts[-1] + n)
        seq_lens.append(begin + n)
    width = max(len(s.block_table) for s in seqs)
    tables = [s.block_table + [0] * (width - len(s.block_table)) for s in seqs]
    query_lens = torch.tensor(num_tokens)
    seq_lens_t = torch.tensor(seq_lens)
    # Position of each query token: its sequence's cached length minus the tokens after it.
    seq_of_token = torch.repeat_interleave(torch.arange(len(seqs)), query_lens)
    positions = torch.arange(len(token_ids)) - torch.tensor(starts[:-1])[seq_of_token] \
        + (seq_lens_t - query_lens)[seq_of_token]
    block_tables = torch.tensor(tables, dtype=torch.int64)
    slots = block_tables[seq_of_token, positions // block_size] * block_size + positions % block_size
    batch = PagedAttentionBatch(
        # int32, as the kernel warm-up's batches (kernels/startup.py): Triton builds one variant
        # per pointer type, and a second one here would be built mid-serving.
        block_tables=block_tables.to(device=device, dtype=torch.int32),
        seq_lens=seq_lens_t.to(torch.int32).to(device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        slot_mapping=slots.to(device),
        num_single=num_single,
        seq_lens_host=seq_lens,
        query_start_host=starts,
    )
    return torch.tensor(token_ids, device=device), positions.to(device), batch


@st.composite
def step_batches(draw):
    """Sequences with their computed counts, block tables and this step's token counts; the
    first `single` compute one token each (decodes), as the scheduler orders them."""
    n = draw(st.integers(1, 10))
    single = draw(st.integers(0, n))
    seqs, counts = [], []
    for i in range(n):
        total = draw(st.integers(2, 80))
        computed = draw(st.integers(0, total - 1))
        count = 1 if i < single else draw(st.integers(1, total - computed))
        blocks = (computed + count + BLOCK - 1) // BLOCK + draw(st.integers(0, 2))
        table = draw(st.lists(st.integers(0, 999), min_size=blocks, max_size=blocks, unique=True))
        ids = draw(st.lists(st.integers(0, 999), min_size=total, max_size=total))
        seqs.append(SimpleNamespace(token_ids=ids, num_computed_tokens=computed, block_table=table))
        counts.append(count)
    return seqs, counts, single


@settings(max_examples=60, deadline=None)
@given(step_batches())
def test_prepare_batch_equals_the_per_sequence_build(batch):
    seqs, counts, single = batch
    got = prepare_batch(seqs, counts, single, BLOCK, torch.device("cpu"))
    want = reference_prepare_batch(seqs, counts, single, BLOCK, torch.device("cpu"))
    for g, w in zip(got[:2], want[:2]):
        assert g.dtype == w.dtype and torch.equal(g, w)
    for name in ("block_tables", "seq_lens", "query_start_loc", "slot_mapping"):
        g, w = getattr(got[2], name), getattr(want[2], name)
        assert g.dtype == w.dtype and torch.equal(g, w), name
    for name in ("num_single", "seq_lens_host", "query_start_host"):
        assert getattr(got[2], name) == getattr(want[2], name), name


# A step sequence for the persistent block tables: per step, each of a few requests either runs
# (its table grows by 0-2 blocks), is freed and starts again (a new, shorter list: preemption),
# sits the step out, or ends (a new request takes its id's place later).
step_actions = st.lists(st.lists(st.sampled_from(["grow", "grow", "same", "free", "skip", "end"]),
                                 min_size=5, max_size=5), min_size=1, max_size=12)


@settings(max_examples=150, deadline=None)
@given(step_actions, st.integers(1, 6))
def test_persistent_block_table_rows_equal_the_tables_built_afresh(steps, rows):
    """BlockTableRows mirrors the block manager's lists across steps (grown in place, replaced,
    requests leaving and new ones taking rows, more requests than rows) and gives the same
    zero-padded tables prepare_batch builds from scratch."""
    from megainfer.scheduling.block_table_rows import BlockTableRows

    tables = BlockTableRows(rows, 2)
    next_block = iter(range(1, 10_000))
    seqs = {f"r{i}": SimpleNamespace(request_id=f"r{i}", block_table=[next(next_block)]) for i in range(5)}
    fresh = 5
    for actions in steps:
        running = []
        for (rid, seq), action in zip(list(seqs.items()), actions):
            if action == "grow":
                seq.block_table.extend(next(next_block) for _ in range(2))
            elif action == "free":
                seq.block_table = [next(next_block)]
            elif action == "end":
                del seqs[rid]
                rid = f"r{fresh}"
                fresh += 1
                seqs[rid] = seq = SimpleNamespace(request_id=rid, block_table=[next(next_block)])
            if action != "skip":
                running.append(seq)
        if not running:
            continue
        tables.retain(running)
        got, widths = tables.gather(running)
        width = max(len(s.block_table) for s in running)
        assert got.tolist() == [s.block_table + [0] * (width - len(s.block_table)) for s in running]
        assert widths.tolist() == [len(s.block_table) for s in running]
        # Through prepare_batch: the same batch as without the rows.
        for s in running:
            s.num_computed_tokens, s.token_ids = len(s.block_table) * BLOCK - 1, [7] * len(s.block_table) * BLOCK
        with_rows = prepare_batch(running, [1] * len(running), len(running), BLOCK, torch.device("cpu"), tables)
        afresh = prepare_batch(running, [1] * len(running), len(running), BLOCK, torch.device("cpu"))
        assert torch.equal(with_rows[2].block_tables, afresh[2].block_tables)
        assert torch.equal(with_rows[2].slot_mapping, afresh[2].slot_mapping)
