"""The offline API in vLLM's shape: RequestOutput / CompletionOutput, n completions, logprobs,
stop strings, chat rendering as transformers renders it, the model's default sampling settings."""

from __future__ import annotations

import math

import pytest
import torch

from megainfer import LLM, SamplingParams
from megainfer.errors import RequestError
from megainfer.outputs import CompletionOutput, RequestOutput
from tests.helpers import write_chat_checkpoint

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello world, hello tokenizer!"}]


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """A tiny random model with a Qwen-style tokenizer (ChatML template) and sampling defaults."""
    pytest.importorskip("transformers")
    return write_chat_checkpoint(tmp_path_factory.mktemp("chat"),
                                 {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_new_tokens": 5})


@pytest.fixture(scope="module")
def llm(chat_model):
    return LLM(str(chat_model), dtype="float32", num_kv_blocks=64)


@pytest.fixture(scope="module")
def tiny():
    return LLM("tiny-mixtral", dtype="float32", num_kv_blocks=64)


def test_generate_returns_vllm_shaped_outputs(tiny):
    outs = tiny.generate(["hello", [1, 2, 3], {"prompt_token_ids": [4, 5]}], GREEDY)
    assert [type(o) for o in outs] == [RequestOutput] * 3 and len({o.request_id for o in outs}) == 3
    assert [o.prompt for o in outs] == ["hello", None, None]
    assert outs[0].prompt_token_ids == [256, *b"hello"] and outs[2].prompt_token_ids == [4, 5]
    for out in outs:
        assert out.finished and out.prompt_logprobs is None and len(out.outputs) == 1
        (c,) = out.outputs
        assert isinstance(c, CompletionOutput) and c.index == 0 and len(c.token_ids) == 6
        assert c.finish_reason == "length" and type(c.finish_reason) is str and c.stop_reason is None
        assert c.logprobs is None and c.cumulative_logprob is None and c.error is None
        m = out.metrics
        assert 0 < m.ttft_s <= m.latency_s and len(m.tbt_s) == 5 and all(t >= 0 for t in m.tbt_s)
    # The same prompt, as a dict or as text: the same completion.
    assert tiny.generate({"prompt": "hello"}, GREEDY)[0].outputs[0].token_ids == outs[0].outputs[0].token_ids


def test_n_completions_with_a_seed_are_distinct_and_reproducible(tiny):
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=7, n=2, ignore_eos=True)
    first = tiny.generate(["a prompt", "another"], params)
    again = tiny.generate(["a prompt", "another"], params)
    for out, repeat in zip(first, again):
        assert [c.index for c in out.outputs] == [0, 1]
        a, b = (c.token_ids for c in out.outputs)
        assert len(a) == len(b) == 8 and a != b
        assert [c.token_ids for c in repeat.outputs] == [a, b]
        assert len(out.metrics.engine) == 2
    # Choice i is the request with the seed for_choice(i) gives it.
    alone = tiny.generate("a prompt", params.for_choice(1))[0].outputs[0].token_ids
    assert alone == first[0].outputs[1].token_ids


def test_logprobs_have_the_asked_count_and_add_up(tiny):
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    out = tiny.generate([7, 8, 9, 10], params)[0]
    c = out.outputs[0]
    assert len(c.logprobs) == len(c.token_ids) == 5
    for token, position in zip(c.token_ids, c.logprobs):
        assert next(iter(position)) == token  # the sampled token comes first
        assert len(position) in (3, 4)  # the top 3, and the token itself when it is not among them
        assert sorted(lp.rank for lp in position.values())[:3] == [1, 2, 3]
        assert position[token].rank == 1  # greedy picks the most likely
        assert all(lp.logprob <= 0 for lp in position.values())
    assert c.cumulative_logprob == pytest.approx(sum(p[t].logprob for t, p in zip(c.token_ids, c.logprobs)))
    assert len(out.prompt_logprobs) == 4 and out.prompt_logprobs[0] is None
    for token, position in zip([8, 9, 10], out.prompt_logprobs[1:]):
        assert next(iter(position)) == token and len(position) in (2, 3)


def test_logprobs_match_transformers(mixtral_ref):
    llm = LLM(str(mixtral_ref.path), dtype="float32")
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=2)
    c = llm.generate([mixtral_ref.prompts[1]], params)[0].outputs[0]
    assert c.token_ids == mixtral_ref.tokens[1][:4]
    want = torch.log_softmax(mixtral_ref.logits[1][:4], dim=-1)
    for step, (token, position) in enumerate(zip(c.token_ids, c.logprobs)):
        assert position[token].logprob == pytest.approx(want[step, token].item(), abs=1e-3)
        top2 = torch.topk(want[step], 2).indices.tolist()
        assert [t for t, lp in sorted(position.items(), key=lambda item: item[1].rank)][:2] == top2


