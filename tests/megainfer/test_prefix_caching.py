"""Automatic prefix caching: the block manager's naming, sharing and eviction (against a
reference model of its invariants), and the engine's tokens equal with and without it on prompts
that share prefixes, through chunked and layered prefill and preemption."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megainfer import LLM, SamplingParams
from megainfer.engine.engine import Engine
from megainfer.engine_config import EngineConfig
from megainfer.scheduling.kv_cache import RELEASED, BlockManager
from megainfer.scheduling.prefix_hash import extend_block_hashes, model_salt, prompt_routing_keys, routing_key
from megainfer.scheduling.sequence import Sequence, SequenceStatus
from tests.helpers import generate_all

SALT = model_salt("test-model", "float32", 4)
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def computed(bm: BlockManager, seq: Sequence, n: int) -> None:
    """`n` more tokens of `seq` scheduled and computed (as a step would)."""
    bm.allocate(seq, n)
    seq.num_computed_tokens += n
    bm.register_computed(seq)


def running(bm: BlockManager, tokens: list[int], salt: str | None = None) -> Sequence:
    seq = Sequence("r", tokens, SamplingParams(cache_salt=salt))
    bm.claim_prefix(seq)
    computed(bm, seq, seq.num_uncomputed_tokens)
    return seq


def test_a_later_prompt_takes_the_cached_blocks_of_its_shared_prefix():
    bm = BlockManager(32, 4, prefix_salt=SALT)
    first = running(bm, list(range(10)))  # blocks 0-3, 4-7 full; 8-9 partial
    second = Sequence("s", list(range(9)) + [99, 98], SamplingParams())
    assert bm.claim_prefix(second) == 8  # two full blocks; the third differs
    assert second.block_table == first.block_table[:2]
    assert bm.prefix.holders[first.block_table[0]] == 2
    bm.free(first)
    assert bm.prefix.holders[second.block_table[0]] == 1  # still held by the second
    assert bm.num_free_blocks == 32 - 2


def test_a_whole_cached_prompt_still_computes_its_last_token():
    bm = BlockManager(32, 4, prefix_salt=SALT)
    bm.free(running(bm, list(range(8))))
    again = Sequence("s", list(range(8)), SamplingParams())
    assert bm.claim_prefix(again) == 4  # not 8: the last token is computed to sample from
    assert again.num_uncomputed_tokens == 4


def test_cache_salt_keeps_requests_apart_and_prompt_logprobs_skip_the_cache():
    bm = BlockManager(32, 4, prefix_salt=SALT)
    bm.free(running(bm, list(range(12)), salt="tenant-a"))
    assert bm.claim_prefix(Sequence("b", list(range(12)), SamplingParams(cache_salt="tenant-b"))) == 0
    assert bm.claim_prefix(Sequence("n", list(range(12)), SamplingParams())) == 0  # unsalted differs from salted
    assert bm.claim_prefix(Sequence("a", list(range(12)), SamplingParams(cache_salt="tenant-a"))) == 8
    assert bm.claim_prefix(Sequence("p", list(range(12)), SamplingParams(cache_salt="tenant-a",
                                                                          prompt_logprobs=1))) == 0


def test_never_named_blocks_go_first_then_the_least_recently_released_cached_ones():
    bm = BlockManager(6, 4, prefix_salt=SALT)
    a = running(bm, [1] * 8 + [0])  # two named blocks, one partial
    b = running(bm, [2] * 8 + [0])
    bm.free(a)  # a's tail first into the evictable queue, then its head
    bm.free(b)
    assert bm.num_free_blocks == 6 and len(bm.prefix.evictable) == 4
    fresh = Sequence("c", [3] * 8, SamplingParams())
    computed(bm, fresh, 8)  # takes the 2 unnamed blocks, nothing evicted
    assert len(bm.prefix.evictable) == 4
    computed(bm, Sequence("d", [4] * 4, SamplingParams()), 4)  # evicts a's second block (released before its first)
    assert bm.claim_prefix(Sequence("a2", [1] * 8 + [0], SamplingParams())) == 4
    assert bm.claim_prefix(Sequence("b2", [2] * 8 + [0], SamplingParams())) == 8


def test_a_failed_sequence_leaves_no_cached_blocks_and_reset_forgets_the_rest():
    bm = BlockManager(16, 4, prefix_salt=SALT)
    bm.free(running(bm, list(range(9))), keep_cache=False)
    assert bm.claim_prefix(Sequence("s", list(range(9)), SamplingParams())) == 0
    bm.free(running(bm, list(range(9))))
    assert bm.claim_prefix(Sequence("t", list(range(9)), SamplingParams())) == 8
    held = running(bm, list(range(50, 59)))
    assert bm.reset_prefix_cache()
    assert not bm.prefix.block_of and not bm.prefix.evictable
    assert bm.claim_prefix(Sequence("u", list(range(50, 59)), SamplingParams())) == 0
    bm.free(held)  # blocks held across the reset come back as plain free blocks
    assert bm.num_free_blocks == 16 - 2  # "t" still holds two
    assert not BlockManager(16, 4).reset_prefix_cache()


def test_a_windowed_hit_takes_the_full_blocks_and_the_window_blocks_its_window_reaches():
    """gpt-oss's hybrid tables: blocks 0..k-1 of the full table, and of the window table only those
    the window of position k * block_size reaches; the rest of it `RELEASED`, as if computed."""
    bm = BlockManager(64, 4, window=6, prefix_salt=SALT)
    first = running(bm, list(range(26)))
    bm.free(first)
    second = Sequence("s", list(range(26)) + [99], SamplingParams())
    assert bm.claim_prefix(second) == 24  # six full blocks (the seventh is partial)
    assert second.window_released == 4  # position 24's window starts at 19: block 4
    assert second.window_table[:4] == [RELEASED] * 4 and RELEASED not in second.window_table[4:]
    assert bm.held_blocks(second) == 6 + 2
    # Decoding on, a sequence's window blocks fall behind and are released with their names kept.
    for _ in range(8):
        second.token_ids.append(7)
        computed(bm, second, second.num_uncomputed_tokens)
    assert second.window_released > 4
    third = Sequence("t", list(second.token_ids), SamplingParams())
    bm.free(second)
    assert bm.claim_prefix(third) == (len(third.token_ids) - 1) // 4 * 4


def test_summaries_give_routers_the_nodes_own_names():
    bm = BlockManager(32, 4, prefix_salt=SALT)
    first = bm.prefix.take_summary()
    assert first.whole and first.stored == []
    prompt = list(range(13))
    seq = running(bm, prompt)
    delta = bm.prefix.take_summary()
    assert not delta.whole and delta.stored == prompt_routing_keys(SALT, None, prompt, 4)  # 3 of 13 tokens' blocks
    bm.free(seq)
    bm.reset_prefix_cache()
    assert bm.prefix.take_summary().whole  # after a reset the reader starts over


class Reference:
    """What the block manager's state must be: every block free-and-unnamed, evictable (named,
    unheld) or held as often as sequences list it, and every name pointing at its block."""

    @staticmethod
    def check(bm: BlockManager, seqs: list[Sequence]) -> None:
        prefix = bm.prefix
        held = [0] * bm.num_blocks
        for seq in seqs:
            for block in seq.block_table + seq.window_table[seq.window_released:]:
                held[block] += 1
        assert held == prefix.holders
        free = set(bm.free_block_ids)
        assert len(free) == len(bm.free_block_ids)
        evictable = set(prefix.evictable)
        for block in range(bm.num_blocks):
            assert (block in free) + (block in evictable) + (held[block] > 0) == 1, block
        assert evictable <= set(prefix.name_of) and not free & set(prefix.name_of)
        assert all(prefix.name_of[b] == n for n, b in prefix.block_of.items())
        for seq in seqs:  # a sequence's named blocks carry its own names
            names = extend_block_hashes([], SALT, seq.token_ids, bm.block_size, seq.hashed_blocks)
            for k in range(seq.hashed_blocks):
                block = seq.block_table[k]
                assert prefix.name_of.get(block, names[k]) == names[k]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 5), st.integers(1, 14)), min_size=1, max_size=40),
       st.sampled_from([0, 6]))
def test_sharing_and_eviction_keep_the_block_accounting_whole(ops, window):
    """Random admissions (prompts from 4 shared prefixes), steps, frees and failures; with and
    without a sliding window's second table."""
    bm = BlockManager(32, 4, window=window, prefix_salt=SALT)
    prefixes = [[p * 100 + i for i in range(12)] for p in range(4)]
    seqs: list[Sequence] = []
    for n, (kind, which, length) in enumerate(ops):
        if kind <= 1:  # admit a prompt: a shared prefix's first `length` tokens and its own tail
            seq = Sequence(f"s{n}", prefixes[which % 4][:length] + [1000 + n] * (which + 1), SamplingParams())
            bm.claim_prefix(seq)
            if bm.can_allocate(seq, seq.num_uncomputed_tokens):
                computed(bm, seq, seq.num_uncomputed_tokens)
                seq.status = SequenceStatus.RUNNING
                seqs.append(seq)
            else:
                bm.free(seq)
        elif kind == 2 and seqs:  # a decode step of one sequence
            seq = seqs[which % len(seqs)]
            seq.token_ids.append(2000 + n)
            if bm.can_allocate(seq, 1):
                computed(bm, seq, 1)
            else:
                seq.token_ids.pop()
        elif seqs:  # one ends: finishes, or fails (its blocks not kept)
            bm.free(seqs.pop(which % len(seqs)), keep_cache=length % 3 != 0)
        Reference.check(bm, seqs)


