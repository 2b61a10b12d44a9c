"""Deployments on Ray served over gRPC: token equality with the colocated engine, faults,
disconnects, backpressure, bad requests. One Ray session for the module."""

from __future__ import annotations

import threading
import time

import grpc
import torch
import pytest

ray = pytest.importorskip("ray")

from deploy.deployment import Deployment  # noqa: E402
from deploy.status import kernel_lines  # noqa: E402
from megainfer import Engine, SamplingParams  # noqa: E402
from megainfer.engine_config import EngineConfig  # noqa: E402
from megainfer.errors import MegaInferError  # noqa: E402
from megainfer.plan import Plan  # noqa: E402
from megainfer.server.client import Client, request_message  # noqa: E402
from megainfer.server.service import Server  # noqa: E402
from megainfer.v1 import inference_pb2 as pb  # noqa: E402
from tests.helpers import generate_all  # noqa: E402

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


pytestmark = pytest.mark.usefixtures("ray_session")  # one Ray session for the module (conftest.py)


def make_plan(model: str, attention: int, experts: int, m: int, max_num_seqs: int = 16, tp_a: int = 1,
              policy: str = "chunked", tp_e: int = 1, device_slots: bool = False,
              async_scheduling: bool | None = None, **scheduler) -> Plan:
    return Plan.from_dict({
        "model": model, "dtype": "float32",
        "attention": {"gpu": "cpu", "tp": tp_a, "nodes": attention},
        "experts": {"gpu": "cpu", "tp": tp_e, "nodes": experts},
        "pipeline": {"micro_batches": m, "global_batch": 64, "device_slots": device_slots},
        "scheduler": {"max_num_seqs": max_num_seqs, "max_num_batched_tokens": 64, "prefill_policy": policy,
                      "group_tokens": 8, "async_scheduling": async_scheduling, **scheduler},
    })


class Served:
    def __init__(self, plan: Plan, metrics: bool = False) -> None:
        self.deployment = Deployment(plan, show_progress=False).start()
        self.server = Server(self.deployment, port=0, metrics_port=0 if metrics else None).start()
        self.client = Client(self.server.address)

    def generate(self, prompt, params=GREEDY) -> list[int]:
        return [t for r in self.client.generate(prompt, params) for t in r.token_ids]

    def generate_at_once(self, prompts) -> list[list[int] | None]:
        """Every prompt's tokens, the requests sent together (one thread each)."""
        results = [None] * len(prompts)

        def ask(i):
            results[i] = self.generate(prompts[i])

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        return results

    def close(self) -> None:
        self.client.close()
        self.server.stop(0)
        self.deployment.close()


def colocated(path, prompts) -> list[list[int]]:
    return generate_all(Engine(str(path), EngineConfig(max_num_batched_tokens=64)), prompts, GREEDY)


# The grid: (m, tp_a, policy, tp_e, scheduled_ahead). Mixtral runs four rows by default; the others
# run with -m slow only, each being another row's with one knob the default rows cover (m = 2 at
# tp 1 by the tp 2 rows, m = 3 by m = 2 (and tests/megainfer/test_disagg.py in threads), layered
# at tp 1 by layered at tp 2, synchronous chunked at tp 2 by layered at tp 2, ahead at tp 1 by
# ahead at tp 2). Qwen3-MoE differs from Mixtral inside the halves (q/k norms split by attention
# TP, experts sliced by expert TP), which the knobs do not change: by default it runs the two rows
# that split each half.
GRID = [(1, 1, "chunked", 1, False), (2, 1, "chunked", 1, False), (3, 1, "chunked", 1, False),
        (2, 2, "chunked", 1, False), (2, 1, "chunked", 2, False), (2, 1, "layered", 1, False),
        (2, 2, "layered", 1, False), (2, 1, "chunked", 1, True), (2, 2, "chunked", 1, True)]
DEFAULT_ROWS = {"mixtral": {GRID[0], GRID[4], GRID[6], GRID[8]}, "qwen3_moe": {GRID[4], GRID[6]}}


@pytest.mark.parametrize("hf_ref, m, tp_a, policy, tp_e, scheduled_ahead", [
    pytest.param(family, *row, marks=[] if row in DEFAULT_ROWS[family] else [pytest.mark.slow])
    for family in ("mixtral", "qwen3_moe") for row in GRID], indirect=["hf_ref"])
