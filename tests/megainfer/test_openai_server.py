"""The OpenAI-compatible HTTP API of `megainfer serve`, driven by the official `openai` SDK:
completions and chat (whole and streamed), n, logprobs, stop strings, greedy text equal to the
engine's, /v1/models, every error path as an OpenAI error object (and the server serving the
next request), disconnects freeing KV blocks, /health and the gRPC health service following
the nodes' states, one metrics registry for both frontends."""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import signal
import socket
import subprocess
import sys
import time

import urllib.error
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

openai = pytest.importorskip("openai")

from megainfer import Engine, SamplingParams  # noqa: E402
from megainfer.engine_config import EngineConfig  # noqa: E402
from megainfer.errors import ConfigError, DataPlaneError, Overloaded  # noqa: E402
from megainfer.messages import FinishReason, NodeStatus  # noqa: E402
from megainfer.server.endpoints import Endpoints  # noqa: E402
from megainfer.server.engine_backend import EngineBackend  # noqa: E402
from megainfer.server.openai_protocol import ChatCompletionRequest, CompletionRequest  # noqa: E402
from megainfer.server.served_model import ServedModel  # noqa: E402
from tests.helpers import ROOT  # noqa: E402

NAMES = ["tiny-chat", "alias"]
TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
CONFIG = EngineConfig(max_num_batched_tokens=64, max_model_len=128)
PROMPT = "The experts of a mixture"


class Switchable:
    """The engine backend, with faults and node states a test can switch on."""

    def __init__(self, inner: EngineBackend) -> None:
        self.inner = inner
        self.refuse: BaseException | None = None  # raised by the next submits
        self.state = NodeStatus.SERVING  # what info() says the node is

    def submit(self, request_id, prompt, params):
        if self.refuse is not None:
            raise self.refuse
        return self.inner.submit(request_id, prompt, params)

    def abort(self, request_id):
        return self.inner.abort(request_id)

    def info(self):
        info = self.inner.info()
        return dataclasses.replace(info, nodes=[dataclasses.replace(n, state=self.state) for n in info.nodes])

    def metrics_snapshot(self):
        return self.inner.metrics_snapshot()

    def reset_prefix_cache(self):
        return self.inner.reset_prefix_cache()

    def expert_load(self):
        return None if self.uncounted else self.inner.expert_load()

    uncounted = False  # answer as a server whose steps have not counted the experts' load yet

    def rebalance_experts(self):
        if self.placed is None:
            return self.inner.rebalance_experts()
        return self.placed

    placed = None  # a RebalanceReport the test makes the backend answer with (a deployment's)

    def close(self):
        self.inner.close()


@pytest.fixture(scope="module")
def server(mixtral_ref):
    backend = Switchable(EngineBackend(Engine(str(mixtral_ref.path), CONFIG)))
    served = ServedModel.load(mixtral_ref.path, NAMES, TEMPLATE)
    served.max_model_len = backend.inner.engine.max_model_len
    endpoints = Endpoints(backend, served, port=0, http_port=0).start()
    yield endpoints, backend
    endpoints.stop(0)
    backend.close()


@pytest.fixture()
def client(server):
    endpoints, backend = server
    backend.refuse, backend.state = None, NodeStatus.SERVING
    return openai.OpenAI(base_url=endpoints.http_url + "/v1", api_key="unused", max_retries=0, timeout=60)


def engine_text(path, prompt, params: SamplingParams) -> str:
    """What `megainfer generate` prints for the prompt: the engine's deltas' text, in order."""
    engine = Engine(str(path), CONFIG)
    engine.add_request("cli", prompt, params)
    text = []
    while engine.has_unfinished_requests():
        text += [d.new_text for d in engine.step()]
    return "".join(text)


