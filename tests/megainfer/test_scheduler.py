"""The scheduler on its own: plain Python, no model (as the simulator will drive it)."""

from __future__ import annotations

import zlib

from hypothesis import given, settings
from hypothesis import strategies as st

from megainfer.sampling_params import SamplingParams
from megainfer.scheduling.kv_cache import BlockManager
from megainfer.scheduling.scheduler import ChunkedPrefill, Scheduler
from megainfer.scheduling.sequence import FinishReason, Sequence, SequenceStatus


def make_scheduler(num_blocks=64, block_size=4, max_num_seqs=8, budget=16, max_model_len=1024, eos=(99,)):
    return Scheduler(BlockManager(num_blocks, block_size), ChunkedPrefill(), max_num_seqs=max_num_seqs,
                     max_num_batched_tokens=budget, max_model_len=max_model_len, eos_token_ids=eos)


def seq(rid, n, max_tokens=8, **kw):
    return Sequence(rid, list(range(1, n + 1)), SamplingParams(max_tokens=max_tokens, temperature=0, **kw))


def run_step(s: Scheduler, token=7):
    out = s.schedule()
    sampled = [token if flag else None for flag in out.samples()]
    s.update_from_output(out, sampled)
    return out


def test_chunked_prefill_respects_budget_and_finishes_prompt():
    s = make_scheduler(budget=16)
    a = seq("a", 40)
    s.add(a)
    chunks = []
    while a.num_output_tokens == 0:
        out = run_step(s)
        assert out.total_tokens <= 16
        chunks.append(out.num_scheduled_tokens[0])
    assert chunks == [16, 16, 8]
    assert a.num_computed_tokens == 40 and a.num_tokens == 41


def test_decodes_go_first_and_prefill_takes_the_rest():
    s = make_scheduler(budget=10)
    for rid in ("a", "b"):
        s.add(seq(rid, 3))
    run_step(s)  # both prompts fit: 6 tokens
    s.add(seq("c", 30))
    out = s.schedule()
    assert [x.request_id for x in out.seqs] == ["a", "b", "c"]
    assert out.num_scheduled_tokens == [1, 1, 8]
    assert out.num_single_token == 2


def test_single_token_sequences_lead_the_batch():
    s = make_scheduler(budget=64)
    s.add(seq("long", 10))
    s.add(seq("one", 1))
    out = s.schedule()
    assert [x.request_id for x in out.seqs] == ["one", "long"]
    assert out.num_single_token == 1


def test_max_num_seqs_caps_running():
    s = make_scheduler(max_num_seqs=2, budget=100)
    for i in range(5):
        s.add(seq(str(i), 2))
    out = s.schedule()
    assert len(out.seqs) == 2 and s.num_waiting == 3


def test_preemption_by_recompute_loses_and_repeats_nothing():
    # 8 blocks of 4 tokens: three 6-token prompts generating 8 tokens each cannot all fit.
    s = make_scheduler(num_blocks=8, block_size=4, budget=64)
    seqs = [seq(str(i), 6, max_tokens=8) for i in range(3)]
    for x in seqs:
        s.add(x)
    produced = {x.request_id: 0 for x in seqs}
    steps = 0
    while s.has_unfinished:
        out = s.schedule()
        sampled = [100 + produced[x.request_id] if flag else None for x, flag in zip(out.seqs, out.samples())]
        for x in s.update_from_output(out, sampled):
            produced[x.request_id] += 1
        assert s.block_manager.num_free_blocks + sum(len(x.block_table) for x in s.running) == 8
        steps += 1
        assert steps < 200
    assert s.num_preemptions > 0
    for x in seqs:
        # Every generated token appears once, in order, after an untouched prompt.
        assert x.prompt_token_ids == [1, 2, 3, 4, 5, 6]
        assert x.output_token_ids == [100 + i for i in range(8)]
        assert x.finish_reason is FinishReason.LENGTH
    assert s.block_manager.num_free_blocks == 8


def test_preempted_sequence_recomputes_prompt_and_output():
    s = make_scheduler(num_blocks=4, block_size=4, budget=64)
    a, b = seq("a", 7, max_tokens=20), seq("b", 7, max_tokens=20)
    s.add(a)
    s.add(b)
    run_step(s)  # both prefilled: 2 blocks each
    run_step(s)  # 8 tokens each: still 2 blocks each
    out = s.schedule()  # each needs a third block: b (newest) is preempted for a
    assert out.preempted == [b]
    assert b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0 and not b.block_table
    assert s.waiting[0] is b



