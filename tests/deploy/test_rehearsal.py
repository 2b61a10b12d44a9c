"""The cluster rehearsal: a heterogeneous GPU plan deployed with CPU tensors (`--device cpu`) on
a local two-host Ray cluster that declares the plan's GPUs and GPU types. Every rank must land
on a host of its side's type with a GPU of its own, and the answers over gRPC must equal the
colocated engine's. One Ray cluster for the module."""

from __future__ import annotations

import time

import pytest

ray = pytest.importorskip("ray")

from ray.cluster_utils import Cluster  # noqa: E402

from deploy.deployment import Deployment  # noqa: E402
from megainfer import Engine, SamplingParams  # noqa: E402
from megainfer.engine_config import EngineConfig  # noqa: E402
from megainfer.errors import PlanError  # noqa: E402
from megainfer.plan import Plan  # noqa: E402
from megainfer.server.client import Client  # noqa: E402
from megainfer.server.service import Server  # noqa: E402
from tests.helpers import generate_all  # noqa: E402

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def cluster():
    """A head without GPUs, an "H20" host and an "L40S" host with two GPUs each, as
    `ray start --num-gpus 2 --resources '{"accelerator_type:H20": 1}'` would declare them."""
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    cluster.add_node(num_cpus=2, num_gpus=2, resources={"accelerator_type:H20": 1})
    cluster.add_node(num_cpus=2, num_gpus=2, resources={"accelerator_type:L40S": 1})
    ray.init(address=cluster.address, log_to_driver=False)
    cluster.wait_for_nodes()
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def heterogeneous_plan(path, attention_nodes: int = 1) -> Plan:
    return Plan.from_dict({
        "model": str(path), "dtype": "float32",
        "attention": {"gpu": "H20", "tp": 2, "nodes": attention_nodes},
        "experts": {"gpu": "L40S", "tp": 2, "nodes": 1},
        "pipeline": {"micro_batches": 2, "global_batch": 16},
        "scheduler": {"max_num_seqs": 8, "max_num_batched_tokens": 64},
    })


def colocated(path, prompts) -> list[list[int]]:
    return generate_all(Engine(str(path), EngineConfig(max_num_batched_tokens=64)), prompts, GREEDY)


def test_heterogeneous_plan_rehearsed_on_cpus_lands_by_gpu_type_and_matches_colocated(cluster, mixtral_ref):
    expected = colocated(mixtral_ref.path, mixtral_ref.prompts)
    deployment = Deployment(heterogeneous_plan(mixtral_ref.path), show_progress=False, device="cpu").start()
    try:
        placed = deployment.group.placements()
        by_type = {"attention": "H20", "expert": "L40S"}
        assert len(placed) == 4
        for rank in placed:
            assert rank.accelerator_type == by_type["attention" if rank.name.startswith("attention") else "expert"]
            assert len(rank.gpu_ids) == 1, f"{rank.name} should hold one GPU of its node's bundle"
        for node in ("attention0", "expert0"):  # a node's ranks share its host and hold distinct GPUs
            ranks = [r for r in placed if r.name.split(".")[0] == node]
            assert len({r.node_id for r in ranks}) == 1
            assert len({r.gpu_ids[0] for r in ranks}) == 2
        server = Server(deployment, port=0).start()
        client = Client(server.address)
        try:
            answers = [[t for r in client.generate(p, GREEDY) for t in r.token_ids] for p in mixtral_ref.prompts]
        finally:
            client.close()
            server.stop(0)
        assert answers == expected
    finally:
        deployment.close()


def test_a_plan_the_cluster_cannot_place_fails_before_any_actor_starts(cluster, mixtral_ref):
    """Two H20 attention nodes of tp 2 need four H20 GPUs; the cluster has two."""
    all_free(timeout_s=30)  # an earlier test's placement group is removed asynchronously
    with pytest.raises(PlanError, match=r"H20 GPUs \(needs 4, its hosts have 2\)"):
        Deployment(heterogeneous_plan(mixtral_ref.path, attention_nodes=2), show_progress=False, device="cpu").start()
    assert ray.available_resources().get("GPU", 0) == 4  # no placement group or actor holds any


def all_free(timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while ray.available_resources().get("GPU", 0) < 4:
        assert time.monotonic() < deadline, f"GPUs still held: {ray.available_resources()}"
        time.sleep(0.2)


def test_gpu_types_are_counted_per_host_type():
    from deploy.placement import gpu_type_shortfalls

    plan = Plan.from_dict({"model": "tiny-mixtral", "attention": {"gpu": "H20", "tp": 4, "nodes": 1},
                           "experts": {"gpu": "L40S", "tp": 1, "nodes": 2}})
    h20_pair = [{"GPU": 2.0, "accelerator_type:H20": 1.0}, {"GPU": 2.0, "accelerator_type:H20": 1.0}]
    l40s = [{"GPU": 8.0, "accelerator_type:L40S": 1.0}]
    assert gpu_type_shortfalls(plan, [{"GPU": 4.0, "accelerator_type:H20": 1.0}] + l40s) == []
    # four H20 GPUs in all, but a tp-4 node's ranks must share one host
    assert gpu_type_shortfalls(plan, h20_pair + l40s) == ["a host with 4 H20 GPUs for a tp-4 node (the largest has 2)"]
    # one GPU type for both sides: the attention side's tp-4 node still needs a 4-GPU host
    homogeneous = Plan.from_dict({"model": "tiny-mixtral", "attention": {"gpu": "H800", "tp": 4, "nodes": 1},
                                  "experts": {"gpu": "H800", "tp": 1, "nodes": 2}})
    assert gpu_type_shortfalls(homogeneous, [{"GPU": 1.0, "accelerator_type:H800": 1.0}] * 8) == [
        "a host with 4 H800 GPUs for a tp-4 node (the largest has 1)"]
    # eight GPUs, none of them L40S
    assert gpu_type_shortfalls(plan, [{"GPU": 8.0, "accelerator_type:H20": 1.0}]) == [
        "L40S GPUs (needs 2, its hosts have 0)"]
