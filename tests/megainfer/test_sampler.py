from __future__ import annotations

import pytest
import torch

from megainfer.errors import RequestError
from megainfer.runner.sampler import Sampler, _filter_min_p, apply_penalties, position_logprobs
from megainfer.sampling_params import SamplingParams
from megainfer.scheduling.sequence import Sequence


def logits(rows=4, vocab=50, seed=0):
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed))


def test_greedy_and_top_k_one_are_argmax():
    x = logits()
    s = Sampler(0, "cpu")
    ids = [str(i) for i in range(4)]
    expected = x.argmax(-1).tolist()
    assert s.sample(x, ids, [SamplingParams(temperature=0)] * 4) == expected
    assert s.sample(x, ids, [SamplingParams(temperature=1.0, top_k=1)] * 4) == expected
    assert s.sample(x, ids, [SamplingParams(temperature=1.0, top_p=1e-6)] * 4) == expected


def test_mixed_greedy_and_random_rows():
    x = logits()
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0), SamplingParams(temperature=0),
              SamplingParams(temperature=2.0)]
    out = Sampler(0, "cpu").sample(x, list("abcd"), params)
    assert out[0] == x[0].argmax() and out[2] == x[2].argmax()


def test_seeded_request_is_independent_of_batch():
    x = logits(rows=3)
    p = SamplingParams(temperature=1.0, seed=1234)
    other = SamplingParams(temperature=1.0)
    draws_alone = [Sampler(0, "cpu").sample(x[1:2], ["r"], [p])[0] for _ in range(3)]
    draws_batched = [Sampler(s, "cpu").sample(x, ["o1", "r", "o2"], [other, p, other])[1] for s in range(3)]
    assert draws_alone == draws_batched


def test_seeded_request_advances_its_generator():
    x = logits(rows=1, vocab=1000)
    s = Sampler(0, "cpu")
    p = SamplingParams(temperature=5.0, seed=7)
    draws = [s.sample(x, ["r"], [p])[0] for _ in range(20)]
    assert len(set(draws)) > 1  # not the same draw every step
    s.forget("r")
    assert s.sample(x, ["r"], [p])[0] == draws[0]  # a fresh request restarts the stream


def test_top_k_and_top_p_restrict_support():
    x = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    s = Sampler(0, "cpu")
    top2 = {s.sample(x, ["a"], [SamplingParams(temperature=1.0, top_k=2)])[0] for _ in range(200)}
    assert top2 == {0, 1}
    probs = torch.softmax(x[0], -1)  # 0.636, 0.234, ...: top_p=0.7 keeps two tokens
    assert probs[0] < 0.7 < probs[0] + probs[1]
    nucleus = {s.sample(x, ["a"], [SamplingParams(temperature=1.0, top_p=0.7)])[0] for _ in range(200)}
    assert nucleus == {0, 1}


def test_sampling_follows_the_distribution():
    x = torch.tensor([[1.0, 0.0, -1.0]]).repeat(20000, 1)
    out = torch.tensor(Sampler(3, "cpu").sample(x, [str(i) for i in range(20000)], [SamplingParams()] * 20000))
    freq = torch.bincount(out, minlength=3).float() / 20000
    assert torch.allclose(freq, torch.softmax(x[0], -1), atol=0.015)


@pytest.mark.parametrize("kwargs, field", [
    (dict(max_tokens=0), "max_tokens"), (dict(max_tokens=-3), "max_tokens"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(temperature=-0.1), "temperature"), (dict(top_k=-2), "top_k"),
    (dict(seed=-1), "seed"), (dict(stop_token_ids=[-1]), "stop_token_ids"),
])
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(RequestError, match=field):
        SamplingParams(**kwargs)


# -- penalties, min_p, min_tokens, logprobs ------------------------------------------------------

def history(prompt, output, params=None):
    """A sequence whose prompt is `prompt` and which generated `output` so far."""
    return Sequence("h", list(prompt), params or SamplingParams(), token_ids=list(prompt) + list(output))


def test_penalties_match_a_hand_computed_reference():
    x = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]])
    p = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    h = history(prompt=[0, 1], output=[3, 3, 4])
    expected = torch.tensor([[
        2.0 / 2,  # in the prompt, positive: divided
        -1.0 * 2,  # in the prompt, negative: multiplied
        0.5,  # never seen
        3.0 / 2 - 0.5 * 2 - 0.25,  # generated twice: repetition, frequency x2, presence
        -2.0 * 2 - 0.5 * 1 - 0.25,  # generated once
        1.0,
    ]])
    torch.testing.assert_close(apply_penalties(x, [p], [h]), expected)


def test_repetition_penalty_matches_transformers():
    transformers = pytest.importorskip("transformers")
    x = logits(rows=3, vocab=40, seed=3)
    prompts = [[1, 2, 3], [5, 5, 9], [0]]
    outputs = [[7, 3], [], [39, 39, 12]]
    penalty = 1.7
    params = [SamplingParams(repetition_penalty=penalty)] * 3
    ours = apply_penalties(x, params, [history(p, o) for p, o in zip(prompts, outputs)])
    processor = transformers.RepetitionPenaltyLogitsProcessor(penalty)
    for row in range(3):
        ids = torch.tensor([prompts[row] + outputs[row]])
        torch.testing.assert_close(ours[row:row + 1], processor(ids, x[row:row + 1].clone()))


