"""Layered prefill in the scheduler and the engine: one layer group per step, G steps per
prompt, decode every step, expert accounting, identical tokens."""

from __future__ import annotations

from megainfer import Engine, LLM, SamplingParams
from megainfer.engine_config import EngineConfig
from megainfer.messages import LayeredSettings
from megainfer.presets import PRESETS
from megainfer.scheduling.kv_cache import BlockManager
from megainfer.scheduling.scheduler import LayeredPrefill, Scheduler
from megainfer.scheduling.sequence import Sequence

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def layered_scheduler(num_layers=8, group_tokens=16, groups=None, chunk_tokens=1024):
    policy = LayeredPrefill(LayeredSettings.of(num_layers, group_tokens, groups, chunk_tokens))
    return Scheduler(BlockManager(256, 4), policy,
                     max_num_seqs=8, max_num_batched_tokens=64, max_model_len=4096)


def step(s: Scheduler):
    out = s.schedule()
    sampled = [7 if flag else None for flag in out.samples()]
    if out.layered is not None:
        last = out.layered.last
        sampled += [7 if last and seq.num_computed_tokens + n == seq.num_tokens else None
                    for seq, n in zip(out.layered.seqs, out.layered.num_tokens)]
    s.update_from_output(out, sampled)
    return out


def test_prompt_passes_one_group_per_step_and_finishes_after_g_steps():
    s = layered_scheduler(num_layers=8, group_tokens=16)
    seq = Sequence("a", list(range(1, 41)), GREEDY)  # 40 tokens -> G = ceil(40 / 16) = 3
    s.add(seq)
    ranges = []
    for _ in range(3):
        out = step(s)
        assert out.layered is not None and out.layered.num_groups == 3
        assert out.layered.seqs == [seq] and out.layered.num_tokens == [40]
        ranges.append(out.layered.layers)
        assert seq.num_output_tokens == (1 if out.layered.last else 0)
    assert ranges == [(0, 3), (3, 5), (5, 8)]  # contiguous, covering every layer once
    assert seq.num_computed_tokens == 40 and seq.num_output_tokens == 1
    assert step(s).layered is None  # now it decodes


def test_decode_runs_every_step_while_a_cohort_is_in_flight():
    s = layered_scheduler(num_layers=4, groups=4, group_tokens=32)  # cohorts of up to 128 tokens
    early = Sequence("early", [1, 2, 3], GREEDY)
    s.add(early)
    while early.num_output_tokens == 0:
        step(s)
    late = Sequence("late", list(range(1, 100)), GREEDY)
    s.add(late)
    for _ in range(4):
        out = step(s)
        assert out.seqs == [early] and out.num_scheduled_tokens == [1]  # decode never stalls
        assert out.layered.seqs == [late]
    assert late.num_output_tokens == 1 and early.num_output_tokens == 5


def test_short_prompts_share_a_cohort_and_long_ones_go_in_chunks():
    s = layered_scheduler(num_layers=4, group_tokens=1000, chunk_tokens=50)
    a, b, c = Sequence("a", [1] * 10, GREEDY), Sequence("b", [2] * 20, GREEDY), Sequence("c", [3] * 70, GREEDY)
    for seq in (a, b, c):
        s.add(seq)
    out = step(s)
    # The short prompts share a cohort; the long one is not split to fill the 20 tokens left.
    assert out.layered.seqs == [a, b] and out.layered.num_tokens == [10, 20]
    assert out.layered.num_groups == 1  # G = ceil(30 / 1000)
    out = step(s)
    assert out.layered.seqs == [c] and out.layered.num_tokens == [50]  # alone, the long prompt is chunked
    out = step(s)
    assert out.layered.seqs == [c] and out.layered.num_tokens == [20]  # the rest of it
    assert c.num_computed_tokens == 70 and c.num_output_tokens == 1


def test_capped_groups_let_a_cohort_fill_its_chunk_and_pass_in_at_most_that_many_steps():
    # The layered-prefill paper's engine: a cohort fills the chunk limit (8,192 there) and passes
    # in ceil(tokens / group_tokens) stages, at most --num-stages of them.
    s = Scheduler(BlockManager(256, 4), LayeredPrefill(LayeredSettings.of(8, 16, None, 200, max_layer_groups=2)),
                  max_num_seqs=8, max_num_batched_tokens=64, max_model_len=4096)
    short, long = Sequence("short", [1] * 10, GREEDY), Sequence("long", [2] * 150, GREEDY)
    s.add(short)
    out = step(s)
    assert out.layered.num_groups == 1 and out.layered.layers == (0, 8)  # 10 tokens: one stage
    s.add(long)
    outs = [step(s), step(s)]
    # 150 tokens would take ceil(150 / 16) = 10 groups, and uncapped at most 8 x 16 = 128 tokens
    # could share a cohort: capped, the whole prompt passes in 2 steps of 4 layers each.
    assert [o.layered.num_tokens for o in outs] == [[150], [150]]
    assert [o.layered.layers for o in outs] == [(0, 4), (4, 8)]
    assert long.num_output_tokens == 1 and step(s).layered is None


def test_fixed_and_capped_groups_exclude_each_other():
    import pytest
    from megainfer.errors import ConfigError
    with pytest.raises(ConfigError, match="max_layer_groups"):
        EngineConfig(prefill_policy="layered", num_layer_groups=4, max_layer_groups=4)
    with pytest.raises(ConfigError, match="max_layer_groups"):
        EngineConfig(max_layer_groups=0)
    config = EngineConfig(prefill_policy="layered", max_layer_groups=12)
    assert config.layered_settings(36).chunk_tokens == 8192 and config.layered_settings(36).groups(8192) == 12