def test_two_by_two_over_grpc_matches_colocated(hf_ref, m, tp_a, policy, tp_e, scheduled_ahead):
    """`scheduled_ahead`: asynchronous scheduling (a CPU plan's default is off), the deltas of a
    step settled mid-step emitted to the outbox at once; with tp 2 the followers run the step
    the leader scheduled ahead."""
    expected = colocated(hf_ref.path, hf_ref.prompts)
    served = Served(make_plan(str(hf_ref.path), 2, 2, m, tp_a=tp_a, policy=policy, tp_e=tp_e,
                              async_scheduling=scheduled_ahead))
    try:
        assert served.generate_at_once(hf_ref.prompts) == expected
        info = served.client.info()
        assert [n.state for n in info.nodes] == ["serving"] * (2 * tp_a + 2 * tp_e)
        assert "micro_batches: " + str(m) in info.plan_yaml
    finally:
        served.close()


def check_tensor_parallel_family(ref) -> None:
    """A family's tiny checkpoint on Ray over gRPC, 1 attention x 2 expert nodes with tp 2 on both
    sides and layered prefill: the colocated engine's tokens."""
    expected = colocated(ref.path, ref.prompts)
    served = Served(make_plan(str(ref.path), 1, 2, 2, tp_a=2, policy="layered", tp_e=2))
    try:
        assert [served.generate(p) for p in ref.prompts] == expected
        # One at a time, the last two prompts came after those they share a prefix with: both
        # attention ranks read the blocks their leader found cached (prefix caching on).
        engine = served.deployment.metrics_snapshot()
        assert engine.prefix_cache_hits > 0 or served.deployment.model.kv_window
    finally:
        served.close()


def test_tensor_parallel_attention_without_prefix_caching_under_kv_pressure_matches_colocated(mixtral_ref):
    """tp 2 attention ranks with prefix caching off (vLLM's --no-enable-prefix-caching) and too few KV
    blocks for the requests sent at once (preemption by recompute, both ranks on the leader's
    block tables): the colocated engine's tokens, with caching on there."""
    prompts = mixtral_ref.prompts
    expected = colocated(mixtral_ref.path, prompts)
    # 8 blocks of 16 tokens: the longest request needs 5 (33 prompt + 32 new tokens), all seven 29, so any two
    # requests that overlap long enough preempt (with 10, three had to: sent together on a busy machine, the
    # requests can reach the engine too far apart for that).
    served = Served(make_plan(str(mixtral_ref.path), 1, 2, 2, tp_a=2, enable_prefix_caching=False, num_kv_blocks=8))
    try:
        assert served.generate_at_once(prompts) == expected
        engine = served.deployment.metrics_snapshot()
        assert engine.num_preemptions > 0, "the small cache was meant to force preemption"
        assert engine.prefix_cache_queries == engine.prefix_cache_hits == 0  # nothing looked up: caching is off
    finally:
        served.close()


def test_dbrx_with_tensor_parallel_nodes_matches_colocated(dbrx_ref):
    """DBRX on Ray over gRPC with tp 2 on both sides (each attention rank its share of the fused
    Wqkv's heads, each expert rank its slice of every expert's fused rows), layered prefill."""
    check_tensor_parallel_family(dbrx_ref)


@pytest.mark.slow  # ~25 s; DBRX's runs by default, the same path (tests/megainfer/test_disagg.py covers gpt-oss cut)
@pytest.mark.parametrize("gpt_oss_ref", ["gpt_oss"], indirect=True)
def test_gpt_oss_with_tensor_parallel_nodes_matches_colocated(gpt_oss_ref):
    """gpt-oss on Ray over gRPC with tp 2 on both sides (each attention rank its heads' sinks and
    both kinds of layer's caches, each expert rank its slice of the biased, clamped experts,
    the down bias added once), layered prefill."""
    check_tensor_parallel_family(gpt_oss_ref)


