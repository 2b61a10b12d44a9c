"""Bad input on every door: Hypothesis fuzzes the request fields of both frontends of one
colocated server (gRPC megainfer.v1.Inference Generate/Abort/ServerInfo; HTTP /v1/completions and
/v1/chat/completions) with huge, negative, NaN/inf, empty, unicode (NULs, lone surrogates, very
long) values, token ids outside the vocabulary, max_tokens past the context, thousands of stop
strings, wrong JSON types, malformed and non-object bodies, missing and unknown fields, garbled
protobuf. Every answer must be a client error (gRPC INVALID_ARGUMENT or RESOURCE_EXHAUSTED, HTTP
4xx) or a success where the input was in fact valid, never INTERNAL/500; and after each example
the server still serves a plain request and, once idle, holds no KV block.

The deterministic tests below the fuzzers pin each bug the fuzzers found."""

from __future__ import annotations

import http.client
import json
import math
import socket
import threading
import time
from dataclasses import dataclass

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megainfer import Engine, SamplingParams
from megainfer.engine_config import EngineConfig
from megainfer.errors import RequestError
from megainfer.server.endpoints import Endpoints
from megainfer.server.engine_backend import EngineBackend
from megainfer.server.openai_protocol import ANSWER_CHANGING_EXTRAS
from megainfer.server.request_size import MAX_REQUEST_BYTES
from megainfer.server.served_model import ServedModel
from megainfer.v1 import inference_pb2 as pb
from megainfer.v1 import inference_pb2_grpc as pb_grpc

NAME = "tiny-fuzz"
VOCAB = 320  # the tiny checkpoint's (tests/conftest.py)
MAX_MODEL_LEN = 128
TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
HTTP_CLIENT_ERRORS = {400, 404, 413, 429}
GRPC_ANSWERS = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}
FUZZ = settings(deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.large_base_example, HealthCheck.filter_too_much])


@dataclass
class Doors:
    endpoints: Endpoints
    backend: EngineBackend
    grpc: pb_grpc.InferenceStub
    channel: grpc.Channel

    def post(self, path: str, body: bytes, content_type: str | None = "application/json") -> tuple[int, bytes]:
        conn = http.client.HTTPConnection(self.endpoints.http.host, self.endpoints.http.port, timeout=60)
        try:
            conn.request("POST", path, body=body, headers={} if content_type is None else
                         {"content-type": content_type})
            response = conn.getresponse()
            return response.status, response.read()
        finally:
            conn.close()

    def raw(self, method: str):
        """The RPC `method`, sending bytes as they are (unary_stream for Generate)."""
        path = f"/megainfer.v1.Inference/{method}"
        if method == "Generate":
            return self.channel.unary_stream(path, request_serializer=None, response_deserializer=None)
        return self.channel.unary_unary(path, request_serializer=None, response_deserializer=None)


@pytest.fixture(scope="module")
def doors(mixtral_ref):
    backend = EngineBackend(Engine(str(mixtral_ref.path), EngineConfig(max_num_batched_tokens=64,
                                                                      max_model_len=MAX_MODEL_LEN, num_kv_blocks=64)))
    served = ServedModel.load(mixtral_ref.path, NAME, TEMPLATE)
    served.max_model_len = backend.engine.max_model_len
    endpoints = Endpoints(backend, served, port=0, http_port=0).start()
    channel = grpc.insecure_channel(endpoints.grpc.address)
    yield Doors(endpoints, backend, pb_grpc.InferenceStub(channel), channel)
    channel.close()
    endpoints.stop(0)
    backend.close()


# -- what every example must leave behind -----------------------------------------------------
def wait_idle(backend: EngineBackend, timeout_s: float = 30.0) -> None:
    """Every request ended and every KV block back in the free list."""
    engine, blocks = backend.engine, backend.engine.scheduler.block_manager
    deadline = time.monotonic() + timeout_s
    while True:
        s = engine.stats()
        idle = (s.num_running == 0 and s.num_waiting == 0 and backend.queued.num_queued == 0
                and blocks.num_free_blocks == blocks.num_blocks and len(backend.registry) == 0)
        if idle:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"not idle: running {s.num_running}, waiting {s.num_waiting}, free blocks "
                                 f"{blocks.num_free_blocks}/{blocks.num_blocks}, open streams {len(backend.registry)}")
        time.sleep(0.02)


