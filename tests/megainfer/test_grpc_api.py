"""The gRPC API with every sampling field: round trips, the model's defaults, n completions on
one stream, logprobs, stop strings, status codes, aborts and the metrics of each engine request."""

from __future__ import annotations

import math
import time

import grpc
import pytest

from megainfer import LLM, Engine, SamplingParams
from megainfer.engine_config import EngineConfig
from megainfer.errors import DataPlaneError, Overloaded
from megainfer.messages import ErrorCode, RequestDelta
from megainfer.server.client import Client, request_message
from megainfer.server.engine_backend import EngineBackend
from megainfer.server.metrics import ServingMetrics
from megainfer.server.served_model import ServedModel
from megainfer.server.service import MODEL_DEFAULTED, Server, sampling_params
from megainfer.v1 import inference_pb2 as pb
from megainfer.v1 import inference_pb2_grpc as pb_grpc

EVERY_FIELD = SamplingParams(max_tokens=3, temperature=0.7, top_k=5, top_p=0.9, min_p=0.05, seed=11, n=2,
                             presence_penalty=0.5, frequency_penalty=-0.25, repetition_penalty=1.1, min_tokens=1,
                             stop=["never", "nor this"], stop_token_ids=[4, 9], include_stop_str_in_output=True,
                             ignore_eos=True, logprobs=3, prompt_logprobs=1, skip_special_tokens=False)
SAMPLED = SamplingParams(max_tokens=6, temperature=1.0, seed=3, n=2, ignore_eos=True)


class Backend:
    """The engine's backend, recording what each engine request was submitted with, and able to
    refuse a request or fail it once it runs."""

    def __init__(self, inner: EngineBackend) -> None:
        self.inner = inner
        self.submitted: dict[str, SamplingParams] = {}
        self.refuse: dict[str, Exception] = {}  # engine request id -> what its submit raises
        self.fail: dict[str, RequestDelta] = {}  # engine request id -> the failure it ends with
        # Engine request ids whose abort loses the race with the request's own end, as a deployment's
        # can: the backend forgets the stream (its last delta never comes) and answers False.
        self.abort_too_late: set[str] = set()

    def submit(self, request_id, prompt, params):
        if request_id in self.refuse:
            raise self.refuse[request_id]
        stream = self.inner.submit(request_id, prompt, params)
        self.submitted[request_id] = params
        if request_id in self.fail:
            self.inner.abort(request_id)
            stream.put(self.fail[request_id])
        return stream

    def abort(self, request_id):
        if request_id in self.abort_too_late:
            self.inner.abort(request_id)
            return False
        return self.inner.abort(request_id)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.fixture(scope="module")
def backend():
    inner = EngineBackend(Engine("tiny-mixtral", EngineConfig(num_kv_blocks=64)))
    yield Backend(inner)
    inner.close()


@pytest.fixture()
def serve(backend):
    """serve(defaults=None) -> a started server over the module's engine, its own metrics."""
    servers = []

    def start(defaults: dict | None = None) -> Server:
        served = None if defaults is None else ServedModel("tiny", "tiny-mixtral", None, None, defaults)
        server = Server(backend, port=0, metrics=ServingMetrics(backend, "tiny"), served=served).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop(0)
    backend.refuse.clear()
    backend.fail.clear()
    backend.abort_too_late.clear()


def stub(server: Server) -> pb_grpc.InferenceStub:
    return pb_grpc.InferenceStub(grpc.insecure_channel(server.address))


def by_index(responses) -> dict[int, list[pb.GenerateResponse]]:
    out: dict[int, list[pb.GenerateResponse]] = {}
    for r in responses:
        out.setdefault(r.index, []).append(r)
    return out