@pytest.mark.slow  # ~35 s; DBRX's runs by default (tests/megainfer/test_disagg.py covers DeepSeek cut)
@pytest.mark.parametrize("deepseek_ref", ["deepseek_v3"], indirect=True)
def test_deepseek_with_tensor_parallel_nodes_matches_colocated(deepseek_ref):
    """DeepSeek-V3 on Ray over gRPC with tp 2 on both sides: each attention rank its heads' query
    rows, W_UK and W_UV and the whole latent cache, its slice of the shared and dense FFNs (all-
    reduced); each expert rank its slice of the routed experts of the MoE layers; layered prefill."""
    check_tensor_parallel_family(deepseek_ref)


# The slots are the transport's, whatever the model: Qwen3-MoE's run of it is -m slow only.
@pytest.mark.parametrize("hf_ref", ["mixtral", pytest.param("qwen3_moe", marks=pytest.mark.slow)], indirect=True)
def test_device_slots_match_colocated_and_are_traded_again_after_a_node_is_replaced(hf_ref):
    """Every pair of a 2 x 2 CPU deployment on this host goes direct (/dev/shm regions); after an
    expert node is killed and replaced, the offers are traded again and the tokens still match."""
    expected = colocated(hf_ref.path, hf_ref.prompts)
    served = Served(make_plan(str(hf_ref.path), 2, 2, 2, device_slots=True))
    try:
        assert [served.generate(p) for p in hf_ref.prompts] == expected
        details = {n.name: n.detail for n in served.client.info().nodes}
        assert all("device slots with" in d for d in details.values()), details
        ray.kill(served.deployment.experts[0], no_restart=False)
        tokens, deadline = None, time.monotonic() + 120
        while tokens is None and time.monotonic() < deadline:
            try:
                if all(n.state == "serving" for n in served.client.info().nodes):
                    tokens = served.generate(hf_ref.prompts[0])
            except (grpc.RpcError, MegaInferError):  # a request caught by the failure fails alone
                pass
            time.sleep(0.5)
        assert tokens == expected[0]
    finally:
        served.close()


def test_killed_expert_node_fails_requests_then_comes_back():
    served = Served(make_plan("tiny-mixtral", 1, 2, 2))
    try:
        long = SamplingParams(max_tokens=3000, temperature=0.0, ignore_eos=True)
        stream = served.client.stub.Generate(request_message([1, 2, 3], long))
        next(stream)  # it is running
        ray.kill(served.deployment.experts[1], no_restart=False)
        start = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            for _ in stream:
                pass
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert time.monotonic() - start < 30
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if all(n.state == "serving" for n in served.client.info().nodes):
                break
            time.sleep(0.5)
        tokens = served.generate([4, 5, 6], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
        assert len(tokens) == 5
    finally:
        served.close()


def test_client_disconnect_frees_blocks_and_limits_refuse_overload():
    served = Served(make_plan("tiny-mixtral", 1, 1, 2, max_num_seqs=1))
    try:
        long = SamplingParams(max_tokens=3000, temperature=0.0, ignore_eos=True)
        call = served.client.stub.Generate(request_message([1, 2, 3], long))
        next(call)
        waiting = served.client.stub.Generate(request_message([4, 5], long))  # queued behind it (max_num_seqs 1)
        deadline = time.monotonic() + 20
        while len(served.deployment.registry) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)  # the server has taken both streams
        with pytest.raises(grpc.RpcError) as err:
            next(served.client.stub.Generate(request_message([7, 8], long)))  # 2 open streams is the limit
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        call.cancel()
        waiting.cancel()
        deadline = time.monotonic() + 20
        usage = None
        while time.monotonic() < deadline:
            usage = served.deployment.stats()[0].engine.kv_cache_usage
            if usage == 0.0:
                break
            time.sleep(0.2)
        assert usage == 0.0
    finally:
        served.close()


def test_bad_requests_are_invalid_argument_and_the_server_serves_on():
    served = Served(make_plan("tiny-mixtral", 1, 1, 1))
    try:
        for request in (pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(max_tokens=0)),
                        pb.GenerateRequest(text="x" * 5000),
                        pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 99999])),
                        pb.GenerateRequest()):
            with pytest.raises(grpc.RpcError) as err:
                next(served.client.stub.Generate(request))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert len(served.generate("still here", SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))) == 3
    finally:
        served.close()