def assert_still_serving(doors: Doors) -> None:
    status, body = doors.post("/v1/completions", json.dumps({"prompt": "hi", "max_tokens": 2}).encode())
    assert status == 200, body
    assert json.loads(body)["usage"]["completion_tokens"] >= 1
    responses = list(doors.grpc.Generate(pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(max_tokens=2)),
                                         timeout=60))
    assert responses[-1].finish_reason
    wait_idle(doors.backend)


def check_http_answer(status: int, body: bytes) -> None:
    """A client error as OpenAI's error object, or a whole answer (JSON, or SSE ending in [DONE])."""
    assert status == 200 or status in HTTP_CLIENT_ERRORS, (status, body[:2000])
    if status != 200:
        error = json.loads(body)["error"]
        assert error["message"] and error["type"] != "internal_error", error
        return
    text = body.decode()
    if text.startswith("data: "):
        events = [line[len("data: "):] for line in text.split("\n\n") if line]
        assert events[-1] == "[DONE]", events[-3:]
        for event in events[:-1]:
            assert "error" not in json.loads(event), event
    else:
        assert json.loads(text)["choices"]


def grpc_generate(doors: Doors, request, raw: bool = False) -> tuple[grpc.StatusCode, str, list]:
    call = doors.raw("Generate")(request, timeout=120) if raw else doors.grpc.Generate(request, timeout=120)
    responses: list = []
    try:
        responses.extend(call)
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or "", responses
    return grpc.StatusCode.OK, "", responses


def check_grpc_answer(code: grpc.StatusCode, details: str, responses: list, raw: bool = False) -> None:
    assert code in GRPC_ANSWERS, (code, details)
    if code is grpc.StatusCode.OK:
        last = pb.GenerateResponse.FromString(responses[-1]) if raw else responses[-1]
        assert last.finish_reason and last.usage.prompt_tokens > 0, last
    else:
        assert details, code


# -- strategies: valid values beside hostile ones ---------------------------------------------
HUGE_INTS = [-1, 0, 2**31 - 1, -2**31, 2**31, 2**32, 2**63 - 1, 2**63, 2**64, 10**30, -10**30]
ODD_FLOATS = [math.nan, math.inf, -math.inf, -0.0, 5e-324, 1e-300, 1e308, -1e308]
ODD_CHARS = ["\x00", "\ud800", "\udfff", "\ufffd", "\uffff", "\U0010ffff", "\u202e", "\u0301", "\x7f", "\n"]

json_scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6), st.text(max_size=8),
                         st.floats(allow_nan=False, allow_infinity=False))
json_values = st.recursive(json_scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                                  st.dictionaries(st.text(max_size=5), inner,
                                                                                  max_size=3)), max_leaves=8)
# Any code point, lone surrogates included (JSON carries them as \ud800 escapes).
any_char = st.one_of(st.characters(exclude_categories=()), st.sampled_from(ODD_CHARS))
unicode_text = st.one_of(st.text(any_char, max_size=24), st.integers(200, 20_000).map(lambda n: "\u00e9" * n))
utf8_text = st.one_of(st.text(st.characters(codec="utf-8"), max_size=24),  # what protobuf strings can hold
                      st.sampled_from(["\x00", "\U0010ffff", "a\x00b"]), st.integers(200, 5_000).map(lambda n: "x" * n))
token_id = st.one_of(st.integers(0, VOCAB - 1), st.sampled_from([-1, VOCAB, 2**31 - 1, -2**31, 2**63, 10**30]))
token_ids = st.lists(token_id, max_size=8)
many_strings = st.integers(65, 3000).map(lambda k: [f"s{i}" for i in range(k)])  # "thousands of stop strings"
many_token_ids = st.integers(1000, 5000).map(lambda k: [i % VOCAB for i in range(k)])  # thousands, all known


def ints(lo: int, hi: int):
    return st.one_of(st.integers(lo, hi), st.sampled_from(HUGE_INTS))


def floats(lo: float, hi: float):
    return st.one_of(st.floats(lo, hi), st.sampled_from(ODD_FLOATS), st.floats())