def idle(backend: Backend, within_s: float = 5.0) -> bool:
    """Every engine request ended and its stream closed, within `within_s`."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        stats = backend.inner.engine.stats()
        if len(backend.inner.registry) == 0 and stats.num_running == 0 and stats.num_waiting == 0:
            return True
        time.sleep(0.05)
    return False


def counter(server: Server, name: str, **labels) -> float:
    return server.metrics.registry.get_sample_value(name, {"model_name": "tiny", **labels}) or 0.0


def test_every_sampling_field_round_trips(serve, backend):
    assert sampling_params(request_message("x", EVERY_FIELD).sampling) == EVERY_FIELD
    client = Client(serve().address)
    responses = list(client.generate([5, 6, 7], EVERY_FIELD, request_id="every"))
    client.close()
    assert backend.submitted["every-0"] == EVERY_FIELD.for_choice(0)
    assert backend.submitted["every-1"] == EVERY_FIELD.for_choice(1).replace(prompt_logprobs=None)
    assert sorted(by_index(responses)) == [0, 1]


def test_unset_fields_take_the_models_defaults_then_the_apis(serve, backend):
    model = {"temperature": 0.5, "top_k": 7, "top_p": 0.8, "min_p": 0.1, "repetition_penalty": 1.2, "max_tokens": 2}
    for server, want in ((serve(model), model), (serve(), {"temperature": 0.0, "max_tokens": 16})):
        client = Client(server.address)
        rid = f"defaults-{server.port}"
        list(client.generate([1, 2], SamplingParams(ignore_eos=True), request_id=rid, server_defaults=MODEL_DEFAULTED))
        client.close()
        got = backend.submitted[f"{rid}-0"]  # the engine's id: the API id and the index
        expected = SamplingParams(**{**{"temperature": 0.0, "max_tokens": 16}, **want}, ignore_eos=True)
        assert got == expected
    # A request's own value wins over the model's.
    client = Client(serve(model).address)
    list(client.generate([1, 2], SamplingParams(max_tokens=1, temperature=0.0), request_id="own"))
    assert (backend.submitted["own-0"].max_tokens, backend.submitted["own-0"].temperature) == (1, 0.0)
    client.close()


def test_n_completions_interleave_on_one_stream(serve):
    server = serve()
    client = Client(server.address)
    prompt = [3, 1, 4, 1, 5]
    responses = list(client.generate(prompt, SAMPLED, request_id="pair"))
    client.close()
    choices = by_index(responses)
    tokens = {i: [t for r in rs for t in r.token_ids] for i, rs in choices.items()}
    assert sorted(tokens) == [0, 1] and all(len(t) == 6 for t in tokens.values()) and tokens[0] != tokens[1]
    # Each completion is what the offline API gives for the same request.
    want = LLM("tiny-mixtral", num_kv_blocks=64).generate(prompt, SAMPLED)[0].outputs
    assert [tokens[0], tokens[1]] == [c.token_ids for c in want]
    indices = [r.index for r in responses]
    assert indices.index(1) < len(indices) - 1 - indices[::-1].index(0)  # interleaved, not one after the other
    for rs in choices.values():
        assert [r.finish_reason for r in rs] == [""] * (len(rs) - 1) + ["length"]
    assert all(r.request_id == "pair" for r in responses)
    assert [r.HasField("usage") for r in responses] == [False] * (len(responses) - 1) + [True]
    assert (responses[-1].usage.prompt_tokens, responses[-1].usage.completion_tokens) == (5, 12)
    assert 0 < responses[-1].timings.ttft_ms <= responses[-1].timings.e2e_ms
    assert counter(server, "megainfer:request_success_total", finished_reason="length") == 2
    assert counter(server, "megainfer:generation_tokens_total") == 12


def test_logprobs_come_per_token_and_prompt_logprobs_first(serve):
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, n=2, logprobs=2, prompt_logprobs=1)
    prompt = [9, 8, 7, 6]
    client = Client(serve().address)
    responses = list(client.generate(prompt, params))
    client.close()
    assert len(responses[0].prompt_logprobs) == 3 and not any(r.prompt_logprobs for r in responses[1:])
    assert [p.token_id for p in responses[0].prompt_logprobs] == prompt[1:]
    assert all(len(p.top) == 1 and p.top[0].rank == 1 for p in responses[0].prompt_logprobs)
    want = LLM("tiny-mixtral", num_kv_blocks=64).generate(prompt, params)[0]
    for index, rs in by_index(responses).items():
        positions = [p for r in rs for p in r.logprobs]
        assert [p.token_id for p in positions] == [t for r in rs for t in r.token_ids]
        assert all(len(p.token_ids) == len(p.logprobs) for p in rs)
        expected = want.outputs[index].logprobs
        for got, position in zip(positions, expected):
            assert got.logprob == pytest.approx(position[got.token_id].logprob, abs=1e-5)
            assert got.rank == position[got.token_id].rank == 1  # greedy
            assert [t.rank for t in got.top] == [1, 2] and got.top[0].token_id == got.token_id
            assert got.top[1].logprob <= got.top[0].logprob <= 0
    assert [p.token_id for p in responses[0].prompt_logprobs] == [next(iter(p)) for p in want.prompt_logprobs[1:]]


def test_stop_string_ends_a_completion(serve):
    client = Client(serve().address)
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    full = "".join(r.text for r in client.generate("abc", greedy))
    stop = "++"
    assert stop in full, full
    responses = list(client.generate("abc", greedy.replace(stop=[stop])))
    client.close()
    assert "".join(r.text for r in responses) == full[:full.index(stop)]
    last = responses[-1]
    assert last.finish_reason == "stop" and last.WhichOneof("stop_reason") == "stop_string" and last.stop_string == stop


@pytest.mark.parametrize("sampling, field", [
    (pb.SamplingParams(temperature=math.nan), "temperature"),
    (pb.SamplingParams(max_tokens=-1), "max_tokens"),
    (pb.SamplingParams(stop=[f"s{i}" for i in range(1000)]), "stop"),
    (pb.SamplingParams(n=0), "n"),
    (pb.SamplingParams(logprobs=21), "logprobs"),
    (pb.SamplingParams(seed=2**63), "seed"),
    (pb.SamplingParams(top_p=0.0), "top_p"),
    (pb.SamplingParams(presence_penalty=3.0), "presence_penalty"),
])
def test_bad_values_are_invalid_argument_and_the_server_serves_on(serve, backend, sampling, field):
    server = serve()
    with pytest.raises(grpc.RpcError) as info:
        list(stub(server).Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2]), sampling=sampling)))
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT and info.value.details().split()[0] == field
    good = list(stub(server).Generate(pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(max_tokens=2))))
    assert sum(len(r.token_ids) for r in good) == 2 and idle(backend)


@pytest.mark.parametrize("error, code", [
    (Overloaded("42 requests in flight"), grpc.StatusCode.RESOURCE_EXHAUSTED),
    (DataPlaneError("re-wiring"), grpc.StatusCode.UNAVAILABLE),
    (RuntimeError("a bug"), grpc.StatusCode.INTERNAL),
])
def test_a_refused_completion_refuses_the_request_and_withdraws_the_others(serve, backend, error, code):
    server = serve()
    backend.refuse["refused-1"] = error
    params = SamplingParams(max_tokens=50, ignore_eos=True, n=3)
    with pytest.raises(grpc.RpcError) as info:
        list(stub(server).Generate(request_message([1, 2, 3], params, "refused")))
    assert info.value.code() is code and str(error) in info.value.details()
    assert "refused-0" in backend.submitted and idle(backend)


@pytest.mark.parametrize("code, status", [(ErrorCode.UNAVAILABLE, grpc.StatusCode.UNAVAILABLE),
                                          (ErrorCode.INTERNAL, grpc.StatusCode.INTERNAL)])
def test_a_failed_completion_fails_the_call_and_aborts_the_others(serve, backend, code, status):
    server = serve()
    backend.fail["failing-1"] = RequestDelta.failure("failing-1", "its node died", code)
    params = SamplingParams(max_tokens=200, ignore_eos=True, n=2)
    with pytest.raises(grpc.RpcError) as info:
        list(stub(server).Generate(request_message([1, 2, 3], params, "failing")))
    assert info.value.code() is status and "completion 1: its node died" in info.value.details()
    assert idle(backend)
    assert counter(server, "megainfer:request_failure_total", error_code=code.value) == 1
    assert counter(server, "megainfer:request_success_total", finished_reason="abort") == 1


def test_client_leaving_aborts_every_completion(serve, backend):
    server = serve()
    call = stub(server).Generate(request_message([1, 2, 3], SamplingParams(max_tokens=400, ignore_eos=True, n=2),
                                                 "leaving"))
    next(call)
    call.cancel()
    assert idle(backend)
    deadline = time.monotonic() + 5
    while counter(server, "megainfer:request_success_total", finished_reason="abort") < 2 \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    assert counter(server, "megainfer:request_success_total", finished_reason="abort") == 2


def test_abort_ends_every_completion_with_abort(serve, backend):
    server = serve()
    rpc = stub(server)
    call = rpc.Generate(request_message([1, 2, 3], SamplingParams(max_tokens=400, ignore_eos=True, n=2), "stopme"))
    first = next(call)
    assert rpc.Abort(pb.AbortRequest(request_id="stopme")).aborted
    rest = [first, *call]
    finals = {r.index: r.finish_reason for r in rest if r.finish_reason}
    assert finals == {0: "abort", 1: "abort"} and rest[-1].HasField("usage")
    assert not rpc.Abort(pb.AbortRequest(request_id="stopme")).aborted and idle(backend)


def test_an_abort_that_loses_the_race_with_the_end_still_ends_the_stream(serve, backend):
    """The backend forgot the request and its last delta never comes: the stream ends with
    "abort" rather than waiting forever (seen in the chaos soak as a request without an end)."""
    server = serve()
    rpc = stub(server)
    backend.abort_too_late.add("late-0")
    call = rpc.Generate(request_message([1, 2, 3], SamplingParams(max_tokens=400, ignore_eos=True), "late"),
                        timeout=20)
    first = next(call)
    assert not rpc.Abort(pb.AbortRequest(request_id="late")).aborted  # too late: nothing was running to stop
    rest = [first, *call]
    assert rest[-1].finish_reason == "abort" and rest[-1].HasField("usage")
    assert idle(backend)


def test_cached_prompt_tokens_come_in_the_usage_and_cache_salt_keeps_requests_apart(serve):
    server = serve()
    client = Client(server.address)
    prompt = list(range(7, 47))  # 40 tokens: two full blocks of 16 reusable
    params = SamplingParams(max_tokens=2, temperature=0.0)
    usages = [list(client.generate(prompt, p))[-1].usage
              for p in (params, params, params.replace(cache_salt="tenant-b"))]
    client.close()
    assert [u.cached_tokens for u in usages] == [usages[0].cached_tokens, 32, 0]
    assert all(u.prompt_tokens == 40 for u in usages)


def test_reset_prefix_cache_empties_the_cache_and_says_why_where_it_cannot(serve, backend, monkeypatch):
    server = serve()
    client = Client(server.address)
    prompt = list(range(50, 90))
    params = SamplingParams(max_tokens=2, temperature=0.0)
    list(client.generate(prompt, params))
    assert list(client.generate(prompt, params))[-1].usage.cached_tokens == 32
    client.reset_prefix_cache()
    assert list(client.generate(prompt, params))[-1].usage.cached_tokens == 0  # computed whole again
    rpc = stub(server)
    monkeypatch.setattr(backend, "reset_prefix_cache", lambda: False)  # caching off
    with pytest.raises(grpc.RpcError) as info:
        rpc.ResetPrefixCache(pb.ResetPrefixCacheRequest())
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "prefix caching is off on this server" in info.value.details()

    def unreachable():
        raise DataPlaneError("attention1 did not answer")

    monkeypatch.setattr(backend, "reset_prefix_cache", unreachable)
    with pytest.raises(grpc.RpcError) as info:
        rpc.ResetPrefixCache(pb.ResetPrefixCacheRequest())
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE and "attention1 did not answer" in info.value.details()
    monkeypatch.undo()
    assert list(client.generate([5, 6, 7], params))[-1].finish_reason == "length"  # and it serves on
    client.close()
