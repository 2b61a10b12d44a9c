"""Every SamplingParams field through the engine, as vLLM honours it: logprobs and prompt
logprobs equal to transformers' (colocated, chunked, layered, preempted, disaggregated), stop
strings with hold-back, stop tokens, min_tokens, seeds with penalties, and the request metrics."""

from __future__ import annotations

import threading

import pytest
import torch

from megainfer.expert_replicas import ExpertReplicas
from megainfer import Engine, SamplingParams
from megainfer.engine.output_stream import OutputStream
from megainfer.engine_config import EngineConfig
from megainfer.errors import RequestError
from megainfer.messages import FinishReason
from megainfer.scheduling.sequence import Sequence, SequenceStatus
from megainfer.tokenizer import ByteTokenizer

TINY = dict(num_kv_blocks=64, block_size=16)


@pytest.fixture(scope="module")
def engine():
    return Engine("tiny-mixtral", **TINY)


def run(engine, requests: dict[str, tuple], after_step=None) -> dict[str, list]:
    """Each request's deltas, the engine stepped until all are done; `after_step(deltas)` sees each step's."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    deltas: dict[str, list] = {rid: [] for rid in requests}
    while engine.has_unfinished_requests():
        step = engine.step()
        for d in step:
            deltas[d.request_id].append(d)
        if after_step is not None:
            after_step(step)
    return deltas


def text(deltas) -> str:
    return "".join(d.new_text for d in deltas)


def tokens(deltas) -> list[int]:
    return [t for d in deltas for t in d.new_token_ids]


@pytest.fixture(scope="module")
def hello(engine):
    """Greedy 'hello' on tiny-mixtral, whose byte tokens are one character each here."""
    out = run(engine, {"ref": ("hello", SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))})["ref"]
    ids = tokens(out)
    assert all(t < 128 for t in ids), "the reference continuation should be ASCII bytes"
    return ids, text(out)


# -- stop strings and stop tokens ------------------------------------------------------------

def test_stop_string_spanning_tokens_truncates_holds_back_and_frees_blocks(engine, hello):
    ids, full = hello
    stop = full[2:4]  # completed by the 4th token, begun by the 3rd
    cut = full.find(stop)
    usage_when_finished = []

    def watch(step):
        if any(d.finished for d in step):
            usage_when_finished.append((engine.stats().kv_cache_usage, engine.has_unfinished_requests()))

    deltas = run(engine, {"s": ("hello", SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                                         stop=["never-there", stop]))}, watch)["s"]
    assert text(deltas) == full[:cut]
    assert tokens(deltas) == ids[:cut + len(stop)]  # it ends on the token completing the stop string
    last = deltas[-1]
    assert (last.finish_reason, last.stop_reason) == (FinishReason.STOP, stop)
    assert usage_when_finished == [(0.0, False)]  # blocks freed by the step that found it
    # Hold-back: nothing shown is later cut, and the stop string's first character was held back.
    shown = ""
    for d in deltas:
        shown += d.new_text
        assert full[:cut].startswith(shown)
    assert text(deltas[:cut + 1]) == full[:cut]


def test_include_stop_str_in_output(engine, hello):
    _, full = hello
    stop = full[2:4]
    deltas = run(engine, {"s": ("hello", SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop=[stop],
                                                         include_stop_str_in_output=True))})["s"]
    assert text(deltas) == full[:full.find(stop) + len(stop)] and deltas[-1].stop_reason == stop


def test_held_text_is_flushed_when_no_stop_string_completes(engine, hello):
    _, full = hello
    almost = full[-2:] + "\x00"  # the text ends with its first two characters: held to the very end
    deltas = run(engine, {"s": ("hello", SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                                         stop=[almost]))})["s"]
    assert text(deltas) == full and deltas[-1].finish_reason == FinishReason.LENGTH
    assert deltas[-1].stop_reason is None and deltas[-1].new_text.endswith(full[-2:])


def test_min_tokens_postpones_stop_strings(engine, hello):
    _, full = hello
    stop = full[2:4]
    assert full.count(stop) == 1
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop=[stop], min_tokens=4)
    deltas = run(engine, {"s": ("hello", params)})["s"]
    assert text(deltas) == full and deltas[-1].finish_reason == FinishReason.LENGTH


@pytest.mark.parametrize("include", [False, True])
def test_stop_token_names_itself_and_leaves_the_text(engine, hello, include):
    ids, full = hello
    params = SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[ids[3]], include_stop_str_in_output=include)
    deltas = run(engine, {"s": ("hello", params)})["s"]
    first = ids.index(ids[3])
    assert tokens(deltas) == ids[:first + 1]
    assert (deltas[-1].finish_reason, deltas[-1].stop_reason) == (FinishReason.STOP, ids[3])
    assert text(deltas) == full[:first + include]


def test_min_tokens_masks_stop_tokens(engine, hello):
    ids, _ = hello
    params = SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[ids[0]], min_tokens=3)
    out = tokens(run(engine, {"s": ("hello", params)})["s"])
    assert ids[0] not in out[:3] and len(out) > 3
    assert ids[0] not in out[:-1]  # after min_tokens the stop token still ends it


def test_engine_refuses_n_above_one(engine):
    with pytest.raises(RequestError, match=r"n=3.*for_choice"):
        engine.add_request("n", "hi", SamplingParams(n=3))
    assert not engine.has_unfinished_requests()


# -- seeds, penalties, metrics ---------------------------------------------------------------------

def test_seeded_penalised_request_is_unchanged_by_its_batch(engine):
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=11, repetition_penalty=1.4, frequency_penalty=0.5,
                            presence_penalty=0.3, min_p=0.01, top_k=50)
    alone = tokens(run(engine, {"r": ("batch me", params)})["r"])
    others = {f"o{i}": (f"other {i}", SamplingParams(max_tokens=6, temperature=0.9, frequency_penalty=1.0))
              for i in range(3)}
    together = run(engine, {"o0": others["o0"], "r": ("batch me", params), "o1": others["o1"], "o2": others["o2"]})
    assert tokens(together["r"]) == alone


def test_penalties_change_greedy_tokens(engine, hello):
    ids, _ = hello
    out = tokens(run(engine, {"p": ("hello", SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                                             frequency_penalty=2.0))})["p"])
    assert len(set(out)) > len(set(ids))  # the reference repeats itself; penalised, it may not


def test_metrics_on_the_last_delta_only(engine):
    deltas = run(engine, {"m": ("metrics", SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))})["m"]
    assert all(d.metrics is None for d in deltas[:-1])
    m = deltas[-1].metrics
    assert (m.prompt_tokens, m.generation_tokens, m.num_preemptions) == (len("metrics") + 1, 5, 0)
    assert m.queued_s >= 0 and m.prefill_s > 0 and m.decode_s > 0
    # The rest of e2e is from the last token's time to the delta made from it: never negative,
    # and short (bounded loosely: a busy machine may pause this thread between the two).
    assert -1e-9 <= m.e2e_s - (m.queued_s + m.prefill_s + m.decode_s) < 0.5  # (-1e-9: the sum's rounding)


def test_metrics_count_preemptions():
    small = Engine("tiny-mixtral", num_kv_blocks=6, block_size=4)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    deltas = run(small, {f"r{i}": ("abcdefg", params) for i in range(2)})
    counts = [ds[-1].metrics.num_preemptions for ds in deltas.values()]
    assert sum(counts) == small.stats().num_preemptions > 0


# -- logprobs against transformers -------------------------------------------------------------

@pytest.fixture(scope="module")
def hf_prompt_logprobs(hf_ref):
    """transformers' log-softmax over each reference prompt: [prompt length, vocab]."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_ref.path, dtype=torch.float32).eval()
    with torch.inference_mode():
        return [torch.log_softmax(model(torch.tensor([p])).logits[0].float(), -1) for p in hf_ref.prompts]