# name -> (valid values, hostile values); wrong JSON types and a missing field are tried for every field.
SAMPLING_FIELDS = {
    "model": (st.just(NAME), unicode_text),
    "max_tokens": (st.integers(1, 4), st.sampled_from([0, -1, MAX_MODEL_LEN, MAX_MODEL_LEN + 1, *HUGE_INTS])),
    "temperature": (st.floats(0, 2), floats(-5, 5)),
    "top_p": (st.floats(0.01, 1), floats(-1, 2)),
    "top_k": (st.integers(-1, VOCAB + 5), ints(-5, 10)),
    "min_p": (st.floats(0, 1), floats(-1, 2)),
    "n": (st.integers(1, 3), st.sampled_from([0, -1, 129, *HUGE_INTS])),
    "seed": (st.integers(0, 2**63 - 1), ints(-3, 3)),
    "stop": (st.one_of(st.text(max_size=4), st.lists(st.text(min_size=1, max_size=4), max_size=3)),
             st.one_of(many_strings, st.lists(unicode_text, max_size=3), st.just([""]), st.just(["x" * 1025]))),
    "stop_token_ids": (st.lists(st.integers(0, VOCAB - 1), max_size=3),
                       st.one_of(st.lists(token_id, max_size=4), many_token_ids)),
    "presence_penalty": (st.floats(-2, 2), floats(-3, 3)),
    "frequency_penalty": (st.floats(-2, 2), floats(-3, 3)),
    "repetition_penalty": (st.floats(0.5, 2), floats(-1, 3)),
    "min_tokens": (st.integers(0, 1), ints(0, 10)),
    "ignore_eos": (st.booleans(), json_scalars),
    "include_stop_str_in_output": (st.booleans(), json_scalars),
    "skip_special_tokens": (st.booleans(), json_scalars),
    "prompt_logprobs": (st.integers(0, 3), ints(-2, 25)),
    "stream": (st.booleans(), json_scalars),
    "stream_options": (st.fixed_dictionaries({}, optional={"include_usage": st.booleans(),
                                                           "continuous_usage_stats": st.booleans()}), json_values),
    "user": (st.text(max_size=8), unicode_text),
    "logit_bias": (st.just({}), st.dictionaries(st.text(max_size=4), floats(-100, 100), max_size=3)),
}
COMPLETION_FIELDS = {
    "prompt": (st.one_of(st.text(min_size=1, max_size=12), st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8),
                         st.lists(st.text(min_size=1, max_size=6), min_size=1, max_size=3)),
               st.one_of(unicode_text, token_ids, st.lists(unicode_text, max_size=3), st.lists(token_ids, max_size=3),
                         st.integers(MAX_MODEL_LEN - 2, 3 * MAX_MODEL_LEN).map(lambda n: list(range(n % VOCAB)) * 3))),
    "echo": (st.booleans(), json_scalars),
    "logprobs": (st.integers(0, 3), ints(-2, 25)),
    "suffix": (st.just(""), unicode_text),
    "best_of": (st.none(), ints(-1, 5)),  # null: unset (best_of must equal n)
    **SAMPLING_FIELDS,
}
message_content = st.one_of(st.text(max_size=12),
                            st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=6)}),
                                     min_size=1, max_size=2))
valid_message = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]),
                                       "content": message_content})
hostile_message = st.one_of(
    st.fixed_dictionaries({"role": st.one_of(unicode_text, json_values),
                           "content": st.one_of(unicode_text, json_values)}),
    st.fixed_dictionaries({}, optional={"role": unicode_text, "content": unicode_text, "tool_calls": json_values,
                                        "name": json_values}),
    st.fixed_dictionaries({"role": st.just("user"), "content": st.lists(json_values, max_size=3)}),
    json_values)
CHAT_FIELDS = {
    "messages": (st.lists(valid_message, min_size=1, max_size=3),
                 st.one_of(st.lists(hostile_message, max_size=3), st.just([]), json_values,
                           st.lists(valid_message, min_size=40, max_size=60))),
    "max_completion_tokens": (st.integers(1, 4), st.sampled_from([0, -1, MAX_MODEL_LEN, *HUGE_INTS])),
    "logprobs": (st.booleans(), json_scalars),
    "top_logprobs": (st.integers(0, 3), ints(-2, 25)),
    "tools": (st.just([]), st.lists(json_values, max_size=2)),
    "tool_choice": (st.just("none"), json_values),
    "response_format": (st.just({"type": "text"}),
                        st.one_of(st.fixed_dictionaries({"type": unicode_text}), json_values)),
    "add_generation_prompt": (st.booleans(), json_scalars),
    "continue_final_message": (st.just(False), json_scalars),
    "chat_template_kwargs": (st.just({}), st.dictionaries(st.one_of(st.sampled_from(["self", "messages", "tools",
                                                                                     "add_generation_prompt"]),
                                                                    unicode_text), json_values, max_size=3)),
    **SAMPLING_FIELDS,
}
UNKNOWN_FIELD = st.one_of(st.text(min_size=1, max_size=8), st.sampled_from(sorted(ANSWER_CHANGING_EXTRAS)))