def test_metrics_endpoint_of_a_deployment_reports_m2n_latencies():
    from tests.helpers import scrape

    served = Served(make_plan("tiny-mixtral", 1, 1, 2), metrics=True)
    try:
        assert len(served.generate([1, 2, 3, 4])) == GREEDY.max_tokens
        m = scrape(served.server.metrics_port)
        assert m['megainfer:e2e_request_latency_seconds_count{model_name="tiny-mixtral"}'] == 1
        assert m['megainfer:num_requests_running{model_name="tiny-mixtral"}'] == 0
        assert m['megainfer:expert_load_bytes_total{model_name="tiny-mixtral"}'] > 0
        for name in ("megainfer:m2n_send_latency_seconds", "megainfer:m2n_receive_wait_seconds"):
            # every step sends and receives once per (layer, micro-batch): warm-up and this request's steps
            count = m[f'{name}_count{{model_name="tiny-mixtral"}}']
            assert count >= 2 * 4 * GREEDY.max_tokens and m[f'{name}_bucket{{le="+Inf",model_name="tiny-mixtral"}}'] == count
            assert 0 < m[f'{name}_sum{{model_name="tiny-mixtral"}}'] < count  # each well under a second
        # Which implementation the kernels run, as each node decided at its start: on a CPU, the references.
        assert m['megainfer:kernel_mode{mode="reference",model_name="tiny-mixtral"}'] == 1  # the attention node
        assert m['megainfer:kernel_compiles_while_serving_total{model_name="tiny-mixtral"}'] == 0
        lines = kernel_lines(served.deployment.groups)  # what `megainfer deploy` prints at start
        assert any(line.startswith("attention0") and "kernels: reference (cpu tensors" in line for line in lines)
        assert any("expert0" in line and "kernels: reference" in line for line in lines), lines
    finally:
        served.close()


def test_least_loaded_routes_around_a_busy_attention_node():
    plan = make_plan("tiny-mixtral", 2, 1, 1)
    plan.serve.router = "least_loaded"
    served = Served(plan)
    try:
        dep = served.deployment
        assert dep.router.name == "least_loaded"
        params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
        busy = [dep.submit(f"busy{i}", list(range(1, 150)), params, node=0) for i in range(2)]
        fresh = dep.submit("fresh", [1, 2, 3], GREEDY)  # round robin would say node 0: its first routed request
        assert dep.frontend.owner_of("fresh") == 1
        for stream in busy + [fresh]:
            assert stream.wait_finished(60).finished
    finally:
        served.close()


def test_predictive_routes_on_forecasts_and_reports_its_error():
    from tests.helpers import scrape

    plan = make_plan("tiny-mixtral", 2, 1, 1)
    plan.serve.router = "predictive"
    served = Served(plan, metrics=True)
    try:
        dep = served.deployment
        assert dep.router.name == "predictive"
        params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
        # Node 0 gets a queue of prompts (about 40 steps of prefill at 64 tokens a step), node 1
        # nothing.
        busy = [dep.submit(f"busy{i}", [1 + t % 250 for t in range(300)], params, node=0) for i in range(8)]
        # Submission no longer waits for a step: wait for a few of node 0's steps to reach the
        # router, so node 0's queue and its measured steps are in its forecast.
        deadline = time.monotonic() + 30
        while dep.router.models[0].num_samples < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        fresh = dep.submit("fresh", [1, 2, 3], GREEDY)
        assert dep.frontend.owner_of("fresh") == 1
        # The router was told when node 1 took it: the next snapshot asked for after that drops it.
        assert not any(r.reached_at is None for routed in dep.router._routed for r in routed)
        model = dep.router.models[0]
        assert dep.router.forecasts[0] is not None and model.num_samples > 0
        # The nodes step together: one model for both, fitted on their steps, not the warm-up's.
        assert dep.router.models[1] is model and dep.router.forecasts[1].timeline is dep.router.forecasts[0].timeline
        assert model.seconds(64, 1, 64, 64 * 65 / 2) < 1.0
        for stream in busy + [fresh]:
            assert stream.wait_finished(60).finished
        m = scrape(served.server.metrics_port)
        assert m['megainfer:router_ttft_prediction_error_seconds_count{model_name="tiny-mixtral"}'] == 1  # "fresh": the one it placed
        assert 0 <= m['megainfer:router_ttft_prediction_error_seconds_sum{model_name="tiny-mixtral"}'] < 5
        # bench routing: the routers take turns on this deployment, in alternating order.
        from deploy.bench_routing import measure
        from megainfer.tools.bench.routing_load import ServeBenchSpec

        spec = ServeBenchSpec(server="", input_len=40, random_range_ratio=0.5, output_len=4, request_rate=50.0,
                              num_prompts=5)
        rows = measure(dep, served.server, ["round_robin", "predictive"], spec, rounds=2, show_progress=False)
        assert [r["successful_requests"] for r in rows.values()] == [10, 10]
        assert all(len(r["round_p99_ttft_ms"]) == 2 for r in rows.values())
        assert rows["predictive"]["decision_p99_ms"] > 0 and rows["predictive"]["prediction_mae_ms"] is not None
        assert dep.router.name == "round_robin"  # the second round ran predictive first, round_robin last
    finally:
        served.close()