def check_prompt_logprobs(got, prompt, reference, k):
    assert len(got) == len(prompt) and got[0] is None
    for position in range(1, len(prompt)):
        entry, expected = got[position], reference[position - 1]
        token = prompt[position]
        assert list(entry)[0] == token
        assert entry[token].logprob == pytest.approx(float(expected[token]), abs=1e-4)
        assert entry[token].rank == int((expected > expected[token]).sum()) + 1
        assert len(entry) in (k, k + 1)  # the prompt token, then the top k (where it may be already)
        assert sorted((lp.logprob for lp in entry.values()), reverse=True)[:k] == pytest.approx(
            expected.topk(k).values.tolist(), abs=1e-4)


def check_token_logprobs(deltas, reference_logits, k):
    reference = torch.log_softmax(reference_logits, -1)
    for step, d in enumerate(deltas):
        (entry,) = d.logprobs
        token = d.new_token_ids[0]
        assert list(entry)[0] == token and entry[token].rank == 1  # greedy: the likeliest
        assert entry[token].logprob == pytest.approx(float(reference[step, token]), abs=1e-4)
        assert len(entry) == k  # the sampled token is the top-1, listed once
        values = [lp.logprob for lp in entry.values()]
        assert values == pytest.approx(reference[step].topk(k).values.tolist(), abs=1e-4)
        assert [lp.rank for lp in entry.values()] == list(range(1, k + 1))