@pytest.mark.parametrize("options", [
    dict(max_num_batched_tokens=16),  # chunked: the shared prompts arrive after their prefix's blocks filled
    dict(max_num_batched_tokens=16, num_kv_blocks=24, block_size=4),  # preemption under KV pressure
    dict(prefill_policy="layered", group_tokens=16, layered_chunk_tokens=24),
    dict(prefill_policy="layered", group_tokens=8, num_kv_blocks=24, block_size=4),
], ids=["chunked", "chunked-preempting", "layered", "layered-preempting"])
def test_tokens_are_the_same_with_and_without_prefix_caching(mixtral_ref, options):
    rng = random.Random(3)
    system = [rng.randrange(320) for _ in range(40)]  # a shared "system prompt"
    prompts = [system + [rng.randrange(320) for _ in range(rng.randrange(1, 12))] for _ in range(6)]
    prompts.append(prompts[0] + [7, 8, 9])  # a conversation's next turn
    on = Engine(str(mixtral_ref.path), EngineConfig(**options))
    off = Engine(str(mixtral_ref.path), EngineConfig(enable_prefix_caching=False, **options))
    assert generate_all(on, prompts, GREEDY) == generate_all(off, prompts, GREEDY)
    stats = on.stats()
    assert stats.prefix_cache_hits >= 32, stats  # most prompts found the system prompt's blocks
    assert stats.kv_cache_usage == 0.0 and not off.stats().prefix_caching
    if "num_kv_blocks" in options:
        assert stats.num_preemptions > 0


