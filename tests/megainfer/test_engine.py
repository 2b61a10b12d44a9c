"""Engine behaviour: the step interface, bad requests failing alone, aborts, accounting."""

from __future__ import annotations

import pytest
import torch

from megainfer import Engine, LLM, SamplingParams
from megainfer.errors import ConfigError, RequestError

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine():
    return Engine("tiny-mixtral", num_kv_blocks=64, block_size=16)


def drain(engine: Engine) -> dict[str, list]:
    deltas: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for d in engine.step():
            deltas.setdefault(d.request_id, []).append(d)
    return deltas


def test_step_streams_one_delta_per_token(engine):
    engine.add_request("s1", "hello", GREEDY)
    deltas = drain(engine)["s1"]
    assert [len(d.new_token_ids) for d in deltas] == [1] * 8
    assert [d.finished for d in deltas] == [False] * 7 + [True]
    assert deltas[-1].finish_reason == "length"


@pytest.mark.parametrize("prompt, params, match", [
    ("x" * 5000, GREEDY, "prompt has 5001 tokens; the model's max length is 4096"),
    ([], GREEDY, "prompt is empty"),
    ([1, -2], GREEDY, "token ids must be integers"),
    (3.5, GREEDY, "prompt must be a string or a list of token ids"),
    ("hi", SamplingParams(max_tokens=2000), "needs 126 KV blocks"),
])
def test_bad_request_fails_alone(engine, prompt, params, match):
    engine.add_request("good", "a good prompt", GREEDY)
    with pytest.raises(RequestError, match=match):
        engine.add_request("bad", prompt, params)
    deltas = drain(engine)
    assert set(deltas) == {"good"} and deltas["good"][-1].finish_reason == "length"
    assert engine.stats().kv_cache_usage == 0.0


def test_duplicate_request_id_is_rejected(engine):
    engine.add_request("dup", "one", GREEDY)
    with pytest.raises(RequestError, match="already in use"):
        engine.add_request("dup", "two", GREEDY)
    drain(engine)


def test_abort_frees_blocks_and_others_continue(engine):
    engine.add_request("keep", "keep me", GREEDY)
    engine.add_request("drop", "drop me", GREEDY)
    engine.step()
    assert engine.stats().kv_cache_usage > 0
    assert engine.abort("drop")
    assert not engine.abort("drop")
    deltas = drain(engine)
    assert "drop" not in deltas and deltas["keep"][-1].finished
    assert engine.stats().kv_cache_usage == 0.0


def test_failed_step_fails_its_requests_and_engine_serves_on(engine, monkeypatch):
    engine.add_request("victim", "boom", GREEDY)
    original = engine.runner.execute

    def broken(out):
        raise RuntimeError("injected")

    monkeypatch.setattr(engine.runner, "execute", broken)
    deltas = engine.step()
    assert [(d.request_id, d.finish_reason) for d in deltas] == [("victim", "error")]
    assert "injected" in deltas[0].error and deltas[0].error_code == "internal"
    assert engine.stats().kv_cache_usage == 0.0
    monkeypatch.setattr(engine.runner, "execute", original)
    engine.add_request("after", "still serving", GREEDY)
    assert drain(engine)["after"][-1].finish_reason == "length"


def test_undecodable_token_fails_only_its_request(engine, monkeypatch):
    engine.add_request("ok", "fine", GREEDY)
    engine.add_request("weird", "odd", GREEDY)
    real_decode = engine.tokenizer.decode
    calls = {"n": 0}

    def flaky(ids, **options):
        calls["n"] += 1
        if calls["n"] == 3:
            raise ValueError("cannot decode")
        return real_decode(ids, **options)

    monkeypatch.setattr(engine.tokenizer, "decode", flaky)
    deltas = drain(engine)
    reasons = {rid: ds[-1].finish_reason for rid, ds in deltas.items()}
    assert sorted(reasons.values()) == ["error", "length"]
    assert engine.stats().kv_cache_usage == 0.0


def test_shape_only_preset_is_a_clear_error():
    with pytest.raises(ConfigError, match="shape-only.*checkpoint directory"):
        Engine("mixtral-8x22b")


def test_unknown_preset_is_a_clear_error():
    with pytest.raises(ConfigError, match="neither a checkpoint directory.* nor a preset"):
        Engine("mixtral-8x9b")


def test_expert_accounting_matches_transformers_routing(mixtral_ref):
    """One prefill step: the experts activated per layer are those transformers' routers pick,
    and the bytes read are (activated experts) x (bytes of one expert)."""
    from transformers import AutoModelForCausalLM

    prompt = mixtral_ref.prompts[2]
    hf = AutoModelForCausalLM.from_pretrained(mixtral_ref.path, dtype=torch.float32).eval()
    with torch.inference_mode():
        router_logits = hf(torch.tensor([prompt]), output_router_logits=True).router_logits
    expected = [sorted(set(torch.topk(l.float().softmax(-1), 2, dim=-1).indices.flatten().tolist()))
                for l in router_logits]
    engine = Engine(str(mixtral_ref.path))
    engine.add_request("r", prompt, SamplingParams(max_tokens=1, temperature=0.0))
    engine.step()
    stats = engine.stats()
    assert stats.last_step_expert_load.activated == expected
    bytes_per_expert = 3 * 64 * 96 * 4  # gate, up, down of hidden 64 x intermediate 96, float32
    assert stats.expert_bytes_read == sum(map(len, expected)) * bytes_per_expert
    assert [sum(row) for row in stats.expert_tokens] == [2 * len(prompt)] * 3  # top-2 per token


def test_llm_generate_bad_prompt_names_index_and_runs_nothing():
    llm = LLM("tiny-mixtral", num_kv_blocks=64)
    with pytest.raises(RequestError, match="prompt 1: "):
        llm.generate(["fine", []], GREEDY)
    assert not llm.engine.has_unfinished_requests()
    outs = llm.generate(["fine", [1, 2, 3]], GREEDY)
    assert [o.prompt for o in outs] == ["fine", None]
    assert all(len(o.outputs[0].token_ids) == 8 and o.metrics.ttft_s is not None for o in outs)


def test_stop_token_and_eos(engine):
    first = LLM("tiny-mixtral", num_kv_blocks=64).generate("abc", GREEDY)[0].outputs[0].token_ids
    engine.add_request("stop", "abc", SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=[first[2]]))
    deltas = drain(engine)["stop"]
    assert deltas[-1].finish_reason == "stop"
    assert [t for d in deltas for t in d.new_token_ids] == first[:first.index(first[2]) + 1]


def test_per_request_tbt_and_energy_reported_unavailable_on_cpu():
    llm = LLM("tiny-mixtral", num_kv_blocks=64)
    out = llm.generate("timing", SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0]
    assert out.metrics.ttft_s > 0 and len(out.metrics.tbt_s) == 5 and all(t > 0 for t in out.metrics.tbt_s)
    stats = llm.engine.stats()
    assert stats.energy_j is None and stats.energy_per_token_j is None  # unavailable, not zero
    assert "no GPU" in stats.energy_unavailable