PREFILL = {
    "whole-prompts": {},
    "chunked-and-preempted": dict(max_num_batched_tokens=8, num_kv_blocks=16, block_size=4),
    "layered-in-chunks": dict(prefill_policy="layered", group_tokens=8, layered_chunk_tokens=20),
}
DECODED = 12  # tokens generated per reference prompt (of the NEW_TOKENS transformers generated)


@pytest.mark.parametrize("name", PREFILL)
def test_logprobs_and_prompt_logprobs_match_transformers(hf_ref, hf_prompt_logprobs, name):
    engine = Engine(str(hf_ref.path), dtype="float32", **{**TINY, **PREFILL[name]})
    params = SamplingParams(max_tokens=DECODED, temperature=0.0, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    deltas = run(engine, {f"r{i}": (p, params) for i, p in enumerate(hf_ref.prompts)})
    if "preempted" in name:
        assert engine.stats().num_preemptions > 0
    if name != "whole-prompts":
        assert engine.stats().num_steps > DECODED  # prompts took several steps (or layer groups)
    for i, prompt in enumerate(hf_ref.prompts):
        ds = deltas[f"r{i}"]
        assert tokens(ds) == hf_ref.tokens[i][:DECODED]
        check_token_logprobs(ds, hf_ref.logits[i][:DECODED], 3)
        check_prompt_logprobs(ds[0].prompt_logprobs, prompt, hf_prompt_logprobs[i], 2)
        assert all(d.prompt_logprobs is None for d in ds[1:])
    assert engine.stats().kv_cache_usage == 0.0


def test_logprobs_carry_token_text(engine):
    deltas = run(engine, {"t": ("hi", SamplingParams(max_tokens=3, temperature=0.0, logprobs=1, prompt_logprobs=0))})
    first = deltas["t"][0]
    assert first.prompt_logprobs[1][ord("h")].decoded_token == "h"
    assert all(lp.decoded_token is not None for d in deltas["t"] for lp in d.logprobs[0].values())


def test_requests_without_logprobs_get_none(engine):
    deltas = run(engine, {"plain": ("plain", SamplingParams(max_tokens=2, temperature=0.0))})["plain"]
    assert all(d.logprobs is None and d.prompt_logprobs is None for d in deltas)


# -- the disaggregated attention node ----------------------------------------------------------

def run_pair(path, m, requests, **engine_options):
    """One attention node and one expert node in threads over shm; each request's deltas."""
    from deploy.link import SwitchableLink
    from megainfer.disagg.expert_link import dispatch_bytes
    from megainfer.disagg.expert_worker import ExpertWorker
    from megainfer.disagg.pipelined_runner import PipelinedModelRunner
    from megainfer.model.weights import SafetensorsCheckpoint
    from tests.helpers import connect_all

    config = EngineConfig(**{**dict(dtype="float32", num_kv_blocks=64, block_size=8, max_num_batched_tokens=64),
                             **engine_options})
    model_config = Engine(str(path), config).model_config
    experts = [list(range(model_config.num_experts))]
    tokens_per_step, hidden, top_k = config.max_num_batched_tokens, model_config.hidden_size, model_config.top_k
    links = {"attn": SwitchableLink("attn", 0, b"s" * 32, "127.0.0.1", tokens_per_step * hidden * 4, m, "shm", 30),
             "expert": SwitchableLink("expert", 100, b"s" * 32, "127.0.0.1",
                                      dispatch_bytes(tokens_per_step, hidden, top_k, torch.float32), m, "shm", 30)}
    for link in links.values():
        link.open()
    endpoints = {name: link.endpoint for name, link in links.items()}
    connect_all(endpoints, {"attn": ["expert"], "expert": ["attn"]})
    worker = ExpertWorker(model_config, experts[0], "float32", "cpu", SafetensorsCheckpoint(path),
                          attention_nodes=["attn"], micro_batches=m, link=links["expert"])

    def factory(mc, cfg, weights, max_len):
        return PipelinedModelRunner(mc, cfg, weights, max_len, link=links["attn"], expert_nodes=["expert"],
                                    replicas=ExpertReplicas.of_assignment(experts, mc.num_layers), micro_batches=m)

    engine = Engine(str(path), config, runner_factory=factory)
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    deltas = {rid: [] for rid in requests}
    errors, steps = [], 400
    done = threading.Event()

    def attention_loop():
        try:
            for _ in range(steps):  # every node runs the same number of steps: the protocol's lockstep
                for d in engine.step():
                    deltas[d.request_id].append(d)
            done.set()
        except BaseException as exc:
            errors.append(exc)

    def expert_loop():
        try:
            for _ in range(steps):
                worker.run_step()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=attention_loop), threading.Thread(target=expert_loop)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    for endpoint in endpoints.values():
        endpoint.close()
    assert not errors, errors
    assert not engine.has_unfinished_requests()
    return deltas


