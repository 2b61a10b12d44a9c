"""The OpenAI-compatible HTTP API in front of a Ray deployment of deploy/plans/tiny-cpu.yaml, driven
by the official `openai` SDK: greedy text equal to the colocated engine's, chat streaming with
n and logprobs, a stop string, errors, a streaming client that leaves freeing its KV blocks,
and /health + the gRPC health service while an expert node is down. One Ray session and one
deployment for the module."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

ray = pytest.importorskip("ray")
openai = pytest.importorskip("openai")

from deploy.cli import max_model_len  # noqa: E402
from deploy.deployment import Deployment  # noqa: E402
from megainfer import Engine, SamplingParams  # noqa: E402
from megainfer.plan import Plan  # noqa: E402
from megainfer.server.endpoints import Endpoints  # noqa: E402
from megainfer.server.served_model import ServedModel  # noqa: E402
from tests.helpers import ROOT  # noqa: E402

NAME = "tiny"
TEMPLATE = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}[assistant] "
PROMPT = "Attention and experts, disaggregated:"


@pytest.fixture(scope="module")
def served():
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    deployment = endpoints = None
    try:
        plan = Plan.load(ROOT / "deploy/plans/tiny-cpu.yaml")
        deployment = Deployment(plan, show_progress=False).start()
        model = ServedModel.load(plan.model, NAME, TEMPLATE, max_model_len(deployment))
        endpoints = Endpoints(deployment, model, port=0, http_port=0).start()
        yield endpoints, deployment
    finally:
        if endpoints is not None:
            endpoints.stop(0)
        if deployment is not None:
            deployment.close()
        ray.shutdown()


@pytest.fixture()
def client(served):
    endpoints, _ = served
    return openai.OpenAI(base_url=endpoints.http_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def kv_in_use(deployment) -> float:
    return max(s.engine.kv_cache_usage for s in deployment.stats())


def test_greedy_completion_equals_the_colocated_engine(client):
    engine = Engine(Plan.load(ROOT / "deploy/plans/tiny-cpu.yaml").model)  # the plan's model (megainfer-demo)
    engine.add_request("cli", PROMPT, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    expected = []
    while engine.has_unfinished_requests():
        expected += [d.new_text for d in engine.step()]
    r = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=10, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == "".join(expected) and r.usage.completion_tokens == 10
    streamed = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=10, temperature=0, stream=True,
                                         extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in streamed) == r.choices[0].text


def test_chat_streams_n_choices_with_logprobs(client):
    messages = [{"role": "user", "content": "Ping-pong pipelines hide"}]
    whole = client.chat.completions.create(model=NAME, messages=messages, max_tokens=6, temperature=0, n=2,
                                           logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    assert [c.index for c in whole.choices] == [0, 1]
    assert whole.choices[0].message.content == whole.choices[1].message.content  # greedy
    assert all(len(c.logprobs.content) == 6 and len(c.logprobs.content[0].top_logprobs) == 2 for c in whole.choices)
    texts = {0: "", 1: ""}
    finished = set()
    for chunk in client.chat.completions.create(model=NAME, messages=messages, max_tokens=6, temperature=0, n=2,
                                                stream=True, extra_body={"ignore_eos": True}):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finished.add(c.index)
    assert finished == {0, 1} and texts[0] == texts[1] == whole.choices[0].message.content


def test_stop_string(client):
    full = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = next(full[i:i + 2] for i in range(2, len(full) - 2) if "\ufffd" not in full[i:i + 2])
    r = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=12, temperature=0, stop=stop,
                                  extra_body={"ignore_eos": True})
    assert (r.choices[0].text, r.choices[0].finish_reason) == (full[:full.index(stop)], "stop")


def test_errors_are_openai_error_objects_and_the_deployment_serves_on(client):
    for status, call in ((404, lambda: client.completions.create(model="other", prompt="hi")),
                         (400, lambda: client.completions.create(model=NAME, prompt="hi", top_p=0)),
                         (400, lambda: client.completions.create(model=NAME, prompt=[1, 10**7], max_tokens=2))):
        with pytest.raises(openai.APIStatusError) as err:
            call()
        assert err.value.status_code == status and err.value.response.json()["error"]["message"]
    assert client.completions.create(model=NAME, prompt="hi", max_tokens=2,
                                     extra_body={"ignore_eos": True}).usage.completion_tokens == 2


def test_a_streaming_client_that_leaves_frees_its_blocks(client, served):
    _, deployment = served
    stream = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=1000, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 2:
            break
    assert kv_in_use(deployment) > 0
    stream.close()
    deadline = time.monotonic() + 30
    while kv_in_use(deployment) > 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert kv_in_use(deployment) == 0


def http_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        json.loads(exc.read())["error"]  # an OpenAI error object
        return exc.code


def test_health_is_503_and_not_serving_while_an_expert_node_is_down(served, client):
    endpoints, deployment = served
    channel = grpc.insecure_channel(endpoints.grpc.address)
    stub = health_pb2_grpc.HealthStub(channel)
    health_url = endpoints.http_url + "/health"

    def wait_for(status: int, state: int, timeout_s: float) -> None:
        """Until HTTP has answered `status` and gRPC `state`, each at least once. The two frontends
        are probed from threads of their own: a short outage shows for about a readiness TTL, and
        on a loaded machine one frontend's slow answer must not use up the other's window."""
        deadline = time.monotonic() + timeout_s
        seen = {"HTTP": False, "gRPC": False}
        probes = {"HTTP": lambda: http_status(health_url) == status,
                  "gRPC": lambda: stub.Check(health_pb2.HealthCheckRequest()).status == state}

        def watch(name: str) -> None:
            while time.monotonic() < deadline and not seen[name]:
                seen[name] = probes[name]()
                time.sleep(0.02)

        watchers = [threading.Thread(target=watch, args=(name,)) for name in probes]
        for w in watchers:
            w.start()
        for w in watchers:
            w.join()
        if not all(seen.values()):
            raise AssertionError(f"health did not become {status} (HTTP seen: {seen['HTTP']}, "
                                 f"gRPC seen: {seen['gRPC']})")

    try:
        wait_for(200, health_pb2.HealthCheckResponse.SERVING, 10)
        ray.kill(deployment.experts[0], no_restart=False)
        wait_for(503, health_pb2.HealthCheckResponse.NOT_SERVING, 30)
        wait_for(200, health_pb2.HealthCheckResponse.SERVING, 120)  # Ray restarts it, the supervisor re-wires
        assert client.completions.create(model=NAME, prompt="back", max_tokens=3,
                                         extra_body={"ignore_eos": True}).usage.completion_tokens == 3
    finally:
        channel.close()
