"""`megainfer bench serve`: vLLM's datasets, request timing, metrics, printed block and JSON,
against an in-process gRPC server and recorded OpenAI streams."""

from __future__ import annotations

import asyncio
import json
import socket

import httpx2
import pytest

from megainfer.tools.bench.serve_datasets import DatasetSpec, num_special_tokens, sample_random, sample_sharegpt
from megainfer.tools.bench.serve_metrics import (calculate_metrics, format_block, output_lengths, parse_goodput,
                                           result_fields, statistics_ms)
from megainfer.tools.bench.serve_requests import (RequestInput, RequestOutput, SSEDecoder, openai_chat,
                                            openai_completions)
from megainfer.errors import ConfigError
from megainfer.tokenizer import ByteTokenizer
from tests.helpers import megainfer


class AsciiTokenizer:
    """One token per ASCII character, BOS 128 prepended, EOS 129: every text round-trips."""

    vocab_size, bos_token_id, eos_token_ids = 130, 128, (129,)

    def encode(self, text, add_special_tokens=True):
        return ([128] if add_special_tokens else []) + [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids if i < 128)

    def token_text(self, token_id):
        return chr(token_id)


def conversation(prompt: str, answer: str, more: int = 0) -> dict:
    turns = [{"from": "human", "value": prompt}, {"from": "gpt", "value": answer}]
    return {"id": prompt[:8], "conversations": turns + [{"from": "human", "value": "and?"}] * more}


@pytest.fixture()
def sharegpt_file(tmp_path):
    good = [conversation(f"question number {i} " + "x" * i, "an answer " + "y" * (3 * i), more=i % 2)
            for i in range(12)]
    rejected = [
        {"conversations": [{"from": "human", "value": "one turn only"}]},
        {"no_conversations": []},
        conversation("hi", "a long enough answer"),  # prompt of 3 tokens (BOS + 2): under 4
        conversation("a fair question", "no"),  # answer of 3 tokens: under 4
        conversation("p" * 1100, "an answer"),  # prompt over 1024 tokens
        conversation("q" * 1000, "a" * 1100),  # prompt + answer over 2048
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(good + rejected))
    return path, good


def test_sharegpt_keeps_vllms_filter_counts_with_the_tokenizer_and_repeats_with_the_seed(sharegpt_file):
    path, good = sharegpt_file
    tok = ByteTokenizer(320)
    answers = {c["conversations"][0]["value"]: c["conversations"][1]["value"] for c in good}
    samples = sample_sharegpt(DatasetSpec("sharegpt", str(path), num_prompts=10, seed=3), tok)
    assert len(samples) == 10 and len({s.prompt for s in samples}) == 10
    for s in samples:  # only the valid conversations, lengths from the first two turns
        assert s.prompt in answers
        assert s.prompt_len == len(tok.encode(s.prompt)) and s.expected_output_len == len(tok.encode(answers[s.prompt]))
    again = sample_sharegpt(DatasetSpec("sharegpt", str(path), num_prompts=10, seed=3), tok)
    other = sample_sharegpt(DatasetSpec("sharegpt", str(path), num_prompts=10, seed=4), tok)
    assert again == samples and [s.prompt for s in other] != [s.prompt for s in samples]
    # More prompts than pass the filter: passing ones repeat, each request with its own id.
    many = sample_sharegpt(DatasetSpec("sharegpt", str(path), num_prompts=30, seed=3, request_id_prefix="r-"), tok)
    assert len(many) == 30 and {s.prompt for s in many} == set(answers)
    assert [s.request_id for s in many] == [f"r-{i}" for i in range(30)]
    # A fixed output length replaces the answers' and lets a short answer through.
    fixed = sample_sharegpt(DatasetSpec("sharegpt", str(path), num_prompts=100, seed=0, sharegpt_output_len=7), tok)
    assert {s.expected_output_len for s in fixed} == {7} and "a fair question" in {s.prompt for s in fixed}


def test_sharegpt_file_errors_name_the_flag_and_the_fix(tmp_path):
    with pytest.raises(ConfigError, match="--dataset-path.*ShareGPT_V3_unfiltered_cleaned_split.json"):
        DatasetSpec("sharegpt")
    with pytest.raises(ConfigError, match="no such file"):
        sample_sharegpt(DatasetSpec("sharegpt", str(tmp_path / "missing.json")), ByteTokenizer(320))
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not JSON"):
        sample_sharegpt(DatasetSpec("sharegpt", str(tmp_path / "bad.json")), ByteTokenizer(320))
    (tmp_path / "short.json").write_text(json.dumps([conversation("hi", "yo")]))
    with pytest.raises(ConfigError, match="length filter"):
        sample_sharegpt(DatasetSpec("sharegpt", str(tmp_path / "short.json")), ByteTokenizer(320))
    with pytest.raises(ConfigError, match="takes no --dataset-path"):
        DatasetSpec("random", str(tmp_path / "short.json"))