def test_autoscaler_adds_a_replica_on_predicted_ttft_and_retires_it_when_idle():
    from deploy.replicas import ReplicaSet
    from megainfer.routing.autoscale import ScaleAction

    plan = make_plan("tiny-mixtral", 1, 1, 1)
    plan.serve.router = "predictive"
    plan.autoscale = Plan.from_dict({"model": "x", "serve": {"router": "predictive"}, "autoscale": {
        "min_replicas": 1, "max_replicas": 2, "predicted_ttft_s": 0.2, "idle_s": 1.0}}).autoscale
    fleet = ReplicaSet(plan, show_progress=False).start()
    try:
        assert len(fleet.replicas) == 1
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        streams = [fleet.submit(f"r{i}", list(range(1, 200)), params) for i in range(6)]
        added = [e for e in fleet.events if e.action is ScaleAction.ADD]
        # The decision came from predictions, while the queue it foresaw had barely formed.
        assert added and added[0].predicted_ttft_s > 0.2 and added[0].waiting <= 6
        for s in streams:
            assert s.wait_finished(120).finished
        deadline = time.monotonic() + 120
        while not any(e.action is ScaleAction.ADDED for e in fleet.events) and time.monotonic() < deadline:
            time.sleep(0.2)
        # Read from the event, not from the fleet now: idle, the new replica may already be retiring.
        assert [e.replicas for e in fleet.events if e.action is ScaleAction.ADDED] == [2]
        # The new replica serves (the router knows it), then, idle, it retires.
        assert fleet.submit("after", [1, 2, 3], GREEDY).wait_finished(60).finished
        while len(fleet.replicas) > 1 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(fleet.replicas) == 1 and fleet.events[-1].action is ScaleAction.RETIRE
        assert [e.action for e in fleet.events] == [ScaleAction.ADD, ScaleAction.ADDED, ScaleAction.RETIRE]
        assert fleet.submit("last", [4, 5, 6], GREEDY).wait_finished(60).finished
    finally:
        fleet.close()


def test_a_4k_token_prompt_through_a_layered_deployment_matches_colocated():
    """A cohort of 4,088 prompt tokens crosses the transport layer by layer: the slots must hold
    it (they are sized from the layered chunk, not the token budget) and the tokens must equal
    the colocated engine's. 4,088 + 8 new tokens fill tiny-mixtral's 4,096 positions."""
    plan = Plan.from_dict({
        "model": "tiny-mixtral", "dtype": "float32",
        "attention": {"gpu": "cpu", "tp": 1, "nodes": 1}, "experts": {"gpu": "cpu", "tp": 1, "nodes": 1},
        "pipeline": {"micro_batches": 2, "global_batch": 4},
        "scheduler": {"prefill_policy": "layered", "group_tokens": 1024, "max_num_seqs": 4,
                      "max_num_batched_tokens": 64},
    })
    prompt = torch.randint(0, 256, (4088,), generator=torch.Generator().manual_seed(3)).tolist()
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    engine = Engine("tiny-mixtral", EngineConfig(prefill_policy="layered", group_tokens=1024, max_num_seqs=4))
    (expected,) = generate_all(engine, [prompt], params)
    served = Served(plan)
    try:
        assert served.generate(prompt, params) == expected
        assert len(expected) == 8
    finally:
        served.close()