@pytest.mark.parametrize("options", [dict(max_num_batched_tokens=16),
                                     dict(max_num_batched_tokens=16, num_kv_blocks=40, block_size=4)],
                         ids=["chunked", "chunked-preempting"])
def test_gpt_oss_windows_share_prefixes_with_the_same_tokens(gpt_oss_ref, options):
    """Prompts much longer than the windows (8 and 16 tokens): a hit carries the window blocks its
    window reaches, and the tokens stay those computed without caching."""
    rng = random.Random(4)
    system = [rng.randrange(320) for _ in range(40)]
    prompts = [system + [rng.randrange(320) for _ in range(rng.randrange(1, 9))] for _ in range(5)]
    on = Engine(str(gpt_oss_ref.path), EngineConfig(**options))
    off = Engine(str(gpt_oss_ref.path), EngineConfig(enable_prefix_caching=False, **options))
    assert generate_all(on, prompts, GREEDY) == generate_all(off, prompts, GREEDY)
    stats = on.stats()
    assert stats.prefix_cache_hits >= 32 and stats.kv_cache_usage == 0.0, stats


def test_cached_tokens_reach_the_request_output(mixtral_ref):
    llm = LLM(str(mixtral_ref.path), block_size=8)
    prompt = list(range(1, 41))
    first = llm.generate([prompt], GREEDY)[0]
    second = llm.generate([prompt[:36] + [5, 6]], GREEDY)[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 32  # four full blocks of 8
    assert second.metrics.engine[0].cached_tokens == 32
    assert routing_key(b"\x01" * 32) == int.from_bytes(b"\x01" * 8, "little")


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_disaggregated_attention_node_shares_prefixes_with_the_colocated_tokens(mixtral_ref, async_scheduling):
    """1 attention node x 2 expert nodes, m = 2: the prompts admitted after the first step take
    the shared prompt's blocks (named as soon as the step that filled them was counted done, or
    advanced ahead); the expert nodes see only the uncached tokens."""
    from tests.megainfer.test_disagg import colocated, run_local_deployment

    rng = random.Random(5)
    system = [rng.randrange(320) for _ in range(40)]
    prompts = [system + [rng.randrange(320) for _ in range(5)] for _ in range(6)]
    got, stats = run_local_deployment(mixtral_ref.path, 1, 2, 2, prompts, async_scheduling=async_scheduling)
    assert got == colocated(mixtral_ref.path, prompts)
    assert stats[0].prefix_cache_hits >= 4 * 40  # the first two shared a step; the other four hit
    assert stats[0].kv_cache_usage == 0.0


@pytest.mark.parametrize("prefix_caching", [True, False], ids=["caching", "no-caching"])
def test_a_disaggregated_node_under_kv_pressure_gives_the_same_tokens_with_and_without_prefix_caching(
        mixtral_ref, prefix_caching):
    """1 attention node x 2 expert nodes, m = 2, scheduled ahead, with too few KV blocks for its
    requests (preemption by recompute): the colocated engine's tokens either way."""
    from tests.megainfer.test_disagg import colocated, run_local_deployment

    rng = random.Random(6)
    system = [rng.randrange(320) for _ in range(24)]
    prompts = [system + [rng.randrange(320) for _ in range(rng.randrange(1, 9))] for _ in range(5)]
    got, stats = run_local_deployment(mixtral_ref.path, 1, 2, 2, prompts, async_scheduling=True, num_kv_blocks=24,
                                      block_size=4, max_num_batched_tokens=16, enable_prefix_caching=prefix_caching)
    assert got == colocated(mixtral_ref.path, prompts)
    assert stats[0].num_preemptions > 0, "the small cache was meant to force preemption"
    assert stats[0].prefix_caching is prefix_caching and (stats[0].prefix_cache_hits > 0) is prefix_caching
    assert stats[0].kv_cache_usage == 0.0