def test_random_dataset_lengths_follow_the_range_ratio_and_the_seed():
    tok = AsciiTokenizer()
    assert num_special_tokens(tok) == 1
    spec = DatasetSpec(num_prompts=300, random_input_len=101, random_output_len=20, random_range_ratio=0.5,
                       random_prefix_len=6, seed=7)
    samples = sample_random(spec, tok)
    ins = [s.prompt_len for s in samples]
    # The input range is around 100 (101 less the BOS the server adds), plus the shared prefix.
    assert min(ins) >= 6 + 50 and max(ins) <= 6 + 150 and len(set(ins)) > 50
    assert all(s.prompt_len == len(tok.encode(s.prompt, add_special_tokens=False)) for s in samples)
    assert all(10 <= s.expected_output_len <= 30 for s in samples)
    assert len({s.prompt[:6] for s in samples}) == 1 and len({s.prompt for s in samples}) > 250
    assert sample_random(spec, tok) == samples
    assert sample_random(DatasetSpec(**{**vars(spec), "seed": 8}), tok) != samples
    # Exact lengths without a range; a byte tokenizer's re-encoded text is what is counted.
    exact = sample_random(DatasetSpec(num_prompts=20, random_input_len=33, random_output_len=5), tok)
    assert {s.prompt_len for s in exact} == {32} and {s.expected_output_len for s in exact} == {5}
    byte = ByteTokenizer(320)
    assert all(s.prompt_len == len(byte.encode(s.prompt, add_special_tokens=False))
               for s in sample_random(DatasetSpec(num_prompts=20, random_input_len=40), byte))
    with pytest.raises(ConfigError, match="random-range-ratio"):
        DatasetSpec(random_range_ratio=1.0)
    with pytest.raises(ConfigError, match="too small"):
        sample_random(DatasetSpec(random_input_len=1), tok)


def out(start, ttft, itl, tokens=0, text="", ok=True, prompt_len=10) -> RequestOutput:
    return RequestOutput(generated_text=text, success=ok, latency=ttft + sum(itl), output_tokens=tokens, ttft=ttft,
                         itl=list(itl), prompt_len=prompt_len, start_time=start, error="" if ok else "boom")


def test_metrics_follow_vllms_definitions():
    outputs = [
        out(100.0, 0.1, [0.05, 0.05, 0.1], tokens=6),  # 4 chunks carrying 6 tokens: 3 ITL gaps, TPOT over 5
        out(100.1, 0.2, [], tokens=1),  # one token: no TPOT (0 for goodput)
        out(100.0, 0.0, [], ok=False),
        out(100.5, 0.05, [0.02], text="hello"),  # no usage from the server: the text's 5 tokens
    ]
    lens = output_lengths(outputs, ByteTokenizer(320))
    assert lens == [6, 1, 0, 5]
    m = calculate_metrics(outputs, 2.0, lens, {"ttft": 150.0, "tpot": 10.0})
    assert (m.completed, m.failed, m.total_input, m.total_output) == (3, 1, 30, 12)
    assert m.samples["itl"] == [0.05, 0.05, 0.1, 0.02]
    assert m.samples["tpot"] == pytest.approx([0.2 / 5, 0.02 / 4])
    assert m.samples["e2el"] == pytest.approx([0.3, 0.2, 0.07])
    # Goodput: the first request's TPOT (40 ms) misses 10 ms, the second's TTFT misses 150 ms;
    # the third meets both.
    assert m.request_goodput == pytest.approx(1 / 2.0)
    assert m.request_throughput == 1.5 and m.output_throughput == 6.0 and m.total_token_throughput == 21.0
    assert m.max_concurrent_requests == 2  # [100, 100.3) and [100.1, 100.3) overlap; [100.5, ...) starts later
    assert m.max_output_tokens_per_s == 7  # one per chunk (not per token): 4 + 1 + 2 chunks in the first second
    stats = statistics_ms([1.0, 2.0, 3.0, 4.0], [50, 99.9])
    assert stats == pytest.approx({"mean": 2500.0, "median": 2500.0, "std": 1118.034, "p50": 2500.0,
                                   "p99.9": 3997.0}, rel=1e-4)
    assert statistics_ms([], [99]) == {"mean": 0.0, "median": 0.0, "std": 0.0, "p99": 0.0}