@st.composite
def request_bodies(draw, fields: dict, required: tuple[str, ...]) -> dict:
    """A valid body (required fields and some optional ones), then up to four fields made hostile,
    given a wrong JSON type or left out, and perhaps unknown fields."""
    body = {name: draw(valid) for name, (valid, _) in fields.items() if name in required or draw(st.booleans())}
    if "top_logprobs" in body:
        body["logprobs"] = True
    if "stream_options" in body:
        body["stream"] = True
    for name in draw(st.sampled_from([0, 1, 1, 2, 3, 4]).flatmap(
            lambda k: st.sets(st.sampled_from(sorted(fields)), min_size=k, max_size=k))):
        how = draw(st.sampled_from(["hostile", "hostile", "hostile", "wrong type", "missing"]))
        if how == "missing":
            body.pop(name, None)
        else:
            body[name] = draw(fields[name][1] if how == "hostile" else json_values)
    if draw(st.integers(0, 3)) == 0:
        body.update(draw(st.dictionaries(UNKNOWN_FIELD, json_values, min_size=1, max_size=2)))
    return body


def encode(body) -> bytes:
    """JSON as Python writes it: NaN and Infinity as bare words, lone surrogates as \\u escapes."""
    return json.dumps(body).encode()


# -- HTTP ---------------------------------------------------------------------------------------
@settings(FUZZ, max_examples=150)
@given(body=request_bodies(COMPLETION_FIELDS, ("prompt", "max_tokens")))
def test_completions_answer_every_field_with_a_client_error_or_a_completion(doors, body):
    check_http_answer(*doors.post("/v1/completions", encode(body)))
    assert_still_serving(doors)


@settings(FUZZ, max_examples=120)
@given(body=request_bodies(CHAT_FIELDS, ("messages", "max_tokens")))
def test_chat_answers_every_field_with_a_client_error_or_a_completion(doors, body):
    check_http_answer(*doors.post("/v1/chat/completions", encode(body)))
    assert_still_serving(doors)


# Every number field beside a valid request, sampled (temperature 1) or greedy: the values that
# overflow a C integer or a tensor, NaN and the infinities, and any other int or float.
NUMBER_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "n", "seed", "presence_penalty",
                 "frequency_penalty", "repetition_penalty", "min_tokens", "prompt_logprobs", "logprobs")
CHAT_NUMBER_FIELDS = {"logprobs": "top_logprobs", "max_tokens": "max_completion_tokens"}
any_number = st.one_of(st.sampled_from(HUGE_INTS + ODD_FLOATS), st.integers(), st.floats())


def number_body(chat: bool, field: str, value, sampled: bool = True) -> tuple[str, dict]:
    body: dict = {"max_tokens": 2, "temperature": 1.0 if sampled else 0.0}
    if chat:
        body |= {"messages": [{"role": "user", "content": "hi"}], "logprobs": True}
        field = CHAT_NUMBER_FIELDS.get(field, field)
    else:
        body["prompt"] = "hi"
    body[field] = value
    return ("/v1/chat/completions" if chat else "/v1/completions"), body


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_every_number_field_takes_every_extreme_value(doors, chat):
    """The grid the fuzzers sample from, whole: each field once with each extreme value."""
    for field in NUMBER_FIELDS:
        for value in HUGE_INTS + ODD_FLOATS:
            path, body = number_body(chat, field, value)
            status, answer = doors.post(path, encode(body))
            assert status == 200 or status in HTTP_CLIENT_ERRORS, (field, value, status, answer[:300])
    assert_still_serving(doors)


@settings(FUZZ, max_examples=50)
@given(chat=st.booleans(), field=st.sampled_from(NUMBER_FIELDS), value=any_number, sampled=st.booleans())
def test_number_fields_take_any_number(doors, chat, field, value, sampled):
    path, body = number_body(chat, field, value, sampled)
    check_http_answer(*doors.post(path, encode(body)))
    assert_still_serving(doors)


