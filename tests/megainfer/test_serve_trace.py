"""`megainfer bench serve --dataset-name trace`: a JSONL trace replayed request for request (each
at its arrival, prompts of exactly input_len token ids, exactly output_len tokens back)."""

from __future__ import annotations

import asyncio
import json

import pytest

from megainfer.tools.bench import serve_bench
from megainfer.tools.bench.serve_bench import ServeBenchConfig
from megainfer.tools.bench.serve_datasets import DatasetSpec, sample_requests
from megainfer.tools.bench.serve_requests import RequestOutput
from megainfer.errors import ConfigError
from megainfer.tokenizer import ByteTokenizer

TRACE = [{"arrival": 0.0, "input_len": 7, "output_len": 3},
         {"arrival": 0.30, "input_len": 40, "output_len": 5},
         {"arrival": 0.10, "input_len": 1, "output_len": 1},  # out of order: requests come sorted by arrival
         {"arrival": 0.45, "input_len": 300, "output_len": 2}]


def write_trace(path, rows) -> str:
    path.write_text("".join(json.dumps(row) + "\n" if isinstance(row, dict) else row for row in rows))
    return str(path)


def test_trace_gives_each_line_its_lengths_arrival_and_exact_token_id_prompt(tmp_path):
    tok = ByteTokenizer(320)
    spec = DatasetSpec("trace", write_trace(tmp_path / "t.jsonl", TRACE), num_prompts=None, seed=4,
                       request_id_prefix="t-")
    requests = sample_requests(spec, tok, max_model_len=512)
    by_arrival = sorted(TRACE, key=lambda row: row["arrival"])
    assert [(r.arrival_s, r.prompt_len, r.expected_output_len) for r in requests] == \
        [(row["arrival"], row["input_len"], row["output_len"]) for row in by_arrival]
    assert [r.request_id for r in requests] == ["t-0", "t-1", "t-2", "t-3"]
    special = {tok.bos_token_id, *tok.eos_token_ids}
    for r in requests:
        assert len(r.prompt_token_ids) == r.prompt_len
        assert all(0 <= i < tok.vocab_size and i not in special for i in r.prompt_token_ids)
    # The seed fixes the prompts; --num-prompts keeps the file's first N lines (then sorted by arrival).
    assert sample_requests(spec, tok, max_model_len=512) == requests
    other = sample_requests(DatasetSpec("trace", spec.path, num_prompts=None, seed=5), tok, max_model_len=512)
    assert [r.prompt_token_ids for r in other] != [r.prompt_token_ids for r in requests]
    first = sample_requests(DatasetSpec("trace", spec.path, num_prompts=2), tok, max_model_len=512)
    assert [r.arrival_s for r in first] == [0.0, 0.30]


@pytest.mark.parametrize("line, message", [
    ('{"arrival": 0.5, "input_len": 8}\n', "t.jsonl:2: each line needs arrival (s), input_len and output_len"),
    ("not json\n", "t.jsonl:2: not JSON"),
    ('{"arrival": -1, "input_len": 8, "output_len": 2}\n', "t.jsonl:2: arrival must be seconds >= 0"),
    ('{"arrival": 1, "input_len": 8.5, "output_len": 2}\n', "t.jsonl:2: input_len must be a positive integer"),
    ('{"arrival": 1, "input_len": 500, "output_len": 20}\n', "t.jsonl:2: input_len + output_len = 520 exceeds"),
])
def test_a_bad_trace_line_is_an_error_naming_the_line(tmp_path, line, message):
    path = write_trace(tmp_path / "t.jsonl", [TRACE[0], line, TRACE[1]])
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("+", r"\+")):
        sample_requests(DatasetSpec("trace", path, num_prompts=None), ByteTokenizer(320), max_model_len=512)


def test_trace_flags_that_cannot_apply_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="needs --dataset-path"):
        DatasetSpec("trace", None)
    with pytest.raises(ConfigError, match="--dataset-path .*missing.jsonl: no such file"):
        sample_requests(DatasetSpec("trace", str(tmp_path / "missing.jsonl")), ByteTokenizer(320), max_model_len=64)
    with pytest.raises(ConfigError, match="--dataset-name random needs --num-prompts"):
        DatasetSpec("random", num_prompts=None)
    trace = DatasetSpec("trace", str(tmp_path / "t.jsonl"))
    for extra in ({"request_rate": 4.0}, {"burstiness": 0.5}):
        with pytest.raises(ConfigError, match="--request-rate and --burstiness pace generated requests"):
            ServeBenchConfig(backend="megainfer-grpc", dataset=trace, **extra)
    with pytest.raises(ConfigError, match="use --backend openai or megainfer-grpc"):
        ServeBenchConfig(backend="openai-chat", dataset=trace)