def test_goodput_flags_are_parsed_and_checked():
    assert parse_goodput(["ttft:500", "tpot:50", "e2el:2000"]) == {"ttft": 500.0, "tpot": 50.0, "e2el": 2000.0}
    for bad in ("ttft", "tbt:50", "ttft:fast", "ttft:-1"):
        with pytest.raises(ConfigError, match="--goodput"):
            parse_goodput([bad])


def test_result_keys_and_block_are_vllms():
    outputs = [out(0.0, 0.1, [0.05, 0.05], tokens=3, text="abc"), out(0.0, 0.0, [], ok=False)]
    lens = output_lengths(outputs, ByteTokenizer(320))
    metrics = calculate_metrics(outputs, 1.0, lens, {"ttft": 200.0})
    result = result_fields(metrics, 1.0, outputs, lens, {"ttft": 200.0}, ["ttft", "tpot", "itl", "e2el"], [50, 99])
    for key in ("duration", "completed", "failed", "total_input_tokens", "total_output_tokens", "request_throughput",
                "request_goodput", "output_throughput", "total_token_throughput", "input_lens", "output_lens",
                "ttfts", "itls", "generated_texts", "errors", "max_concurrent_requests"):
        assert key in result
    for name in ("ttft", "tpot", "itl", "e2el"):
        assert {f"{stat}_{name}_ms" for stat in ("mean", "median", "std", "p50", "p99")} <= set(result)
    assert result["itls"] == [[0.05, 0.05], []] and result["errors"] == ["", "boom"]
    block = format_block(result, max_concurrency=4, request_rate=2.0, metric_names=["ttft", "tpot", "itl", "e2el"])
    lines = block.splitlines()
    row = "{:<40} {:<10}".format  # vLLM's row layout
    assert lines[0] == "{s:{c}^50}".format(s=" Serving Benchmark Result ", c="=") and lines[-1] == "=" * 50
    assert lines[1:5] == [row("Successful requests:", 1), row("Failed requests:", 1),
                          row("Maximum request concurrency:", 4), row("Request rate configured (RPS):", "2.00")]
    assert row("Request goodput (req/s):", "1.00") in lines and row("Peak concurrent requests:", "1.00") in lines
    assert "{s:{c}^50}".format(s="Time per Output Token (excl. 1st token)", c="-") in lines
    assert row("P99 TPOT (ms):", "50.00") in lines and row("Median ITL (ms):", "50.00") in lines


def test_sse_decoder_joins_events_split_anywhere():
    stream = (b'data: {"a": 1}\n\n: ping\n\ndata: {"b":\ndata: 2}\r\n\r\nevent: x\ndata: [DONE]\n\n'
              b'data: {"tail": "\xe2\x9c\x93"}')
    expected = ['{"a": 1}', '{"b":\n2}', "[DONE]", '{"tail": "\u2713"}']
    for cut in range(1, len(stream)):
        decoder = SSEDecoder()
        events = decoder.feed(stream[:cut]) + decoder.feed(stream[cut:]) + decoder.close()
        assert events == expected, cut


def sse(*events: dict) -> bytes:
    return b"".join(f"data: {json.dumps(e)}\n\n".encode() for e in events) + b"data: [DONE]\n\n"


def replay(body: bytes, status: int = 200, seen: list | None = None) -> httpx2.AsyncClient:
    def handler(request):
        if seen is not None:
            seen.append(json.loads(request.content))
        return httpx2.Response(status, content=body, headers={"content-type": "text/event-stream"})

    return httpx2.AsyncClient(transport=httpx2.MockTransport(handler))