def http(endpoints: Endpoints, path: str, data: bytes | None = None) -> tuple[int, bytes]:
    """(status, body) of a GET (or a JSON POST of `data`) to the HTTP API."""
    request = urllib.request.Request(endpoints.http_url + path, data=data,
                                     headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def wait_all_blocks_free(backend: Switchable, timeout_s: float = 20.0) -> None:
    engine = backend.inner.engine
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        s = engine.stats()
        if s.num_running == 0 and s.num_waiting == 0 and s.kv_cache_usage == 0:
            return
        time.sleep(0.05)
    raise AssertionError(f"KV blocks still held: {engine.stats()}")


def test_request_fields_map_onto_sampling_params_over_the_models_defaults():
    body = CompletionRequest.model_validate({
        "prompt": "x", "temperature": None, "top_k": 5, "stop": "END", "min_tokens": 2, "stop_token_ids": [7],
        "ignore_eos": True, "repetition_penalty": 1.1, "presence_penalty": 0.5, "n": 3, "seed": 9})
    params = body.sampling_params({"temperature": 0.3, "top_p": 0.9, "top_k": 40}, max_tokens=20, logprobs=2)
    assert (params.temperature, params.top_p, params.top_k) == (0.3, 0.9, 5)  # null is unset: the model's default
    assert (params.stop, params.min_tokens, params.stop_token_ids, params.ignore_eos) == (["END"], 2, [7], True)
    assert (params.repetition_penalty, params.presence_penalty, params.n, params.seed) == (1.1, 0.5, 3, 9)
    assert (params.max_tokens, params.logprobs, params.min_p) == (20, 2, 0.0)
    plain = CompletionRequest(prompt="x").sampling_params({}, max_tokens=16, logprobs=None)
    assert (plain.temperature, plain.top_p, plain.top_k) == (1.0, 1.0, 0)  # OpenAI's defaults
    chat = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], "max_tokens": 4,
                                                 "max_completion_tokens": 9, "logprobs": True, "top_logprobs": 3})
    assert (chat.requested_max_tokens(), chat.num_logprobs()) == (9, 3)


def test_generation_config_defaults_fill_unset_fields(server):
    endpoints, backend = server
    served = dataclasses.replace(endpoints.served, defaults={"temperature": 0.0, "max_tokens": 5})
    other = Endpoints(backend, served, port=0, http_port=0).start()
    try:
        c = openai.OpenAI(base_url=other.http_url + "/v1", api_key="unused", max_retries=0)
        ask = dict(model=NAMES[0], prompt=PROMPT, extra_body={"ignore_eos": True})
        first, second = (c.completions.create(**ask) for _ in range(2))
        assert first.usage.completion_tokens == 5 and first.choices[0].text == second.choices[0].text  # greedy
        assert c.completions.create(**ask, max_tokens=7).usage.completion_tokens == 7  # the request's own wins
        chat = c.chat.completions.create(model=NAMES[0], messages=[{"role": "user", "content": "hi"}],
                                         extra_body={"ignore_eos": True})
        assert chat.usage.completion_tokens == 5
    finally:
        other.stop(0)