# Every text field, holding any text: NULs, lone surrogates, odd code points, long runs.
TEXT_FIELDS = {
    "prompt": lambda t: {"prompt": t},
    "prompt batch": lambda t: {"prompt": ["ok", t]},
    "stop": lambda t: {"prompt": "hi", "stop": [t]},
    "model": lambda t: {"prompt": "hi", "model": t},
    "user": lambda t: {"prompt": "hi", "user": t},
    "field name": lambda t: {"prompt": "hi", t: 1},
    "role": lambda t: {"messages": [{"role": t, "content": "hi"}]},
    "content": lambda t: {"messages": [{"role": "user", "content": t}]},
    "content part": lambda t: {"messages": [{"role": "user", "content": [{"type": "text", "text": t}]}]},
    "message name": lambda t: {"messages": [{"role": "user", "content": "hi", "name": t}]},
    "template variable": lambda t: {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {t: t}},
}


ODD_TEXTS = ["", *ODD_CHARS, "a\ud800b", "\x00" * 300, "\u00e9" * 5000]


def text_request(field: str, text: str) -> tuple[str, dict]:
    body = TEXT_FIELDS[field](text) | {"max_tokens": 2}
    return ("/v1/chat/completions" if "messages" in body else "/v1/completions"), body


def test_every_text_field_takes_every_odd_text(doors):
    """The grid the text fuzzer samples from, whole: each field once with each odd text."""
    for field in TEXT_FIELDS:
        for text in ODD_TEXTS:
            path, body = text_request(field, text)
            status, answer = doors.post(path, encode(body))
            assert status == 200 or status in HTTP_CLIENT_ERRORS, (field, text[:20], status, answer[:300])
    assert_still_serving(doors)


@settings(FUZZ, max_examples=60)
@given(field=st.sampled_from(sorted(TEXT_FIELDS)), text=unicode_text)
def test_text_fields_take_any_text(doors, field, text):
    path, body = text_request(field, text)
    check_http_answer(*doors.post(path, encode(body)))
    assert_still_serving(doors)


valid_completion = encode({"prompt": "hi", "max_tokens": 2})
not_requests = st.one_of(
    st.binary(max_size=64),  # not JSON, or not UTF-8
    json_values.map(encode),  # JSON, but mostly not an object
    st.integers(0, len(valid_completion) - 1).map(lambda n: valid_completion[:n]),  # cut short
    st.integers(1, 5000).map(lambda depth: b'{"prompt": ' + b"[" * depth + b"]" * depth + b"}"),  # deeply nested
    st.integers(10, 6000).map(lambda digits: b'{"prompt": "hi", "max_tokens": ' + b"9" * digits + b"}"),
    st.just(b'{"prompt": "hi", "prompt": [1], "max_tokens": 2}'),  # a key twice
)


@settings(FUZZ, max_examples=60)
@given(path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]), body=not_requests,
       content_type=st.sampled_from(["application/json", "text/plain", None, "application/json; charset=latin-1",
                                     "multipart/form-data; boundary=x"]))
def test_malformed_and_non_object_bodies_are_client_errors(doors, path, body, content_type):
    status, answer = doors.post(path, body, content_type)
    check_http_answer(status, answer)
    assert_still_serving(doors)


# -- gRPC ---------------------------------------------------------------------------------------
INT32_EDGES = [-2**31, -1, 0, 2**31 - 1]
int32 = st.one_of(st.integers(-3, 8), st.sampled_from(INT32_EDGES), st.integers(-2**31, 2**31 - 1))
float32 = st.one_of(st.floats(width=32), st.sampled_from([-1.0, 3.0, math.nan, math.inf, -math.inf]))
# name -> (valid values, hostile values within the field's protobuf type)
PROTO_FIELDS = {
    "max_tokens": (st.integers(1, 4), st.sampled_from([0, -1, MAX_MODEL_LEN, 2**31 - 1, -2**31])),
    "temperature": (st.floats(0, 2, width=32), float32),
    "top_p": (st.floats(0.125, 1, width=32), float32),
    "min_p": (st.floats(0, 1, width=32), float32),
    "repetition_penalty": (st.floats(0.5, 2, width=32), float32),
    "presence_penalty": (st.floats(-2, 2, width=32), float32),
    "frequency_penalty": (st.floats(-2, 2, width=32), float32),
    "top_k": (st.integers(-1, VOCAB + 5), int32),
    "min_tokens": (st.integers(0, 1), int32),
    "seed": (st.integers(0, 2**63 - 1), st.sampled_from([2**63, 2**64 - 1])),
    "n": (st.integers(1, 3), st.sampled_from([0, -1, 129, 2**31 - 1, -2**31])),
    "logprobs": (st.integers(0, 3), int32),
    "prompt_logprobs": (st.integers(0, 3), int32),
    "ignore_eos": (st.booleans(), st.booleans()),
    "include_stop_str_in_output": (st.booleans(), st.booleans()),
    "skip_special_tokens": (st.booleans(), st.booleans()),
    "stop": (st.lists(st.text(min_size=1, max_size=4), max_size=3),
             st.one_of(st.lists(utf8_text, max_size=3), many_strings, st.just(["x" * 1025]))),
    "stop_token_ids": (st.lists(st.integers(0, VOCAB - 1), max_size=3),
                       st.one_of(st.lists(int32, max_size=4), many_token_ids)),
}
int32_token_id = st.one_of(st.integers(0, VOCAB - 1), st.sampled_from([-1, VOCAB, 2**31 - 1, -2**31]))