def test_min_p_matches_transformers_and_restricts_support():
    transformers = pytest.importorskip("transformers")
    x = logits(rows=2, vocab=30, seed=4) * 3
    for min_p in (0.05, 0.3):
        warper = transformers.MinPLogitsWarper(min_p)
        expected = torch.isinf(warper(None, x.clone()))
        torch.testing.assert_close(torch.isinf(_filter_min_p(x, [min_p] * 2)), expected)
    probs = torch.softmax(x[0], -1)
    allowed = set((probs >= 0.3 * probs.max()).nonzero().flatten().tolist())
    s = Sampler(0, "cpu")
    drawn = {s.sample(x[:1], ["a"], [SamplingParams(temperature=1.0, min_p=0.3)])[0] for _ in range(300)}
    assert drawn <= allowed and len(drawn) > 1


def test_min_tokens_masks_eos_and_stop_tokens_until_reached():
    x = torch.zeros(1, 10)
    x[0, 9] = 10.0  # EOS (9) by far the likeliest, then the stop token 8
    x[0, 8] = 5.0
    s = Sampler(0, "cpu", eos_token_ids=[9])
    p = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[8])
    assert s.sample(x, ["a"], [p], [history([1], [2, 3])]) not in ([9], [8])  # 2 of 3 generated
    assert s.sample(x, ["a"], [p], [history([1], [2, 3, 4])]) == [9]  # 3 generated: EOS may end it
    ignore = p.replace(ignore_eos=True)
    assert s.sample(x, ["a"], [ignore], [history([1], [])]) == [9]  # EOS is not masked when ignored
    assert s.sample(x, ["a"], [p.replace(min_tokens=0)], [history([1], [])]) == [9]


def test_penalties_steer_greedy_rows_and_leave_others_alone():
    x = torch.tensor([[3.0, 2.9, 0.0], [3.0, 2.9, 0.0]])
    s = Sampler(0, "cpu")
    params = [SamplingParams(temperature=0, presence_penalty=1.0), SamplingParams(temperature=0)]
    hist = [history([2], [0]), history([2], [0])]
    before = x.clone()
    assert s.sample(x, ["a", "b"], params, hist) == [1, 0]
    assert torch.equal(x, before)  # the caller's logits are untouched (raw logprobs read them)


def test_no_penalty_rows_skip_the_penalty_stage(monkeypatch):
    import megainfer.runner.sampler as sampler_module

    def fail(*args):
        raise AssertionError("penalties applied to rows without any")

    monkeypatch.setattr(sampler_module, "apply_penalties", fail)
    assert Sampler(0, "cpu").sample(logits(), list("abcd"), [SamplingParams(temperature=0)] * 4) \
        == logits().argmax(-1).tolist()


def test_seeded_penalised_request_is_independent_of_batch():
    x = logits(rows=3, vocab=64, seed=5)
    p = SamplingParams(temperature=1.0, seed=99, repetition_penalty=1.3, frequency_penalty=0.7, min_p=0.02)
    other = SamplingParams(temperature=0.8, presence_penalty=1.5)
    mine, theirs = history([1, 2], [3, 3]), history([4], [5])
    alone = [Sampler(0, "cpu").sample(x[1:2], ["r"], [p], [mine])[0] for _ in range(3)]
    batched = [Sampler(s, "cpu").sample(x, ["o1", "r", "o2"], [other, p, other], [theirs, mine, theirs])[1]
               for s in range(3)]
    assert alone == batched


def test_position_logprobs_are_raw_log_softmax_with_ranks():
    x = logits(rows=2, vocab=12, seed=6)
    reference = torch.log_softmax(x, -1)
    chosen = [int(reference[0].argsort()[-3]), int(reference[1].argmax())]  # 3rd likeliest, likeliest
    entries = position_logprobs(x, chosen, [2, 0])
    first = entries[0]
    assert list(first)[0] == chosen[0] and first[chosen[0]].rank == 3
    assert len(first) == 3  # the token, then the top 2
    top2 = reference[0].topk(2)
    for rank, (value, token) in enumerate(zip(top2.values.tolist(), top2.indices.tolist()), start=1):
        assert first[token].rank == rank and first[token].logprob == pytest.approx(value, abs=1e-6)
    assert first[chosen[0]].logprob == pytest.approx(float(reference[0, chosen[0]]), abs=1e-6)
    assert list(entries[1]) == [chosen[1]] and entries[1][chosen[1]].rank == 1
    assert all(lp.decoded_token is None for e in entries for lp in e.values())


def test_top_one_logprob_of_the_chosen_token_appears_once():
    x = logits(rows=1, vocab=12, seed=7)
    best = int(x[0].argmax())
    entry = position_logprobs(x, [best], [5])[0]
    assert list(entry)[0] == best and len(entry) == 5 and entry[best].rank == 1