def test_a_stop_string_found_after_the_sequence_was_preempted_finishes_it():
    """Scheduled ahead, a step's stop strings are checked inside the next step, whose schedule
    may have preempted the sequence meanwhile: it waits, and it finishes from there."""
    s = make_scheduler(num_blocks=4, block_size=4, budget=64)
    a, b = seq("a", 7, max_tokens=20), seq("b", 7, max_tokens=20)
    s.add(a)
    s.add(b)
    run_step(s)
    run_step(s)
    s.schedule()  # b is preempted for a
    s.stop(b, "stop")
    assert (b.status, b.finish_reason, b.stop_reason) == (SequenceStatus.FINISHED, FinishReason.STOP, "stop")
    assert b not in s.waiting and "b" not in s.requests

def test_stop_conditions():
    s = make_scheduler(eos=(99,))
    a, b, c, d = seq("a", 2), seq("b", 2, ignore_eos=True), seq("c", 2, stop_token_ids=[5]), seq("d", 2, max_tokens=1)
    for x in (a, b, c, d):
        s.add(x)
    out = s.schedule()
    tokens = {"a": 99, "b": 99, "c": 5, "d": 3}
    s.update_from_output(out, [tokens[x.request_id] for x in out.seqs])
    assert a.finish_reason is FinishReason.STOP
    assert b.status is SequenceStatus.RUNNING
    assert c.finish_reason is FinishReason.STOP
    assert d.finish_reason is FinishReason.LENGTH
    assert s.num_running == 1


def test_max_model_len_finishes_with_length():
    s = make_scheduler(max_model_len=5)
    a = seq("a", 3, max_tokens=100)
    s.add(a)
    while s.has_unfinished:
        run_step(s)
    assert a.num_tokens == 5 and a.finish_reason is FinishReason.LENGTH


def test_abort_frees_blocks_waiting_or_running():
    s = make_scheduler(max_num_seqs=1)
    a, b = seq("a", 10), seq("b", 10)
    s.add(a)
    s.add(b)
    run_step(s)
    assert a.block_table and b.status is SequenceStatus.WAITING
    assert s.abort("a") is a and a.finish_reason is FinishReason.ABORT
    assert s.abort("b") is b
    assert s.abort("nope") is None
    assert s.block_manager.num_free_blocks == s.block_manager.num_blocks
    assert not s.has_unfinished


def test_stop_tokens_end_a_request_only_past_min_tokens():
    """The sampler masks EOS and stop tokens for the first min_tokens tokens; the stop check agrees."""
    s = make_scheduler(eos=(99,))
    a = seq("a", 3, max_tokens=8, min_tokens=2, stop_token_ids=[50])
    s.add(a)
    run_step(s, token=99)
    run_step(s, token=50)
    assert not a.is_finished and a.output_token_ids == [99, 50]
    run_step(s, token=50)
    assert a.finish_reason is FinishReason.STOP and a.stop_reason == 50
    b = seq("b", 3)
    s.add(b)
    run_step(s, token=99)
    assert b.finish_reason is FinishReason.STOP and b.stop_reason is None  # EOS names no stop reason


def test_stop_string_finish_frees_blocks_and_overrides_length():
    s = make_scheduler()
    a, b = seq("a", 3, max_tokens=8), seq("b", 3, max_tokens=1)
    s.add(a)
    s.add(b)
    run_step(s)
    assert b.finish_reason is FinishReason.LENGTH
    s.stop(a, "stop here")
    s.stop(b, "and here")  # its last token completed a stop string too: the string wins, as vLLM's
    assert (a.finish_reason, a.stop_reason, a.is_finished) == (FinishReason.STOP, "stop here", True)
    assert (b.finish_reason, b.stop_reason) == (FinishReason.STOP, "and here")
    assert s.block_manager.usage == 0.0 and not s.has_unfinished


def test_first_scheduled_time_is_set_once_despite_preemption():
    clock = iter(range(1000))
    s = make_scheduler(num_blocks=4, block_size=4, budget=64)
    s.clock = lambda: float(next(clock))
    a, b = seq("a", 4, max_tokens=6), seq("b", 4, max_tokens=6)
    s.add(a)
    s.add(b)
    assert a.first_scheduled_time is None
    run_step(s)
    first = (a.first_scheduled_time, b.first_scheduled_time)
    assert None not in first
    while s.has_unfinished:  # 4 blocks for two sequences growing to 10 tokens: one is preempted
        run_step(s)
    assert s.num_preemptions > 0
    assert (a.first_scheduled_time, b.first_scheduled_time) == first


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 12), st.integers(1, 12)), min_size=1, max_size=12),
       st.integers(6, 40), st.integers(2, 24), st.integers(0, 2**16))