@st.composite
def generate_requests(draw) -> pb.GenerateRequest:
    """A valid request (some sampling fields set), then up to four fields hostile; the prompt
    text, token ids (perhaps outside the vocabulary or too many), or missing."""
    request = pb.GenerateRequest(request_id=draw(st.one_of(st.just(""), utf8_text)))
    prompt = draw(st.sampled_from(["text", "text", "token_ids", "token_ids", "none"]))
    if prompt == "text":
        request.text = draw(st.one_of(utf8_text, st.integers(MAX_MODEL_LEN, 3 * MAX_MODEL_LEN).map(lambda n: "y" * n)))
    elif prompt == "token_ids":
        request.token_ids.ids.extend(draw(st.lists(int32_token_id, max_size=8)))
    values = {name: draw(valid) for name, (valid, _) in PROTO_FIELDS.items() if draw(st.booleans())}
    for name in draw(st.sampled_from([0, 1, 1, 2, 3, 4]).flatmap(
            lambda k: st.sets(st.sampled_from(sorted(PROTO_FIELDS)), min_size=k, max_size=k))):
        values[name] = draw(PROTO_FIELDS[name][1])
    for name, value in values.items():
        if isinstance(value, list):
            getattr(request.sampling, name).extend(value)
        else:
            setattr(request.sampling, name, value)
    return request


@settings(FUZZ, max_examples=150)
@given(request=generate_requests())
def test_generate_answers_every_field_with_a_client_error_or_a_stream(doors, request):
    check_grpc_answer(*grpc_generate(doors, request))
    assert_still_serving(doors)


@st.composite
def garbled(draw) -> bytes:
    """A valid request's bytes cut, overwritten, extended, or given a string field that is not UTF-8."""
    data = bytearray(draw(generate_requests()).SerializeToString())
    how = draw(st.sampled_from(["cut", "overwrite", "insert", "bad utf-8", "random"]))
    if how == "cut" and data:
        del data[draw(st.integers(0, len(data) - 1)):]
    elif how == "overwrite" and data:
        at = draw(st.integers(0, len(data) - 1))
        data[at:at + 4] = draw(st.binary(min_size=1, max_size=4))
    elif how == "insert":
        at = draw(st.integers(0, len(data)))
        data[at:at] = draw(st.binary(min_size=1, max_size=8))
    elif how == "bad utf-8":
        data += b"\x0a\x02\xed\xa0"  # request_id: the UTF-8 encoding of a lone surrogate
    else:
        data = bytearray(draw(st.binary(max_size=48)))
    return bytes(data)


@settings(FUZZ, max_examples=80)
@given(method=st.sampled_from(["Generate", "Abort", "ServerInfo"]), data=garbled())
def test_undecodable_or_garbled_rpcs_are_invalid_argument(doors, method, data):
    if method == "Generate":
        check_grpc_answer(*grpc_generate(doors, data, raw=True), raw=True)
    else:
        try:
            doors.raw(method)(data, timeout=30)
        except grpc.RpcError as exc:
            assert exc.code() is grpc.StatusCode.INVALID_ARGUMENT, (exc.code(), exc.details())
            assert exc.details()
    assert_still_serving(doors)


@settings(FUZZ, max_examples=30)
@given(request_id=utf8_text)
def test_abort_and_server_info_answer_any_id(doors, request_id):
    assert not doors.grpc.Abort(pb.AbortRequest(request_id=request_id), timeout=30).aborted
    assert doors.grpc.ServerInfo(pb.ServerInfoRequest(), timeout=30).model


