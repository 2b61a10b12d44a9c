from __future__ import annotations

import pytest
import torch

from megainfer.errors import RequestError
from megainfer.sampler import Sampler
from megainfer.sampling_params import SamplingParams


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