def test_trace_requests_leave_at_their_arrivals_with_token_id_prompts(tmp_path, monkeypatch):
    """Each request leaves at its trace arrival, on a clock the sender's waits advance (a real one
    would test the event loop's wake-up on a busy machine, not the schedule)."""
    clock = FakeClock()
    real_sleep = asyncio.sleep

    async def sleep(seconds):
        await real_sleep(0)  # the requests already sent start first, at the time they left
        clock.now += seconds

    sent: list[tuple[float, object, int]] = []

    async def record(inp, session):
        sent.append((clock.now, inp.prompt, inp.output_len))
        return RequestOutput(success=True, output_tokens=inp.output_len, prompt_len=inp.prompt_len)

    monkeypatch.setitem(serve_bench.REQUEST_FUNCS, "megainfer-grpc", record)
    monkeypatch.setattr(serve_bench, "time", clock)
    monkeypatch.setattr(asyncio, "sleep", sleep)
    config = ServeBenchConfig(backend="megainfer-grpc", port=1, ignore_eos=True, disable_tqdm=True,
                              dataset=DatasetSpec("trace", write_trace(tmp_path / "t.jsonl", TRACE), num_prompts=None))
    requests = sample_requests(config.dataset, ByteTokenizer(320), max_model_len=512)
    outputs, duration = asyncio.run(serve_bench._send(config, requests, None, "m"))
    offsets = [t for t, _, _ in sent]
    arrivals = [r.arrival_s for r in requests]
    assert len(outputs) == len(requests) and duration == pytest.approx(arrivals[-1])
    assert offsets == pytest.approx(arrivals), (offsets, arrivals)
    assert [p for _, p, _ in sent] == [list(r.prompt_token_ids) for r in requests]
    assert [n for _, _, n in sent] == [r.expected_output_len for r in requests]


class FakeClock:
    """`time` as the sender reads it: `perf_counter` is `now`, which the patched sleep advances."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


def test_openai_completions_take_the_trace_prompts_as_token_ids(engine_backend, tmp_path):
    from megainfer.server.http_server import HttpServer
    from megainfer.server.openai_server import OpenAIServer
    from megainfer.server.served_model import ServedModel

    backend, checkpoint = engine_backend
    api = OpenAIServer(backend, ServedModel.load(str(checkpoint)))
    http = HttpServer(api.app, "127.0.0.1", 0).start()
    try:
        rows = [row for row in TRACE if row["input_len"] < 100]
        config = ServeBenchConfig(backend="openai", port=http.port, model=str(checkpoint), ignore_eos=True,
                                  disable_tqdm=True, dataset=DatasetSpec("trace", write_trace(tmp_path / "t.jsonl",
                                                                                             rows), num_prompts=None))
        result = serve_bench.run(config)
    finally:
        http.stop()
        api.close()
    by_arrival = sorted(rows, key=lambda row: row["arrival"])
    assert result["completed"] == len(rows)
    assert result["input_lens"] == [row["input_len"] for row in by_arrival]
    assert result["output_lens"] == [row["output_len"] for row in by_arrival]


def test_cli_replays_a_trace_against_a_server_with_exact_lengths(grpc_server, tmp_path, capsys):
    from megainfer.cli import main

    server, checkpoint = grpc_server
    rows = [row for row in TRACE if row["input_len"] + row["output_len"] <= 64]  # the fixture's context is 512
    path = write_trace(tmp_path / "t.jsonl", rows)
    out = tmp_path / "out.json"
    rc = main(["bench", "serve", "--backend", "megainfer-grpc", "--port", str(server.port), "--dataset-name",
               "trace", "--dataset-path", path, "--json", str(out), "--disable-tqdm"])
    assert rc == 0
    result = json.loads(out.read_text())
    by_arrival = sorted(rows, key=lambda row: row["arrival"])
    # The server's own counts: no BOS added to an id prompt, EOS ignored.
    assert result["input_lens"] == [row["input_len"] for row in by_arrival]
    assert result["output_lens"] == [row["output_len"] for row in by_arrival]
    assert result["completed"] == len(rows) == result["num_prompts"]
    starts = result["start_times"]
    assert all(abs(s - (row["arrival"] - by_arrival[0]["arrival"])) < 0.08 for s, row in zip(starts, by_arrival))
    assert "Traffic: trace arrivals, 3 requests" in capsys.readouterr().out