# -- the bugs the fuzzers found, pinned -------------------------------------------------------
def test_a_lone_surrogate_in_a_prompt_is_a_400_naming_the_field(doors):
    for path, body, param in (("/v1/completions", {"prompt": "ok\ud800", "max_tokens": 2}, "prompt"),
                              ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\udfff"}],
                                                        "max_tokens": 2}, "messages")):
        status, answer = doors.post(path, encode(body))
        error = json.loads(answer)["error"]
        assert (status, error["param"]) == (400, param), error
        assert "lone surrogate U+" in error["message"]
    with pytest.raises(RequestError, match="prompt: text holds a lone surrogate U\\+D800 at character 1"):
        doors.backend.engine.prepare_request("direct", "a\ud800", SamplingParams())
    assert_still_serving(doors)


def test_top_k_beyond_int32_is_refused_and_never_fails_another_request(doors):
    """It used to reach the sampler, whose int64 tensor overflowed and failed the whole step: every
    request in the batch ended with an internal error."""
    with pytest.raises(RequestError, match=r"top_k must be .* \[1, 2147483647\], got 10000000000"):
        SamplingParams(top_k=10**10)
    running = doors.grpc.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2, 3]), sampling=pb.SamplingParams(
        max_tokens=40, ignore_eos=True)), timeout=120)
    first = next(running)  # in the engine's batch now
    status, answer = doors.post("/v1/completions", encode({"prompt": "hi", "max_tokens": 2, "top_k": 10**30,
                                                           "temperature": 1.0}))
    assert status == 400 and "top_k" in json.loads(answer)["error"]["message"]
    rest = list(running)
    assert rest[-1].finish_reason == "length"
    assert len(first.token_ids) + sum(len(r.token_ids) for r in rest) == 40
    assert_still_serving(doors)


def test_stop_token_ids_outside_the_vocabulary_are_refused_on_both_doors(doors):
    status, answer = doors.post("/v1/completions", encode({"prompt": "hi", "max_tokens": 2,
                                                           "stop_token_ids": [5, VOCAB, 10**30]}))
    assert status == 400
    assert f"stop_token_ids must be token ids in [0, {VOCAB}); got [{VOCAB}, {10**30}]" in json.loads(answer)["error"][
        "message"]
    code, details, _ = grpc_generate(doors, pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(
        max_tokens=2, stop_token_ids=[2**31 - 1])))
    assert code is grpc.StatusCode.INVALID_ARGUMENT and "stop_token_ids" in details
    assert_still_serving(doors)