def test_stop_strings_cut_the_text(llm):
    full = llm.generate("Hello world", SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))[0]
    text = full.outputs[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    assert len(text) > 6 and stop.strip(), text
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop])
    c = llm.generate("Hello world", params)[0].outputs[0]
    assert c.text == text[:text.index(stop)]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    kept = llm.generate("Hello world", params.replace(include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == text[:text.index(stop) + len(stop)]


def test_chat_renders_as_transformers_apply_chat_template(llm, chat_model):
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(str(chat_model))
    second = [{"role": "user", "content": "naïve café ✓"}]
    outs = llm.chat([CHAT, second], GREEDY)
    for out, conversation in zip(outs, [CHAT, second]):
        want = ref.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True)
        want = want["input_ids"] if isinstance(want, dict) or hasattr(want, "keys") else want
        assert out.prompt_token_ids == list(want)
        assert out.prompt == ref.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
        assert len(out.outputs[0].token_ids) == 6
    # One conversation alone is the same request; a greedy reply does not depend on the batch.
    single = llm.chat(CHAT, GREEDY)
    assert len(single) == 1 and single[0].outputs[0].token_ids == outs[0].outputs[0].token_ids
    without = llm.chat(CHAT, GREEDY, add_generation_prompt=False)[0]
    assert not without.prompt.endswith("<|im_start|>assistant\n") and outs[0].prompt.endswith("assistant\n")
    opened = [*CHAT, {"role": "assistant", "content": "Hi"}]
    going_on = llm.chat(opened, GREEDY, add_generation_prompt=False, continue_final_message=True)[0]
    assert going_on.prompt.endswith("<|im_start|>assistant\nHi")


def test_chat_template_override_and_errors(llm, tiny):
    out = llm.chat(CHAT, GREEDY, chat_template="{% for m in messages %}{{ m['content'] }}|{% endfor %}")[0]
    assert out.prompt == "Be brief.|Hello world, hello tokenizer!|"
    with pytest.raises(RequestError, match="conversation 1: .*role"):
        llm.chat([CHAT, [{"content": "no role"}]], GREEDY)
    with pytest.raises(RequestError, match="no chat template"):
        tiny.chat(CHAT, GREEDY)
    assert not llm.engine.has_unfinished_requests() and not tiny.engine.has_unfinished_requests()


def test_default_sampling_params_come_from_generation_config(llm, tiny):
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_p, defaults.top_k, defaults.max_tokens) == (0.6, 0.9, 20, 5)
    assert tiny.get_default_sampling_params() == SamplingParams()
    c = llm.generate("Hello", None)[0].outputs[0]  # no parameters: the model's
    assert len(c.token_ids) <= 5 and (c.finish_reason == "stop" or len(c.token_ids) == 5)


def test_a_failed_request_keeps_its_error_and_the_others_finish(tiny, monkeypatch):
    real_decode = tiny.tokenizer.decode
    calls = {"n": 0}

    def flaky(ids, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise ValueError("cannot decode")
        return real_decode(ids, *args, **kwargs)

    monkeypatch.setattr(tiny.tokenizer, "decode", flaky)
    outs = tiny.generate(["fine", "odd"], GREEDY)
    reasons = sorted(o.outputs[0].finish_reason for o in outs)
    assert reasons == ["error", "length"]
    failed = next(o.outputs[0] for o in outs if o.outputs[0].finish_reason == "error")
    assert "cannot decode" in failed.error and outs[0].finished and outs[1].finished
    assert not tiny.engine.has_unfinished_requests()


def test_bad_input_raises_before_any_work(tiny):
    with pytest.raises(RequestError, match="prompt 1: "):
        tiny.generate(["fine", []], GREEDY)
    with pytest.raises(RequestError, match="prompt 0: a prompt dict"):
        tiny.generate({"text": "x"}, GREEDY)
    with pytest.raises(RequestError, match="2 entries for 1 prompt"):
        tiny.generate("x", [GREEDY, GREEDY])
    with pytest.raises(RequestError, match="temperature"):
        SamplingParams(temperature=math.nan)
    assert not tiny.engine.has_unfinished_requests()