def test_the_decode_fast_path_schedules_what_the_running_loop_does(requests, num_blocks, budget, seed):
    """`schedule_all_decodes` (every running sequence a one-token decode: one array pass) against
    the running loop alone, step for step, through admissions, block ends, preemptions and
    finishes: the same sequences, tokens, preemptions and blocks."""
    import random
    from unittest import mock

    from megainfer.scheduling import scheduler as scheduler_module

    fast = make_scheduler(num_blocks=num_blocks, budget=budget)
    slow = make_scheduler(num_blocks=num_blocks, budget=budget)
    for s in (fast, slow):
        for i, (prompt, new) in enumerate(requests):
            s.add(seq(f"r{i}", prompt, max_tokens=new))
    rng_fast, rng_slow = random.Random(seed), random.Random(seed)
    for _ in range(200):
        if not fast.has_unfinished:
            break
        a = fast.schedule()
        with mock.patch.object(scheduler_module, "schedule_all_decodes", return_value=0):
            b = slow.schedule()
        assert [s.request_id for s in a.seqs] == [s.request_id for s in b.seqs]
        assert a.num_scheduled_tokens == b.num_scheduled_tokens and a.num_single_token == b.num_single_token
        assert [s.request_id for s in a.preempted] == [s.request_id for s in b.preempted]
        assert [s.block_table for s in a.seqs] == [s.block_table for s in b.seqs]
        fast.update_from_output(a, [rng_fast.choice([7, 7, 7, 99]) if x else None for x in a.samples()])
        slow.update_from_output(b, [rng_slow.choice([7, 7, 7, 99]) if x else None for x in b.samples()])
    assert not slow.has_unfinished and not fast.has_unfinished


def _token_for(seq) -> int:
    """A model stand-in: the next token is a function of the request and its position, EOS (99)
    now and then, so two schedules of the same requests generate the same text."""
    return 99 if zlib.crc32(f"{seq.request_id}/{len(seq.prompt_token_ids)}/{seq.num_tokens}".encode()) % 11 == 0 else 7


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 12), st.integers(1, 12)), min_size=1, max_size=12),
       st.integers(8, 40), st.integers(2, 24))
def test_scheduling_ahead_generates_what_scheduling_after_does(requests, num_blocks, budget):
    """Asynchronous scheduling at the scheduler's level: step n+1 scheduled with step n's tokens
    held as placeholders (`advance_ahead`), the tokens written in (`place`) and settled later
    (`settle`), as an attention node's engine runs it. A sequence that stops runs one step too
    many and that token is dropped: every request ends with the same tokens and reason as
    under `update_from_output`, and every block comes back."""
    from megainfer.scheduling.token_recorder import PLACEHOLDER

    def sampled(out):
        return [_token_for(s) if flag else None for s, flag in zip(out.seqs, out.samples())]

    def make():
        s = make_scheduler(num_blocks=num_blocks, budget=budget)
        seqs = [seq(f"r{i}", prompt, max_tokens=new) for i, (prompt, new) in enumerate(requests)]
        for q in seqs:
            s.add(q)
        return s, seqs

    sync, sync_seqs = make()
    for _ in range(300):
        if not sync.has_unfinished:
            break
        out = sync.schedule()
        sync.update_from_output(out, sampled(out))

    ahead, ahead_seqs = make()
    out, pending = ahead.schedule(), None
    for _ in range(300):
        if out.is_empty and pending is None:
            break
        if pending is not None:  # inside step n+1, once under way: step n settled
            ahead.settle(*pending)
            pending = None
        if out.is_empty:
            out = ahead.schedule()
            continue
        tokens = sampled(out)  # the step's sampling (placeholders of the step before already written)
        assert PLACEHOLDER not in [t for s in out.seqs for t in s.token_ids[:s.num_computed_tokens]]
        ahead.advance_ahead(out)
        following = ahead.schedule()
        ahead.place(out, tokens)
        pending, out = (out, tokens), following
    assert not ahead.has_unfinished and not sync.has_unfinished
    for a, b in zip(sync_seqs, ahead_seqs):
        assert (a.token_ids, a.finish_reason) == (b.token_ids, b.finish_reason), a.request_id
    assert ahead.block_manager.num_free_blocks == num_blocks