def test_a_chat_template_variable_may_be_called_self(doors):
    """Template.render's own first argument is `self`: passed as a keyword it was a TypeError (500)."""
    status, answer = doors.post("/v1/chat/completions", encode({
        "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "chat_template_kwargs": {"self": 1}}))
    assert status == 200, answer
    assert_still_serving(doors)


def test_undecodable_protobuf_is_invalid_argument_naming_the_message(doors):
    bad_utf8_text = b"\x12\x02\xed\xa0"  # GenerateRequest.text holding a lone surrogate's bytes
    for method, data, message in (("Generate", bad_utf8_text, "GenerateRequest"),
                                  ("Generate", b"\xff\xff\xff", "GenerateRequest"),
                                  ("Abort", b"\x0a\x02\xed\xa0", "AbortRequest"),
                                  ("ServerInfo", b"\x0a\x05", "ServerInfoRequest")):
        with pytest.raises(grpc.RpcError) as caught:
            list(doors.raw(method)(data, timeout=30)) if method == "Generate" else doors.raw(method)(data, timeout=30)
        assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert f"is not a valid megainfer.v1.{message}" in caught.value.details()
    assert_still_serving(doors)


def test_a_body_over_the_cap_is_413_declared_or_chunked(doors):
    host, port = doors.endpoints.http.host, doors.endpoints.http.port

    def answer_to(head: bytes, body: list[bytes]) -> tuple[int, dict]:
        """Send a request by hand; the server answers and closes the connection."""
        with socket.create_connection((host, port), timeout=30) as sock:
            sock.sendall(head + b"".join(body))
            reply = b""
            while data := sock.recv(65536):
                reply += data
        head_text, _, payload = reply.partition(b"\r\n\r\n")
        assert b"connection: close" in head_text.lower()
        return int(head_text.split(b" ")[1]), json.loads(payload)

    declared = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Content-Length: {MAX_REQUEST_BYTES + 1}\r\n\r\n").encode()
    status, error = answer_to(declared, [b'{"prompt": "'])  # refused before the rest is sent
    assert status == 413 and error["error"]["code"] == "request_too_large"
    assert f"{MAX_REQUEST_BYTES + 1} bytes; at most {MAX_REQUEST_BYTES} bytes" in error["error"]["message"]

    # No length declared: counted as it comes, refused by the chunk that passes the cap (all of
    # it sent, so the server reads everything before it closes and the answer is not reset away).
    chunked = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               b"Transfer-Encoding: chunked\r\n\r\n")
    chunk = b'{"prompt": "' + b"x" * (1 << 20)
    pieces = [b"%x\r\n%s\r\n" % (len(chunk), chunk)] * (MAX_REQUEST_BYTES // len(chunk) + 1)
    status, error = answer_to(chunked, pieces)
    assert status == 413 and f"more than {MAX_REQUEST_BYTES} bytes" in error["error"]["message"]
    under = encode({"prompt": "hi", "max_tokens": 2, "user": "u" * (MAX_REQUEST_BYTES // 2)})
    assert doors.post("/v1/completions", under)[0] == 200
    assert_still_serving(doors)


def test_a_grpc_message_over_4_mib_is_resource_exhausted_and_a_long_prompt_invalid(doors):
    code, details, _ = grpc_generate(doors, pb.GenerateRequest(text="z" * (5 << 20)))
    assert code is grpc.StatusCode.RESOURCE_EXHAUSTED, details
    code, details, _ = grpc_generate(doors, pb.GenerateRequest(text="z" * (3 << 20)))
    assert code is grpc.StatusCode.INVALID_ARGUMENT and f"max length is {MAX_MODEL_LEN}" in details
    assert_still_serving(doors)


def test_bad_requests_among_good_ones_fail_alone(doors):
    """Good and bad requests on both doors at once: each good one completes, each bad one is a client error."""
    good_http = encode({"prompt": "hi", "max_tokens": 3, "ignore_eos": True})
    bad_http = [encode({"prompt": [VOCAB], "max_tokens": 2}), encode({"prompt": "hi", "top_k": 2**70}),
                encode({"prompt": "hi", "n": 10**9}), b"{", encode({"prompt": "\ud800"})]
    results: dict[str, tuple] = {}

    def run(key: str, call) -> None:
        results[key] = call()

    calls = {f"good-http-{i}": (lambda: doors.post("/v1/completions", good_http)) for i in range(3)}
    calls |= {f"bad-http-{i}": (lambda body=body: doors.post("/v1/completions", body))
              for i, body in enumerate(bad_http)}
    calls |= {f"good-grpc-{i}": (lambda: grpc_generate(doors, pb.GenerateRequest(
        text="hi", sampling=pb.SamplingParams(max_tokens=3, ignore_eos=True)))) for i in range(3)}
    calls["bad-grpc"] = lambda: grpc_generate(doors, pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(
        top_p=math.nan)))
    threads = [threading.Thread(target=run, args=item) for item in calls.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for key, result in results.items():
        if key.startswith("good-http"):
            assert result[0] == 200 and json.loads(result[1])["usage"]["completion_tokens"] == 3, result
        elif key.startswith("bad-http"):
            assert result[0] == 400, result
        elif key.startswith("good-grpc"):
            assert result[0] is grpc.StatusCode.OK and sum(len(r.token_ids) for r in result[2]) == 3, result
        else:
            assert result[0] is grpc.StatusCode.INVALID_ARGUMENT and "top_p" in result[1], result
    assert len(results) == len(calls)
    assert_still_serving(doors)


def test_the_largest_n_completes_and_more_than_the_server_holds_is_429(doors):
    """A batch times n past the in-flight limit is 429, the choices submitted before the refusal
    aborted; n = 128 on one prompt runs, however many KV blocks it waits for."""
    limit = doors.backend.registry.max_open
    prompts = ["hi"] * (limit // 2 + 1)
    status, answer = doors.post("/v1/completions", encode({"prompt": prompts, "n": 2, "max_tokens": 2}))
    assert status == 429 and f"(limit {limit})" in json.loads(answer)["error"]["message"]
    code, details, _ = grpc_generate(doors, pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(n=128)))
    assert code is grpc.StatusCode.OK, details
    assert_still_serving(doors)