@pytest.mark.parametrize("options", [dict(max_num_batched_tokens=16), dict(prefill_policy="layered", group_tokens=8)],
                         ids=["chunked", "layered"])
def test_disaggregated_node_gives_the_colocated_logprobs(mixtral_ref, options):
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    requests = {f"r{i}": (p, params) for i, p in enumerate(mixtral_ref.prompts)}
    expected = run(Engine(str(mixtral_ref.path), dtype="float32", **TINY), requests)
    got = run_pair(mixtral_ref.path, 2, requests, **options)
    for rid in requests:
        assert tokens(got[rid]) == tokens(expected[rid])
        for ours, theirs in zip(got[rid], expected[rid]):
            assert list(ours.logprobs[0]) == list(theirs.logprobs[0])
            assert [lp.logprob for lp in ours.logprobs[0].values()] == pytest.approx(
                [lp.logprob for lp in theirs.logprobs[0].values()], abs=1e-4)
        ours, theirs = got[rid][0].prompt_logprobs, expected[rid][0].prompt_logprobs
        assert [e and list(e) for e in ours] == [e and list(e) for e in theirs]
        for a, b in zip(ours[1:], theirs[1:]):
            assert [lp.logprob for lp in a.values()] == pytest.approx([lp.logprob for lp in b.values()], abs=1e-4)


@pytest.mark.parametrize("m", [1, 2])
def test_a_node_scheduling_ahead_gives_the_colocated_outputs(mixtral_ref, m, monkeypatch):
    """Asynchronous scheduling on an attention node (each step scheduled while the one before
    ran, settled inside the next): seeded sampling with logprobs, stop strings, EOS and short
    max_tokens end as on the colocated engine, token for token and character for character;
    a request with penalties sends its steps back to scheduling after them."""
    prompts = mixtral_ref.prompts
    kinds = [SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=7, logprobs=1),
             SamplingParams(max_tokens=3, temperature=0.0),
             SamplingParams(max_tokens=12, temperature=0.0, stop=["e", "a"]),
             SamplingParams(max_tokens=2, temperature=1.0, seed=3, repetition_penalty=1.3)]
    requests = {f"r{i}": (p, kinds[i % len(kinds)]) for i, p in enumerate(prompts * 2)}
    expected = run(Engine(str(mixtral_ref.path), dtype="float32", **TINY), requests)
    from megainfer.scheduling.scheduler import Scheduler

    ahead, advance_ahead = [], Scheduler.advance_ahead
    monkeypatch.setattr(Scheduler, "advance_ahead", lambda self, out: ahead.append(out) or advance_ahead(self, out))
    got = run_pair(mixtral_ref.path, m, requests, async_scheduling=True)
    assert len(ahead) >= 5  # most decode steps were scheduled ahead
    for rid in requests:
        assert tokens(got[rid]) == tokens(expected[rid]), rid
        assert text(got[rid]) == text(expected[rid]), rid
        assert (got[rid][-1].finish_reason, got[rid][-1].stop_reason) == \
            (expected[rid][-1].finish_reason, expected[rid][-1].stop_reason), rid
        for ours, theirs in zip(got[rid], expected[rid]):
            assert (ours.logprobs is None) == (theirs.logprobs is None)
            if ours.logprobs:
                assert list(ours.logprobs[0]) == list(theirs.logprobs[0])


# -- special tokens in the text --------------------------------------------------------------------

def stream_text(params, generated, finish=None):
    """The text an OutputStream shows for `generated` after the prompt 'h' (byte tokens)."""
    seq = Sequence("x", [ByteTokenizer.BOS, ord("h")], params)
    stream = OutputStream(ByteTokenizer(258), seq)
    shown = ""
    for i, token in enumerate(generated):
        seq.token_ids.append(token)
        if finish is not None and i == len(generated) - 1:
            seq.status, seq.finish_reason = SequenceStatus.FINISHED, finish
        shown += stream.next_text(seq)
    return shown


def test_skip_special_tokens_reaches_the_detokenizer():
    generated = [ord("h"), ByteTokenizer.BOS, ord("i")]
    assert stream_text(SamplingParams(skip_special_tokens=False), generated) == "h<s>i"
    assert stream_text(SamplingParams(), generated) == "hi"


def test_a_stop_token_is_no_text_unless_stops_are_included():
    generated = [ord("h"), ByteTokenizer.EOS]
    assert stream_text(SamplingParams(skip_special_tokens=False), generated, FinishReason.STOP) == "h"
    included = SamplingParams(skip_special_tokens=False, include_stop_str_in_output=True)
    assert stream_text(included, generated, FinishReason.STOP) == "h</s>"
