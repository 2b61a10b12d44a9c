"""`megainfer generate` with vLLM's sampling flags: n completions, a logprobs table, stop strings,
--chat, and greedy text equal to what the HTTP and gRPC APIs return for the same prompt."""

from __future__ import annotations

import pytest

from megainfer import LLM, Engine, SamplingParams
from megainfer.engine_config import EngineConfig
from megainfer.server.engine_backend import EngineBackend
from megainfer.server.served_model import ServedModel
from tests.helpers import megainfer, write_chat_checkpoint

openai = pytest.importorskip("openai")

PROMPT = "Hello world, hello tokenizer"


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    pytest.importorskip("transformers")
    return write_chat_checkpoint(tmp_path_factory.mktemp("chat"), {"temperature": 0.7, "top_p": 0.8})


@pytest.fixture(scope="module")
def endpoints(chat_model):
    from megainfer.server.endpoints import Endpoints

    backend = EngineBackend(Engine(str(chat_model), EngineConfig(num_kv_blocks=64)))
    served = ServedModel.load(chat_model, "chat")
    running = Endpoints(backend, served, port=0, http_port=0).start()
    yield running
    running.stop(0)
    backend.close()


def streamed_text(out) -> str:
    assert out.returncode == 0, out.stderr
    assert out.stdout.endswith("\n")
    return out.stdout[:-1]


def test_n_completions_logprobs_table_and_stop_string():
    out = megainfer("generate", "--model", "tiny-mixtral", "--prompt", "abc", "--max-tokens", "6", "--ignore-eos",
                    "--n", "2", "--temperature", "1", "--sample-seed", "5", "--logprobs", "2")
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("--- completion 0 (length) ---") == 1 and "--- completion 1 (length) ---" in out.stdout
    assert out.stdout.count("logprob  rank") == 2 and "12 tokens in" in out.stderr
    assert "finish reasons length, length" in out.stderr
    # The table has one row per token, ranks and the top 2 of each.
    table = out.stdout.split("--- completion 1")[0].split("logprob  rank")[1].splitlines()[2:]
    assert len(table) == 6 and all(len(row.split()) >= 7 for row in table)
    stopped = megainfer("generate", "--model", "tiny-mixtral", "--prompt", "abc", "--max-tokens", "24",
                        "--temperature", "0", "--stop", "++")
    text = LLM("tiny-mixtral").generate("abc", SamplingParams(max_tokens=24, temperature=0))[0].outputs[0].text
    assert streamed_text(stopped) == text[:text.index("++")] and "finish reason stop" in stopped.stderr


@pytest.mark.parametrize("args, message", [
    (["--prompt-ids", "1,2", "--chat"], "--chat takes the message as --prompt"),
    (["--prompt", "x", "--chat", "--server", "127.0.0.1:1"], "cannot with --server"),
    (["--prompt", "x", "--chat"], "has no chat template"),
    (["--prompt", "x", "--min-p", "2"], "min_p must be"),
    (["--prompt", "x", "--logprobs", "99"], "logprobs must be"),
])
def test_bad_flags_are_one_line(args, message):
    out = megainfer("generate", "--model", "tiny-mixtral", *args)
    assert out.returncode == 2 and message in out.stderr and "Traceback" not in out.stderr


def test_greedy_text_equals_the_http_and_grpc_apis(endpoints, chat_model):
    client = openai.OpenAI(base_url=endpoints.http_url + "/v1", api_key="unused", max_retries=0, timeout=60)
    http = client.completions.create(model="chat", prompt=PROMPT, max_tokens=12, temperature=0).choices[0].text
    local = megainfer("generate", "--model", str(chat_model), "--prompt", PROMPT, "--max-tokens", "12",
                      "--temperature", "0")
    remote = megainfer("generate", "--server", endpoints.grpc.address, "--prompt", PROMPT, "--max-tokens", "12",
                       "--temperature", "0")
    assert http and streamed_text(local) == http == streamed_text(remote)
    message = {"role": "user", "content": PROMPT}
    chat = client.chat.completions.create(model="chat", messages=[message], max_tokens=12, temperature=0)
    local_chat = megainfer("generate", "--model", str(chat_model), "--prompt", PROMPT, "--chat", "--max-tokens", "12",
                           "--temperature", "0")
    assert streamed_text(local_chat) == chat.choices[0].message.content


def test_generate_on_the_demo_checkpoint_takes_its_generation_config(capsys):
    """megainfer-demo's generation_config.json sets max_new_tokens: --max-tokens still wins."""
    from megainfer.cli import main

    assert main(["generate", "--model", "megainfer-demo", "--prompt", "def ", "--max-tokens", "6",
                 "--sample-seed", "1"]) == 0
    err = capsys.readouterr().err
    assert "[6 tokens" in err
