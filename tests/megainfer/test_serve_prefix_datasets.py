"""`megainfer bench serve` for automatic prefix caching: vLLM's prefix_repetition dataset, the
multi-turn conversation replay, and --compare-prefix-caching's two runs (salted, then not) against
an in-process stub of an OpenAI-compatible server that records every request body."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from megainfer.tools.bench import serve_bench
from megainfer.tools.bench.serve_bench import ServeBenchConfig
from megainfer.tools.bench.serve_datasets import DatasetSpec, sample_requests
from megainfer.tools.bench.serve_requests import RequestOutput
from megainfer.errors import ConfigError
from megainfer.tokenizer import ByteTokenizer
from tests.helpers import megainfer

TOK = ByteTokenizer(320)  # the tokenizer of the tiny-mixtral preset, the stub runs' --tokenizer
SPECIAL = {TOK.bos_token_id, *TOK.eos_token_ids}


def prefix_spec(**overrides) -> DatasetSpec:
    fields = dict(name="prefix_repetition", num_prompts=12, seed=3, prefix_repetition_prefix_len=16,
                  prefix_repetition_suffix_len=5, prefix_repetition_num_prefixes=3, prefix_repetition_output_len=7,
                  request_id_prefix="p-")
    return DatasetSpec(**{**fields, **overrides})


def test_prefix_repetition_shares_identical_token_prefixes_with_distinct_suffixes():
    requests = sample_requests(prefix_spec(), TOK)
    assert len(requests) == 12 and [r.request_id for r in requests] == [f"p-{i}" for i in range(12)]
    groups: dict[tuple[int, ...], list[tuple[int, ...]]] = {}
    for r in requests:
        ids = r.prompt_token_ids
        assert len(ids) == r.prompt_len == 21 and r.expected_output_len == 7 and r.arrival_s is None
        assert not SPECIAL & set(ids) and all(0 <= i < TOK.vocab_size for i in ids)
        assert r.prompt == TOK.decode(list(ids))
        groups.setdefault(ids[:16], []).append(ids[16:])
    # Three prefixes, each the first 16 ids of four requests; every suffix differs from every other.
    assert len(groups) == 3 and sorted(len(s) for s in groups.values()) == [4, 4, 4]
    suffixes = [s for group in groups.values() for s in group]
    assert len(set(suffixes)) == 12
    # Shuffled: the requests of one prefix are not sent back to back.
    order = [next(i for i, p in enumerate(groups) if r.prompt_token_ids[:16] == p) for r in requests]
    assert order != sorted(order)
    # The seed fixes everything; another seed draws other prompts.
    assert sample_requests(prefix_spec(), TOK) == requests
    other = sample_requests(prefix_spec(seed=4), TOK)
    assert {r.prompt_token_ids for r in other}.isdisjoint({r.prompt_token_ids for r in requests})


@pytest.mark.parametrize("overrides, message", [
    ({"num_prompts": 10}, "--num-prompts 10 must be a multiple of --prefix-repetition-num-prefixes 3 .* "
                          "pass --num-prompts 9 or 12"),
    ({"num_prompts": 2}, "--num-prompts 2 must be a multiple .* pass --num-prompts 3,"),
    ({"prefix_repetition_suffix_len": 0}, "--prefix-repetition-suffix-len must be positive, got 0"),
    ({"prefix_repetition_num_prefixes": -1}, "--prefix-repetition-num-prefixes must be positive"),
    ({"prefix_repetition_output_len": 0}, "--prefix-repetition-output-len must be positive"),
    ({"path": "x.json"}, "--dataset-name prefix_repetition takes no --dataset-path"),
    ({"num_prompts": None}, "--dataset-name prefix_repetition needs --num-prompts"),
])
def test_prefix_repetition_refuses_bad_values_naming_the_flag(overrides, message):
    with pytest.raises(ConfigError, match=message):
        prefix_spec(**overrides)


def test_prefix_repetition_refuses_suffixes_too_short_to_differ():
    # 318 non-special ids: 636 requests cannot each get their own one-token suffix.
    spec = prefix_spec(num_prompts=636, prefix_repetition_suffix_len=1, prefix_repetition_num_prefixes=2)
    with pytest.raises(ConfigError, match="--prefix-repetition-suffix-len 1: only 318\\^1 distinct runs"):
        sample_requests(spec, TOK)
    fits = prefix_spec(num_prompts=318, prefix_repetition_suffix_len=1, prefix_repetition_num_prefixes=2)
    assert len({r.prompt_token_ids for r in sample_requests(fits, TOK)}) == 318


def conversation_spec(**overrides) -> DatasetSpec:
    fields = dict(name="conversation", num_prompts=None, seed=1, conversation_num=3, conversation_turns=4,
                  conversation_input_len=6, conversation_output_len=5, request_id_prefix="c-")
    return DatasetSpec(**{**fields, **overrides})


def check_histories(requests) -> dict[int, list]:
    """Each conversation's turns in order; each turn's messages are the previous turn's, its recorded
    reply, and the new user turn."""
    by_conversation: dict[int, list] = {}
    for r in requests:
        by_conversation.setdefault(r.conversation, []).append(r)
    for turns in by_conversation.values():
        assert [t.turn for t in turns] == list(range(len(turns)))
        for k, t in enumerate(turns):
            assert [role for role, _ in t.messages] == ["user", "assistant"] * k + ["user"]
            assert t.messages[-1] == ("user", t.prompt)
            assert t.request_id == f"c-{t.conversation}-{k}"
            if k:
                assert t.messages[:-2] == turns[k - 1].messages
            text = "".join(content for _, content in t.messages)
            assert t.prompt_len == len(TOK.encode(text, add_special_tokens=False))
    return by_conversation


def test_generated_conversations_come_turn_major_with_the_conversation_so_far():
    requests = sample_requests(conversation_spec(), TOK, max_model_len=4096)
    assert len(requests) == 12
    # Turn-major: every conversation's first turn, then every second turn, ...
    assert [(r.turn, r.conversation) for r in requests] == [(t, c) for t in range(4) for c in range(3)]
    by_conversation = check_histories(requests)
    assert all(r.expected_output_len == 5 for r in requests)
    replies = [t.messages[1][1] for t in (turns[1] for turns in by_conversation.values())]
    assert all(isinstance(reply, str) and reply for reply in replies)  # random text of about 5 tokens
    assert len({turns[0].prompt for turns in by_conversation.values()}) == 3  # the conversations differ
    assert sample_requests(conversation_spec(), TOK, max_model_len=4096) == requests
    assert sample_requests(conversation_spec(seed=2), TOK, max_model_len=4096) != requests
    # The context cuts a conversation before the first turn that would not fit (8 tokens per message
    # for the chat template): turn 2's 6 + 5 + 6 + 3 * 8 tokens and 5 out fit 46, turn 3's do not.
    short = sample_requests(conversation_spec(), TOK, max_model_len=46)
    assert [r.turn for r in short] == [0] * 3 + [1] * 3
    with pytest.raises(ConfigError, match="a first turn does not fit the model's context of 10 tokens"):
        sample_requests(conversation_spec(), TOK, max_model_len=10)


def exchange(user: str, reply: str) -> list[dict]:
    return [{"from": "human", "value": user}, {"from": "gpt", "value": reply}]


@pytest.fixture()
def conversations_file(tmp_path):
    data = [
        {"conversations": exchange("first question", "first answer") + exchange("second one", "second answer")
         + exchange("third", "the third answer")},
        {"conversations": exchange("single turn", "is not multi-turn")},
        {"conversations": [{"from": "gpt", "value": "a greeting first"}] + exchange("hello", "hi there")
         + exchange("how are you", "well") + [{"from": "gpt", "value": "a break"}] + exchange("lost", "lost")},
        {"conversations": exchange("one", "two") + [{"from": "human", "value": ""}, {"from": "gpt", "value": "x"}]},
        {"no_conversations": []},
    ]
    path = tmp_path / "conversations.json"
    path.write_text(json.dumps(data))
    return str(path)


def test_sharegpt_conversations_replay_their_recorded_replies(conversations_file):
    spec = conversation_spec(path=conversations_file, conversation_num=2, conversation_turns=None,
                             conversation_output_len=None)
    requests = sample_requests(spec, TOK, max_model_len=4096)
    by_conversation = check_histories(requests)
    chats = sorted([[t.prompt for t in turns] for turns in by_conversation.values()])
    # The single exchange and the conversation whose second user turn is empty are not multi-turn;
    # the leading gpt turn is skipped and the break in the alternation ends a conversation.
    assert chats == [["first question", "second one", "third"], ["hello", "how are you"]]
    # Each turn asks for its recorded reply's tokens; later turns carry the replies in their history.
    replies = {"first question": ["first answer", "second answer", "the third answer"],
               "hello": ["hi there", "well"]}
    for turns in by_conversation.values():
        recorded = replies[turns[0].prompt]
        assert [t.expected_output_len for t in turns] == [len(reply) for reply in recorded]
        assert [content for role, content in turns[-1].messages if role == "assistant"] == recorded[:-1]
    capped = sample_requests(conversation_spec(path=conversations_file, conversation_num=2, conversation_turns=2,
                                               conversation_output_len=9), TOK, max_model_len=4096)
    assert sorted(r.turn for r in capped) == [0, 0, 1, 1] and all(r.expected_output_len == 9 for r in capped)
    with pytest.raises(ConfigError, match="--conversation-num 3: --dataset-path .* holds only 2 conversations"):
        sample_requests(conversation_spec(path=conversations_file, conversation_num=3), TOK, max_model_len=4096)


def test_conversation_options_are_checked():
    with pytest.raises(ConfigError, match="--num-prompts 5 does not apply to --dataset-name conversation"):
        conversation_spec(num_prompts=5)
    for flag, field in (("--conversation-num", "conversation_num"), ("--conversation-turns", "conversation_turns"),
                        ("--conversation-input-len", "conversation_input_len"),
                        ("--conversation-output-len", "conversation_output_len")):
        with pytest.raises(ConfigError, match=f"{flag} must be positive, got 0"):
            conversation_spec(**{field: 0})
    with pytest.raises(ConfigError, match="use --backend openai-chat, not openai"):
        ServeBenchConfig(backend="openai", dataset=conversation_spec())


@pytest.mark.parametrize("args, message", [
    (["--dataset-name", "conversation"], "use --backend openai-chat, not openai"),
    (["--dataset-name", "prefix_repetition", "--num-prompts", "15"], "pass --num-prompts 10 or 20"),
    (["--prefix-repetition-prefix-len", "0"], "argument --prefix-repetition-prefix-len: '0' must be positive"),
])
def test_cli_errors_are_one_line(args, message):
    res = megainfer("bench", "serve", "--port", "1", *args, timeout=120)
    assert res.returncode == 2 and message in res.stderr and "Traceback" not in res.stderr, res.stderr


def test_a_conversations_turns_wait_for_each_other_while_conversations_overlap(monkeypatch):
    spans: dict[str, tuple[float, float]] = {}
    bodies: dict[str, list] = {}

    async def record(inp, session):
        start = time.perf_counter()
        await asyncio.sleep(0.05)
        spans[inp.request_id] = (start, time.perf_counter())
        bodies[inp.request_id] = inp.messages
        return RequestOutput(success=True, output_tokens=inp.output_len, prompt_len=inp.prompt_len, ttft=0.01,
                             latency=0.05, start_time=start)

    monkeypatch.setitem(serve_bench.REQUEST_FUNCS, "openai-chat", record)
    config = ServeBenchConfig(backend="openai-chat", port=1, disable_tqdm=True, dataset=conversation_spec())
    requests = sample_requests(config.dataset, TOK, max_model_len=4096)
    outputs, _ = asyncio.run(serve_bench._send(config, requests, None, "m"))
    assert len(outputs) == 12 and all(o.success for o in outputs)
    for r in requests:
        assert bodies[r.request_id] == [{"role": role, "content": text} for role, text in r.messages]
        if r.turn:
            assert spans[r.request_id][0] >= spans[f"c-{r.conversation}-{r.turn - 1}"][1]
    # The conversations run side by side: every first turn starts before any of them ends.
    first_starts = [spans[f"c-{c}-0"][0] for c in range(3)]
    assert max(first_starts) < min(spans[f"c-{c}-0"][1] for c in range(3))


class StubHandler(BaseHTTPRequestHandler):
    """An OpenAI-compatible server in a few lines: /v1/models, /reset_prefix_cache (404 when the
    server's `reset_status` says so), and streamed completions and chat completions whose usage
    reports cached tokens: none for a salted request, all but the last token otherwise."""

    def log_message(self, *args):
        pass

    def do_GET(self):
        self._reply(200, {"object": "list", "data": [{"id": "stub-model", "root": "stub-model"}]})

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.server.posts.append((self.path, json.loads(body) if body else None))
        if self.path == "/reset_prefix_cache":
            return self._reply(self.server.reset_status, {})
        request = json.loads(body)
        prompt = request.get("prompt") or request.get("messages")
        prompt_tokens = len(prompt) if isinstance(prompt, list) else 1
        cached = 0 if "cache_salt" in request else prompt_tokens - 1
        key = "delta" if "messages" in request else "text"
        chunks = [{"choices": [{"index": 0, key: "x" if key == "text" else {"content": "x"}}]} for _ in range(2)]
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": 2, "total_tokens": prompt_tokens + 2,
                 "prompt_tokens_details": {"cached_tokens": cached}}
        events = [*chunks, {"choices": [], "usage": usage}]
        payload = b"".join(f"data: {json.dumps(e)}\n\n".encode() for e in events) + b"data: [DONE]\n\n"
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def _reply(self, status: int, payload: dict) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture()
def stub_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), StubHandler)
    server.posts, server.reset_status = [], 200
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def run_cli(server, capsys, tmp_path, *args: str) -> tuple[int, dict, str]:
    from megainfer.cli import main

    out = tmp_path / "out.json"
    rc = main(["bench", "serve", "--base-url", f"http://127.0.0.1:{server.server_address[1]}", "--tokenizer",
               "tiny-mixtral", "--compare-prefix-caching", "--disable-tqdm", "--seed", "5", "--json", str(out),
               *args])
    return rc, json.loads(out.read_text()) if out.exists() else {}, capsys.readouterr().out


def test_compare_prefix_caching_salts_the_first_run_and_resets_before_each(stub_server, capsys, tmp_path):
    rc, result, printed = run_cli(stub_server, capsys, tmp_path, "--dataset-name", "prefix_repetition",
                                  "--num-prompts", "6", "--prefix-repetition-num-prefixes", "2",
                                  "--prefix-repetition-prefix-len", "12", "--prefix-repetition-suffix-len", "4")
    assert rc == 0, printed
    paths = [path for path, _ in stub_server.posts]
    assert paths == ["/reset_prefix_cache"] + ["/v1/completions"] * 6 + ["/reset_prefix_cache"] + \
        ["/v1/completions"] * 6
    off = [body for _, body in stub_server.posts[1:7]]
    on = [body for _, body in stub_server.posts[8:]]
    # The same requests twice (token id prompts; sent at once, they arrive in any order), salted apart
    # only in the first run.
    assert sorted(b["prompt"] for b in off) == sorted(b["prompt"] for b in on)
    assert all(isinstance(b["prompt"], list) and len(b["prompt"]) == 16 for b in on)
    assert len({b["cache_salt"] for b in off}) == 6 and all("cache_salt" not in b for b in on)
    assert all(b["stream"] and b["stream_options"] == {"include_usage": True} and b["ignore_eos"] for b in off + on)
    assert len({tuple(b["prompt"][:12]) for b in on}) == 2
    # Both runs and the figures, as numbers.
    assert result["caching_off"]["completed"] == result["caching_on"]["completed"] == 6
    assert result["mean_cached_tokens_caching_off"] == 0 and result["mean_cached_tokens_caching_on"] == 15
    assert result["caching_on"]["cached_tokens"] == [15] * 6 and result["caching_off"]["mean_cached_tokens"] == 0
    ratio = result["mean_ttft_ratio_on_off"]
    assert isinstance(ratio, float) and ratio == pytest.approx(
        result["mean_ttft_ms_caching_on"] / result["mean_ttft_ms_caching_off"])
    assert result["compare_prefix_caching"] is True and result["model_id"] == "stub-model"
    assert printed.count(" Serving Benchmark Result ") == 2 and " Prefix Caching: On vs Off " in printed
    assert "{:<40} {:<10}".format("Mean cached prompt tokens, on:", "15.00") in printed
    assert "Note:" not in printed


def test_compare_prefix_caching_replays_conversations_and_tolerates_no_reset_route(stub_server, capsys, tmp_path):
    stub_server.reset_status = 404
    rc, result, printed = run_cli(stub_server, capsys, tmp_path, "--backend", "openai-chat", "--dataset-name",
                                  "conversation", "--conversation-num", "2", "--conversation-turns", "3",
                                  "--conversation-input-len", "5", "--conversation-output-len", "4")
    assert rc == 0, printed
    assert printed.count("reset_prefix_cache found no such route") == 1
    chats = [body for path, body in stub_server.posts if path == "/v1/chat/completions"]
    assert len(chats) == 12
    off, on = chats[:6], chats[6:]
    assert len({b["cache_salt"] for b in off}) == 6 and all("cache_salt" not in b for b in on)
    # Per conversation, turn k's messages hold turn k-1's and its recorded reply; the runs send the same.
    assert sorted(json.dumps(b["messages"]) for b in off) == sorted(json.dumps(b["messages"]) for b in on)
    for bodies in (off, on):
        firsts = [b["messages"] for b in bodies if len(b["messages"]) == 1]
        assert len(firsts) == 2
        for b in bodies:
            history = b["messages"][:-2]
            if history:
                assert any(other["messages"] == history for other in bodies)
    for name in ("caching_off", "caching_on"):
        turns = result[name]["per_turn"]
        assert [t["turn"] for t in turns] == [1, 2, 3] and all(t["completed"] == 2 for t in turns)
        assert all("mean_ttft_ms" in t and "p99_ttft_ms" in t for t in turns)
    assert " TTFT per Conversation Turn " in printed
    assert result["mean_cached_tokens_caching_off"] == 0 and result["mean_cached_tokens_caching_on"] > 0