def test_greedy_completion_equals_the_engines_text(client, mixtral_ref):
    expected = engine_text(mixtral_ref.path, PROMPT, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    r = client.completions.create(model=NAMES[0], prompt=PROMPT, max_tokens=12, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.model == NAMES[0] and r.object == "text_completion"
    assert [c.text for c in r.choices] == [expected]
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(PROMPT.encode()) + 1, 12)  # BOS + bytes
    chunks = list(client.completions.create(model=NAMES[1], prompt=PROMPT, max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_chat_matches_the_completion_of_its_rendered_prompt(client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    rendered = "<|system|>Be brief.\n<|user|>Hello there\n<|assistant|>"
    ids = list(rendered.encode())  # the template's text, without BOS (add_special_tokens=False)
    plain = client.completions.create(model=NAMES[0], prompt=ids, max_tokens=10, temperature=0,
                                      extra_body={"ignore_eos": True})
    r = client.chat.completions.create(model=NAMES[0], messages=messages, max_completion_tokens=10, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == plain.choices[0].text
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), 10)
    stream = client.chat.completions.create(model=NAMES[0], messages=messages, max_tokens=10, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == plain.choices[0].text
    assert [c for c in chunks if c.choices][-1].choices[0].finish_reason == "length"
    assert chunks[-1].usage.total_tokens == len(ids) + 10


def test_chat_default_max_tokens_fills_the_context(client, server):
    endpoints, _ = server
    messages = [{"role": "user", "content": "x" * 40}]
    r = client.chat.completions.create(model=NAMES[0], messages=messages, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.usage.prompt_tokens + r.usage.completion_tokens == endpoints.served.max_model_len
    assert r.choices[0].finish_reason == "length"


def test_n_fans_out_per_prompt(client):
    r = client.completions.create(model=NAMES[0], prompt=["ab", "cd"], n=2, max_tokens=6, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.choices[0].text == r.choices[1].text and r.choices[2].text == r.choices[3].text  # greedy
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (6, 24)  # prompts once, every choice
    sampled = client.chat.completions.create(model=NAMES[0], messages=[{"role": "user", "content": "hi"}], n=2,
                                             max_tokens=8, temperature=1.0, seed=5, extra_body={"ignore_eos": True})
    again = client.chat.completions.create(model=NAMES[0], messages=[{"role": "user", "content": "hi"}], n=2,
                                           max_tokens=8, temperature=1.0, seed=5, extra_body={"ignore_eos": True})
    assert [c.index for c in sampled.choices] == [0, 1]
    assert [c.message.content for c in sampled.choices] == [c.message.content for c in again.choices]  # seeded
    stream = client.completions.create(model=NAMES[0], prompt="ab", n=2, max_tokens=6, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    texts = {0: "", 1: ""}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts[0] == texts[1] == r.choices[0].text


def test_logprobs_in_both_shapes(client):
    r = client.completions.create(model=NAMES[0], prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0 and 1 <= len(top) <= 4  # the top 3 and the chosen token, keyed by text
        assert top[token] == logprob == max(top.values())  # greedy takes the most likely
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    echoed = client.completions.create(model=NAMES[0], prompt="abc", max_tokens=2, temperature=0, logprobs=1,
                                       echo=True, extra_body={"ignore_eos": True})
    e = echoed.choices[0]
    assert e.text.startswith("abc")
    assert len(e.logprobs.tokens) == 4 + 2  # BOS, a, b, c, then two generated
    assert e.logprobs.token_logprobs[0] is None and e.logprobs.top_logprobs[0] is None
    assert all(v <= 0 for v in e.logprobs.token_logprobs[1:])
    chat = client.chat.completions.create(model=NAMES[0], messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                          temperature=0, logprobs=True, top_logprobs=2,
                                          extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 5
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.logprob == entry.top_logprobs[0].logprob
        assert bytes(entry.bytes).decode("utf-8", "replace") == entry.token
    streamed = [c.choices[0].logprobs for c in client.chat.completions.create(
        model=NAMES[0], messages=[{"role": "user", "content": "hi"}], max_tokens=5, temperature=0, logprobs=True,
        stream=True, extra_body={"ignore_eos": True}) if c.choices and c.choices[0].logprobs]
    assert [e.logprob for part in streamed for e in part.content] == pytest.approx([e.logprob for e in content])


def test_stop_string_ends_the_text_before_it(client):
    full = client.completions.create(model=NAMES[0], prompt=PROMPT, max_tokens=16, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = next(full[i:i + 2] for i in range(3, len(full) - 2) if "\ufffd" not in full[i:i + 2])
    r = client.completions.create(model=NAMES[0], prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop],
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == full[:full.index(stop)]
    assert r.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model=NAMES[0], prompt=PROMPT, max_tokens=16, temperature=0, stop=stop,
                                            stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == full[:full.index(stop)]


def test_models_lists_every_served_name(client, server):
    endpoints, _ = server
    models = client.models.list().data
    assert [m.id for m in models] == NAMES
    assert all(m.owned_by == "megainfer" and m.max_model_len == endpoints.served.max_model_len for m in models)
    assert client.models.retrieve("alias").id == "alias"


def status_of(call) -> tuple[int, dict]:
    with pytest.raises(openai.APIStatusError) as err:
        call()
    body = err.value.response.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return err.value.status_code, body["error"]


def test_every_error_is_an_openai_error_object_and_the_server_serves_on(client, server):
    endpoints, backend = server
    long_prompt = "x" * endpoints.served.max_model_len
    cases = [
        (404, "model", lambda: client.completions.create(model="gpt-4", prompt="hi", max_tokens=2)),
        (400, None, lambda: client.completions.create(model=NAMES[0], prompt="hi", temperature=-1)),
        (400, None, lambda: client.completions.create(model=NAMES[0], prompt="hi", max_tokens=0)),
        (400, "prompt", lambda: client.completions.create(model=NAMES[0], prompt=long_prompt, max_tokens=2)),
        (400, "max_tokens", lambda: client.completions.create(model=NAMES[0], prompt="hi", max_tokens=10**6)),
        (400, "messages", lambda: client.chat.completions.create(model=NAMES[0], messages=[])),
        (400, "messages.0.role", lambda: client.chat.completions.create(model=NAMES[0], messages=[{"content": "x"}])),
        (400, None, lambda: client.chat.completions.create(model=NAMES[0], messages=[{"role": "user", "content": "x"}],
                                                           top_logprobs=2)),
        (400, None, lambda: client.completions.create(model=NAMES[0], prompt="hi", logprobs=50)),
        (400, None, lambda: client.completions.create(model=NAMES[0], prompt=[10**6])),
        (400, None, lambda: client.completions.create(model=NAMES[0], prompt="hi", logit_bias={"1": 5})),
    ]
    for status, param, call in cases:
        got, error = status_of(call)
        assert (got, error["param"]) == (status, param), error
        assert error["message"]
    for exc, status in ((Overloaded("full"), 429), (DataPlaneError("re-wiring"), 503), (RuntimeError("bug"), 500)):
        backend.refuse = exc
        got, error = status_of(lambda: client.completions.create(model=NAMES[0], prompt="hi", max_tokens=2))
        assert got == status
        backend.refuse = None
    status, body = http(endpoints, "/v1/completions", b"{not json")
    assert status == 400 and json.loads(body)["error"]["type"] == "invalid_request_error"
    status, body = http(endpoints, "/v2/nothing")
    assert status == 404 and "error" in json.loads(body)
    r = client.completions.create(model=NAMES[0], prompt="hi", max_tokens=3, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3
    wait_all_blocks_free(backend)


def test_a_model_without_chat_template_says_to_pass_one(server, mixtral_ref):
    endpoints, backend = server
    served = ServedModel.load(mixtral_ref.path)
    other = Endpoints(backend, served, port=0, http_port=0).start()
    try:
        c = openai.OpenAI(base_url=other.http_url + "/v1", api_key="unused", max_retries=0)
        status, error = status_of(lambda: c.chat.completions.create(
            model=str(mixtral_ref.path), messages=[{"role": "user", "content": "hi"}]))
        assert status == 400 and "--chat-template" in error["message"]
    finally:
        other.stop(0)


def test_unknown_fields_are_ignored_with_a_warning(client, caplog):
    with caplog.at_level(logging.WARNING, logger="megainfer.server.openai_protocol"):
        r = client.completions.create(model=NAMES[0], prompt="hi", max_tokens=2, extra_body={"frobnicate": 1})
    assert r.usage.completion_tokens >= 1
    assert "frobnicate" in caplog.text


def aborted(endpoints: Endpoints) -> float:
    return endpoints.metrics.registry.get_sample_value(
        "megainfer:request_success_total", {"model_name": NAMES[0], "finished_reason": FinishReason.ABORT.value})


def test_disconnected_clients_free_their_kv_blocks(client, server, monkeypatch):
    endpoints, backend = server
    # Steps of at least 20 ms: the 100 tokens take 2 s or more, so the request is still running
    # when the client has read three chunks, however long the client's thread waits for a core.
    step = backend.inner.steps.step

    def slow_step():
        time.sleep(0.02)
        step()

    monkeypatch.setattr(backend.inner.steps, "step", slow_step)
    body = {"model": NAMES[0], "prompt": PROMPT, "max_tokens": 100, "temperature": 0, "ignore_eos": True}
    before = aborted(endpoints)
    stream = client.completions.create(model=NAMES[0], prompt=PROMPT, max_tokens=100, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 2:
            break
    assert backend.inner.engine.stats().num_running == 1  # still generating when the client leaves
    stream.close()
    wait_all_blocks_free(backend)
    assert aborted(endpoints) == before + 1
    # A client that gives up on a whole (non-streamed) response while it is generated.
    payload = json.dumps(body).encode()
    with socket.create_connection((endpoints.http.host, endpoints.http.port)) as conn:
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: test\r\ncontent-type: application/json\r\n"
                     + f"content-length: {len(payload)}\r\n\r\n".encode() + payload)
        deadline = time.monotonic() + 10
        while backend.inner.engine.stats().num_running == 0 and time.monotonic() < deadline:
            time.sleep(0.002)
    wait_all_blocks_free(backend)
    assert aborted(endpoints) == before + 2


def test_health_follows_the_nodes_over_http_and_grpc(client, server):
    endpoints, backend = server
    channel = grpc.insecure_channel(endpoints.grpc.address)
    stub = health_pb2_grpc.HealthStub(channel)

    def grpc_status() -> int:
        return stub.Check(health_pb2.HealthCheckRequest(service="megainfer.v1.Inference")).status

    def wait_for(http_status: int, grpc_state: int) -> None:
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            if http(endpoints, "/health")[0] == http_status and grpc_status() == grpc_state:
                return
            time.sleep(0.1)
        raise AssertionError(f"health did not become {http_status} / {grpc_state}")

    try:
        wait_for(200, health_pb2.HealthCheckResponse.SERVING)
        for state in (NodeStatus.WIRING, NodeStatus.DEAD):
            backend.state = state
            wait_for(503, health_pb2.HealthCheckResponse.NOT_SERVING)
            assert state.value in json.loads(http(endpoints, "/health")[1])["error"]["message"]
            backend.state = NodeStatus.SERVING
            wait_for(200, health_pb2.HealthCheckResponse.SERVING)
    finally:
        backend.state = NodeStatus.SERVING
        channel.close()


def test_metrics_and_version_are_served_beside_the_api(client, server):
    endpoints, _ = server
    client.completions.create(model=NAMES[0], prompt="hi", max_tokens=2)
    status, text = http(endpoints, "/metrics")
    assert status == 200 and b'megainfer:e2e_request_latency_seconds_count{model_name="tiny-chat"}' in text
    assert endpoints.grpc.metrics is endpoints.metrics  # one registry for both frontends
    assert json.loads(http(endpoints, "/version")[1])["version"]


def test_a_port_in_use_names_its_flag(server):
    endpoints, backend = server
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match="--http-port"):
            Endpoints(backend, endpoints.served, port=0, http_port=port)
        with pytest.raises(ConfigError, match="--port"):
            Endpoints(backend, endpoints.served, port=port, http_port=0)


def test_an_engine_loop_that_dies_fails_its_requests_and_the_probes(mixtral_ref):
    backend = EngineBackend(Engine(str(mixtral_ref.path), CONFIG))

    def broken_step(emit=None):
        raise RuntimeError("a bug in the step")

    backend.queued.step_columns = broken_step
    endpoints = Endpoints(backend, ServedModel.load(mixtral_ref.path), port=0, http_port=0).start()
    try:
        c = openai.OpenAI(base_url=endpoints.http_url + "/v1", api_key="unused", max_retries=0)
        status, error = status_of(lambda: c.completions.create(model=str(mixtral_ref.path), prompt="hi"))
        assert status == 500 and "a bug in the step" in error["message"]
        status, _ = status_of(lambda: c.completions.create(model=str(mixtral_ref.path), prompt="hi"))
        assert status == 503  # refused at once, not left waiting
        deadline = time.monotonic() + 5  # /health answers from a reading at most a second old
        while http(endpoints, "/health")[0] != 503 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert http(endpoints, "/health")[0] == 503
    finally:
        endpoints.stop(0)
        backend.close()


def test_megainfer_serve_prints_its_http_url_and_stops_on_sigint(mixtral_ref, tmp_path):
    template = tmp_path / "chat.jinja"
    template.write_text(TEMPLATE)
    proc = subprocess.Popen([sys.executable, "-m", "megainfer", "serve", "--model", str(mixtral_ref.path),
                             "--port", "0", "--http-port", "0", "--served-model-name", "a", "b",
                             "--chat-template", str(template), "--max-model-len", "64", "--num-kv-blocks", "16"],
                            cwd=ROOT, stderr=subprocess.PIPE, text=True)
    try:
        url, start_up = None, []
        for line in proc.stderr:
            start_up.append(line)
            if line.strip().startswith("kernels:"):  # which implementation the kernels run: the last line
                break
            found = re.search(r"HTTP API on (http://\S+)/v1", line)
            if found:
                url = found.group(1)
        assert url is not None, "no HTTP URL printed"
        assert "kernels: reference (cpu tensors" in start_up[-1], start_up
        c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        assert [m.id for m in c.models.list().data] == ["a", "b"]
        assert c.models.list().data[0].max_model_len == 64
        r = c.chat.completions.create(model="b", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                      extra_body={"ignore_eos": True})
        assert r.model == "a" and r.usage.completion_tokens == 2
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
    finally:
        proc.kill()
        proc.stderr.close()


def test_the_admin_call_re_places_a_deployments_experts_and_refuses_a_colocated_engine(server):
    """POST /admin/experts/rebalance: a deployment answers with its re-placement's report; a
    colocated engine has nothing to re-place (400 naming why), and the server serves on."""
    import json

    from megainfer.messages import RebalanceReport

    endpoints, backend = server
    status, body = http(endpoints, "/admin/experts/rebalance", b"{}")
    assert status == 400 and "nothing to re-place" in json.loads(body)["error"]["message"]
    backend.placed = RebalanceReport(1, "decode", 8192, 1.93, 1.0, bytes_moved=2**20, switch_step=144)
    try:
        status, body = http(endpoints, "/admin/experts/rebalance", b"{}")
    finally:
        backend.placed = None
    report = json.loads(body)
    assert status == 200 and report["switch_step"] == 144 and report["imbalance_after"] == 1.0
    assert http(endpoints, "/health")[0] == 200


def test_the_expert_load_profile_is_served_and_priced_by_the_planner(server, client, mixtral_ref, tmp_path):
    """GET /admin/experts/load: the window's pairs per (layer, expert) as the profile file
    `megainfer plan --expert-load` reads (409 before any step counted them); the planner prices
    the tiny model against it."""
    import json

    from megainfer.expert_load_profile import ExpertLoadProfile
    from tests.helpers import megainfer

    endpoints, backend = server
    backend.uncounted = True
    try:
        status, body = http(endpoints, "/admin/experts/load")
    finally:
        backend.uncounted = False
    assert status == 409 and "serve some requests" in json.loads(body)["error"]["message"]
    client.completions.create(model="tiny-chat", prompt=PROMPT, max_tokens=4, temperature=0.0,
                              extra_body={"ignore_eos": True})
    status, body = http(endpoints, "/admin/experts/load")
    assert status == 200, body
    profile = ExpertLoadProfile.from_dict(json.loads(body))
    config = backend.inner.engine.model_config
    assert profile.model == "tiny-chat" and (profile.num_layers, profile.num_experts) == (config.num_layers,
                                                                                      config.num_experts)
    assert profile.decode_steps > 0 and profile.prefill_steps > 0
    # Every token of a step routes top_k pairs in every layer.
    assert (profile.counts("all").sum(axis=1) == profile.counts("all").sum(axis=1)[0]).all()
    assert profile.counts("all")[0].sum() % config.top_k == 0
    path = tmp_path / "load.json"
    path.write_bytes(body)
    out = megainfer("plan", "--model", str(mixtral_ref.path), "--gpus", "H100", "--expert-load", str(path),
                    "--redundant-experts", "1", "--top", "2")
    assert out.returncode == 0, out.stderr
    assert f"expert load measured on tiny-chat: decode pairs of {profile.decode_steps} steps" in out.stdout
    assert http(endpoints, "/health")[0] == 200


def _prefix_counters(endpoints: Endpoints) -> tuple[float, float]:
    status, body = http(endpoints, "/metrics")
    assert status == 200
    text = body.decode()

    def value(name: str) -> float:
        return float(re.search(rf'^{name}_total{{model_name="[^"]*"}} (\S+)$', text, re.M).group(1))

    return value("megainfer:prefix_cache_queries"), value("megainfer:prefix_cache_hits")


def test_a_repeated_prefix_is_served_from_the_cache_and_reported(server, client):
    """cached_tokens in the SDK's usage object, vLLM's counters moving in /metrics, and
    /reset_prefix_cache making the next request compute its prompt whole again."""
    endpoints, backend = server
    prompt = list(range(3, 43))  # 40 tokens: two full blocks of 16 can be reused
    assert http(endpoints, "/reset_prefix_cache", b"")[0] == 200
    queries, hits = _prefix_counters(endpoints)
    first = client.completions.create(model="tiny-chat", prompt=prompt, max_tokens=2, temperature=0)
    second = client.completions.create(model="tiny-chat", prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == 32
    assert second.choices[0].text == first.choices[0].text
    queries_after, hits_after = _prefix_counters(endpoints)
    assert (queries_after - queries, hits_after - hits) == (80, 32)
    salted = client.completions.create(model="tiny-chat", prompt=prompt, max_tokens=2, temperature=0,
                                       extra_body={"cache_salt": "another-tenant"})
    assert salted.usage.prompt_tokens_details.cached_tokens == 0
    assert http(endpoints, "/reset_prefix_cache", b"")[0] == 200
    again = client.completions.create(model="tiny-chat", prompt=prompt, max_tokens=2, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens == 0
    wait_all_blocks_free(backend)