def test_openai_request_functions_time_chunks_and_read_usage():
    inp = RequestInput("Hi there", 3, 4, "served", "http://server/v1/completions", "id-1", ignore_eos=True,
                       sampling={"temperature": 0.0})
    completion = sse({"choices": [{"index": 0, "text": "Hel"}]}, {"choices": [{"index": 0, "text": ""}]},
                     {"choices": [{"index": 0, "text": "lo!", "finish_reason": "length"}]},
                     {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 4, "total_tokens": 8}})
    sent: list = []

    async def call(func, body, url, status=200):
        async with replay(body, status, sent) as client:
            return await func(RequestInput(**{**vars(inp), "url": url}), client)

    res = asyncio.run(call(openai_completions, completion, inp.url))
    assert res.success and res.generated_text == "Hello!" and len(res.itl) == 2  # 3 chunks; usage is not one
    assert res.output_tokens == 4 and res.prompt_len == 4 and res.latency >= res.ttft > 0
    assert sent[-1] == {"model": "served", "prompt": "Hi there", "max_tokens": 4, "stream": True,
                        "stream_options": {"include_usage": True}, "temperature": 0.0, "ignore_eos": True}
    chat = sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
               {"choices": [{"index": 0, "delta": {"content": "Yes"}}]},
               {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    res = asyncio.run(call(openai_chat, chat, "http://server/v1/chat/completions"))
    assert res.success and res.generated_text == "Yes" and len(res.itl) == 2 and res.output_tokens == 0
    assert sent[-1]["messages"] == [{"role": "user", "content": "Hi there"}] and sent[-1]["max_completion_tokens"] == 4
    res = asyncio.run(call(openai_completions, b'{"error": "no such model"}', inp.url, status=404))
    assert not res.success and "HTTP 404" in res.error and "no such model" in res.error
    res = asyncio.run(call(openai_completions, sse({"usage": {"completion_tokens": 0}}), inp.url))
    assert not res.success and "without a token chunk" in res.error


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("args, message", [
    (["--goodput", "tbt:50"], "--goodput 'tbt:50'"),
    (["--dataset-name", "sharegpt"], "needs --dataset-path"),
    (["--metric-percentiles", "99,101"], "--metric-percentiles"),
    (["--backend", "openai-chat", "--endpoint", "/v1/completions"], "needs a path ending in /chat/completions"),
    (["--request-rate", "0"], "--request-rate"),
    (["--metadata", "novalue"], "--metadata"),
])
def test_cli_errors_are_one_line(args, message):
    res = megainfer("bench", "serve", "--port", str(free_port()), *args, timeout=120)
    assert res.returncode == 2 and message in res.stderr and "Traceback" not in res.stderr, res.stderr


def test_unreachable_server_is_a_clear_error():
    port = free_port()
    res = megainfer("bench", "serve", "--port", str(port), "--model", "tiny-mixtral", "--num-prompts", "2",
                    timeout=120)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert f"no server answers at http://127.0.0.1:{port}" in res.stderr


@pytest.fixture(scope="module")
def http_server(engine_backend):
    from megainfer.server.http_server import HttpServer
    from megainfer.server.openai_server import OpenAIServer
    from megainfer.server.served_model import ServedModel

    backend, checkpoint = engine_backend
    # The checkpoint has no chat template of its own: the chat endpoint gets a plain one.
    served = ServedModel.load(str(checkpoint), served_model_name="bench-model",
                              chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}")
    api = OpenAIServer(backend, served)
    http = HttpServer(api.app, "127.0.0.1", 0).start()
    yield http, checkpoint
    http.stop()
    api.close()


def test_megainfer_grpc_random_run_prints_and_saves_vllms_result(grpc_server, tmp_path, capsys):
    from megainfer.cli import main

    server, checkpoint = grpc_server
    json_path = tmp_path / "out.json"
    rc = main(["bench", "serve", "--backend", "megainfer-grpc", "--port", str(server.port), "--num-prompts", "6",
               "--random-input-len", "24", "--random-output-len", "5", "--random-range-ratio", "0.4",
               "--request-rate", "50", "--burstiness", "0.5", "--max-concurrency", "3", "--seed", "2",
               "--goodput", "ttft:60000", "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles",
               "50,99", "--save-result", "--result-dir", str(tmp_path / "results"), "--metadata", "run=ci",
               "--json", str(json_path), "--disable-tqdm"])
    printed = capsys.readouterr().out
    assert rc == 0
    result = json.loads(json_path.read_text())
    expected = sample_random(DatasetSpec(num_prompts=6, random_input_len=24, random_output_len=5,
                                         random_range_ratio=0.4, seed=2), ByteTokenizer(320))
    # The model was asked of the server; random prompts ignore EOS, so each request generates its length.
    assert result["model_id"] == str(checkpoint) and result["tokenizer_id"] == str(checkpoint)
    assert result["completed"] == 6 and result["failed"] == 0 and result["errors"] == [""] * 6
    assert result["output_lens"] == [s.expected_output_len for s in expected]
    assert result["total_output_tokens"] == sum(s.expected_output_len for s in expected)
    assert result["input_lens"] == [s.prompt_len + 1 for s in expected]  # the server's count adds BOS
    assert all(t > 0 for t in result["ttfts"])
    itls, lens = result["itls"], result["output_lens"]  # one gap per streamed chunk, never more than per token
    assert all(len(g) <= n - 1 for g, n in zip(itls, lens)) and sum(map(len, itls)) >= len(itls)
    assert result["request_goodput"] == pytest.approx(result["request_throughput"])
    assert 1 <= result["max_concurrent_requests"] <= 3 and result["max_concurrency"] == 3
    assert result["p50_e2el_ms"] > 0 and result["burstiness"] == 0.5 and result["request_rate"] == 50.0
    assert result["run"] == "ci" and result["backend"] == "megainfer-grpc" and result["num_prompts"] == 6
    saved = list((tmp_path / "results").iterdir())
    assert len(saved) == 1 and saved[0].name.startswith(f"megainfer-grpc-50.0qps-concurrency3-{checkpoint.name}-")
    assert json.loads(saved[0].read_text()) == result
    assert " Serving Benchmark Result " in printed and "P50 E2EL (ms):" in printed
    assert "{:<40} {:<10}".format("Maximum request concurrency:", 3) in printed


def test_megainfer_grpc_compares_prefix_caching_with_salts_and_the_reset_call(grpc_server, tmp_path, capsys):
    from megainfer.cli import main

    server, checkpoint = grpc_server
    json_path = tmp_path / "out.json"
    # One at a time, so each prefix's later requests find its blocks; 32 shared tokens (and the BOS
    # the server adds) are two full blocks of 16.
    rc = main(["bench", "serve", "--backend", "megainfer-grpc", "--port", str(server.port), "--dataset-name",
               "prefix_repetition", "--num-prompts", "6", "--prefix-repetition-num-prefixes", "2",
               "--prefix-repetition-prefix-len", "32", "--prefix-repetition-suffix-len", "4",
               "--prefix-repetition-output-len", "2", "--max-concurrency", "1", "--compare-prefix-caching",
               "--seed", "3", "--json", str(json_path), "--disable-tqdm"])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    result = json.loads(json_path.read_text())
    assert result["caching_off"]["completed"] == result["caching_on"]["completed"] == 6
    assert result["caching_off"]["cached_tokens"] == [0] * 6  # every request salted apart
    # The reset before the second run: each prefix's first request computes it, the other two reuse it.
    assert sorted(result["caching_on"]["cached_tokens"]) == [0, 0, 32, 32, 32, 32]
    assert " Prefix Caching: On vs Off " in printed and "Note:" not in printed


def test_megainfer_grpc_sharegpt_runs_repeat_the_workload(grpc_server, sharegpt_file):
    from megainfer.tools.bench.serve_bench import ServeBenchConfig, run

    server, checkpoint = grpc_server
    path, _ = sharegpt_file
    results = []
    for _ in range(2):
        config = ServeBenchConfig(backend="megainfer-grpc", port=server.port, model=str(checkpoint),
                                  served_model_name="anything", ignore_eos=True, sampling={"temperature": 0.0},
                                  dataset=DatasetSpec("sharegpt", str(path), num_prompts=4, seed=1,
                                                      sharegpt_output_len=3), disable_tqdm=True)
        results.append(run(config))
    assert [r["completed"] for r in results] == [4, 4] and [r["total_output_tokens"] for r in results] == [12, 12]
    assert results[0]["input_lens"] == results[1]["input_lens"] and results[0]["output_lens"] == [3] * 4
    assert results[0]["model_id"] == str(checkpoint) and results[0]["request_goodput"] is None


def test_openai_backends_run_the_same_workload_against_megainfers_http_server(http_server, grpc_server):
    from megainfer.tools.bench.serve_bench import ServeBenchConfig, run

    http, checkpoint = http_server
    dataset = DatasetSpec(num_prompts=5, random_input_len=20, random_output_len=6, seed=5)
    expected = sample_random(dataset, ByteTokenizer(320))
    results = {}
    for backend, port in (("openai", http.port), ("openai-chat", http.port), ("megainfer-grpc", grpc_server[0].port)):
        results[backend] = run(ServeBenchConfig(backend=backend, port=port, dataset=dataset, ignore_eos=True,
                                                request_rate=100.0, disable_tqdm=True))
    for backend, result in results.items():
        assert result["completed"] == 5 and result["errors"] == [""] * 5, backend
        assert result["output_lens"] == [s.expected_output_len for s in expected], backend
        assert result["model_id"] == str(checkpoint) and result["tokenizer_id"] == str(checkpoint)
    # The completions API and gRPC saw the same prompts (the server's count adds BOS).
    assert results["openai"]["input_lens"] == results["megainfer-grpc"]["input_lens"] == \
        [s.prompt_len + 1 for s in expected]
    assert all(len(g) <= 5 for g in results["openai-chat"]["itls"])