def test_a_group_table_sets_the_stages_by_cohort_tokens_and_max_layer_groups_above_it():
    # The layered-prefill paper's engine at --num-stages 12: 1, 2, 4 and 6 stages up to 512,
    # 1,024, 2,048 and 4,096 tokens, 12 above.
    table = ((512, 1), (1024, 2), (2048, 4), (4096, 6))
    config = EngineConfig(prefill_policy="layered", max_layer_groups=12, layered_group_table=table)
    settings = config.layered_settings(36)
    assert [settings.groups(t) for t in (1, 512, 513, 1500, 2049, 4096, 4097, 8192)] == [1, 1, 2, 4, 6, 6, 12, 12]
    assert LayeredSettings.of(36, 512, None, 8192, 12).groups(2049) == 5  # without it: ceil(2,049 / 512)
    assert LayeredSettings.of(36, 512, None, 8192, 8, group_table=()).groups(10) == 8  # empty: always the cap


def test_a_bad_group_table_names_the_option_and_the_fix():
    import pytest
    from megainfer.errors import ConfigError
    with pytest.raises(ConfigError, match="needs 'max_layer_groups'"):
        EngineConfig(prefill_policy="layered", layered_group_table=((512, 1),))
    with pytest.raises(ConfigError, match=r"row \[512, 20\].*at most max_layer_groups \(12\)"):
        EngineConfig(prefill_policy="layered", max_layer_groups=12, layered_group_table=((512, 20),))
    with pytest.raises(ConfigError, match="must rise in tokens"):
        EngineConfig(prefill_policy="layered", max_layer_groups=12, layered_group_table=((1024, 2), (512, 1)))
    with pytest.raises(ConfigError, match="pairs"):
        EngineConfig(prefill_policy="layered", max_layer_groups=12, layered_group_table=(5,))
    with pytest.raises(ConfigError, match="layered_fill_cohorts"):
        EngineConfig(prefill_policy="layered", layered_fill_cohorts="yes")


def test_filling_cohorts_cuts_the_last_member_and_its_rest_leads_the_next_cohort():
    def cohorts(fill: bool) -> list[list[tuple[str, int]]]:
        settings = LayeredSettings.of(4, 16, None, 100, max_layer_groups=1, fill_cohorts=fill)
        s = Scheduler(BlockManager(256, 4), LayeredPrefill(settings), max_num_seqs=8, max_num_batched_tokens=64,
                      max_model_len=4096)
        for name, n in (("a", 60), ("b", 70), ("c", 20)):
            s.add(Sequence(name, [3] * n, GREEDY))
        passes = [step(s).layered for _ in range(2)]  # one group each: a cohort per step
        return [[(q.request_id, n) for q, n in zip(p.seqs, p.num_tokens)] for p in passes]

    # Filling: a takes 60 and b the 40 left of 100; b's other 30 lead the next cohort, with c.
    assert cohorts(True) == [[("a", 60), ("b", 40)], [("b", 30), ("c", 20)]]
    # megainfer's default cuts only a cohort's first member: b waits for the next cohort whole.
    assert cohorts(False) == [[("a", 60)], [("b", 70), ("c", 20)]]


def test_engine_layered_equals_chunked_and_counts_expert_bytes_per_group():
    prompts = [list(range(3, 3 + n)) for n in (5, 40, 1, 130, 17)]
    chunked = LLM("tiny-mixtral", num_kv_blocks=256).generate(prompts, GREEDY)
    llm = LLM("tiny-mixtral", num_kv_blocks=256, prefill_policy="layered", num_layer_groups=4)
    layered = llm.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in layered] == [o.outputs[0].token_ids for o in chunked]

    # One prompt, one layer per group, nothing decoding: each step activates experts in its layer only.
    engine = Engine("tiny-mixtral", num_kv_blocks=64, prefill_policy="layered", num_layer_groups=4)
    engine.add_request("r", list(range(5, 60)), SamplingParams(max_tokens=1, temperature=0.0))
    expert_bytes = PRESETS["tiny-mixtral"].expert_bytes("float32")
    total = 0
    for layer in range(4):
        engine.step()
        load = engine.stats().last_step_expert_load
        assert [bool(ids) for ids in load.activated] == [i == layer for i in range(4)]
        assert load.bytes_read == len(load.activated[layer]) * expert_bytes
        total += load.bytes_read
    assert engine.stats().expert_bytes_read == total
    assert not engine.has_unfinished_requests()
    assert engine.runner.layered_hidden_bytes == 0  # nothing left in flight


def test_the_cohort_hidden_states_are_counted_against_the_kv_budget():
    model = PRESETS["tiny-mixtral"]
    budget = 64 << 20
    chunked = EngineConfig(kv_cache_bytes=budget, max_num_seqs=4096)
    layered = chunked.replace(prefill_policy="layered", group_tokens=512)
    reserve = layered.layered_hidden_reserve(model)
    assert reserve == min(8192, 512 * model.num_layers) * model.hidden_size * 4
    block_bytes = chunked.block_size * model.kv_bytes_per_token("float32")
    n_chunked = chunked.resolved_num_kv_blocks(model, 4096, None)
    n_layered = layered.resolved_num_kv_blocks(model, 4096, None)
    assert n_chunked == budget // block_bytes and n_layered == (budget - reserve) // block_bytes
