"""One function turns a plan into every node's runtime configuration; the dry run prints it
and fails when the runtime would not reach the plan's predicted batch."""

from __future__ import annotations

import math

import pytest

from deploy.runtime_config import check_batch, runtime_of
from megainfer.errors import PlanError
from megainfer.plan import Plan
from megainfer.presets import PRESETS
from tests.helpers import ROOT, megainfer

PLANS = sorted((ROOT / "deploy" / "plans").glob("*.yaml"))
GPU_PLANS = [p for p in PLANS if not Plan.load(p).is_cpu]


def plan(**scheduler) -> Plan:
    return Plan.from_dict({"model": "tiny-mixtral", "dtype": "bfloat16",
                           "attention": {"gpu": "H20", "tp": 2, "nodes": 1},
                           "experts": {"gpu": "L40S", "tp": 1, "nodes": 2},
                           "pipeline": {"micro_batches": 2, "global_batch": 8},
                           "scheduler": {"max_num_seqs": 8, "max_num_batched_tokens": 64, **scheduler}})


def test_slots_hold_a_layered_cohort_and_each_attention_rank_carries_its_share():
    model = PRESETS["tiny-mixtral"]
    chunked = runtime_of(plan())
    assert chunked.micro_batch_tokens == 64
    share = 64 // 2  # tp 2: each attention rank sends and receives half of a node's tokens
    assert chunked.attention[0].receive_slot_bytes == share * model.hidden_size * 2
    assert chunked.experts[0].receive_slot_bytes == share * (model.hidden_size * 2 + model.top_k * 8)
    layered = runtime_of(plan(prefill_policy="layered", layered_chunk_tokens=4096))
    assert layered.micro_batch_tokens == 8 + 4096  # every decode plus a whole cohort
    assert layered.attention[0].engine.layered_chunk_tokens == 4096
    assert layered.attention[0].receive_slot_bytes == math.ceil(4104 / 2) * model.hidden_size * 2


def test_each_rank_holds_its_share_of_the_kv_heads_and_the_blocks_follow():
    runtime = runtime_of(plan())
    model, engine = runtime.model, runtime.attention[0].engine
    assert runtime.attention[0].kv_heads_per_rank == model.num_kv_heads // 2
    assert runtime.attention[0].ranks == ("attention0", "attention0.1")
    free = 8 << 30
    whole = engine.resolved_num_kv_blocks(model, 1 << 20, free)
    per_rank = engine.resolved_num_kv_blocks(model, 1 << 20, free, tp_size=2)
    assert per_rank // 2 == whole  # a block costs a rank half of what it costs the whole node


def test_devices_a_plan_can_run_on():
    assert runtime_of(plan()).device == "cuda"
    rehearsal = runtime_of(plan(), "cpu")
    assert rehearsal.is_rehearsal and rehearsal.attention[0].engine.device == "cpu"
    cpu_plan = Plan.load(ROOT / "deploy" / "plans" / "tiny-cpu.yaml")
    with pytest.raises(PlanError, match="CPU plan"):
        runtime_of(cpu_plan, "cuda")


def test_the_batch_check_names_the_cap():
    runtime = runtime_of(Plan.from_dict({**plan().to_dict(), "predicted": {"seq_len": 730},
                                         "pipeline": {"micro_batches": 2, "global_batch": 200}}))
    check = check_batch(runtime, 80e9)
    assert check.predicted == 200 and check.decode_budget == 64 and check.runtime_batch == 8
    assert not check.reaches_prediction


@pytest.mark.parametrize("path", PLANS, ids=lambda p: p.stem)
def test_every_shipped_plan_dry_runs_and_a_gpu_plan_reaches_its_predicted_batch(path):
    out = megainfer("deploy", str(path), "--dry-run")
    assert out.returncode == 0, out.stdout + out.stderr
    plan = Plan.load(path)
    for i in range(plan.attention.nodes):
        assert f"attention{i} " in out.stdout
    for k in range(plan.experts.nodes):
        assert f"expert{k} " in out.stdout
    if not plan.is_cpu:
        assert "the runtime reaches the plan" in out.stdout
        assert f"accelerator_type:{plan.attention.gpu}" in out.stdout


def test_a_dry_run_exits_1_when_the_runtime_caps_the_plan(tmp_path):
    capped = Plan.load(GPU_PLANS[0])
    capped.scheduler.max_num_batched_tokens = capped.scheduler.max_num_seqs // 2
    path = capped.save(tmp_path / "capped.yaml")
    out = megainfer("deploy", str(path), "--dry-run")
    assert out.returncode == 1
    assert "scheduler.max_num_batched_tokens >=" in out.stdout


def test_max_model_len_reaches_every_attention_node_and_is_checked():
    capped = Plan.from_dict({**plan().to_dict(), "max_model_len": 1024, "attention": {"gpu": "H20", "tp": 2,
                                                                                       "nodes": 2}})
    runtime = runtime_of(capped)
    assert [a.engine.max_model_len for a in runtime.attention] == [1024, 1024]
    assert runtime.attention[0].engine.resolved_max_model_len(runtime.model) == 1024
    with pytest.raises(PlanError, match="max_model_len 8192 exceeds"):
        runtime_of(Plan.from_dict({**plan().to_dict(), "max_model_len": 8192}))


def test_auto_device_is_the_plans_own_and_engines_are_resolved():
    assert runtime_of(plan(), "auto").device == "cuda"
    cpu = runtime_of(Plan.load(ROOT / "deploy" / "plans" / "tiny-cpu.yaml"), "auto")
    engine = cpu.attention[0].engine
    assert cpu.device == "cpu" and (engine.dtype, engine.device) == (cpu.plan.dtype, "cpu")


def qwen3_30b(attention_tp: int, experts_tp: int) -> Plan:
    """A hand-written Qwen3-30B-A3B plan (4 KV heads, 32 query heads, expert intermediate size 768)."""
    return Plan.from_dict({"model": "qwen3-30b-a3b", "dtype": "bfloat16",
                           "attention": {"gpu": "H20", "tp": attention_tp, "nodes": 2},
                           "experts": {"gpu": "L40S", "tp": experts_tp, "nodes": 16, "experts_per_node": 8}})


def test_a_dry_run_refuses_an_attention_tp_the_kv_heads_do_not_divide(tmp_path):
    path = qwen3_30b(8, 1).save(tmp_path / "qwen3-30b-tp8.yaml")
    out = megainfer("deploy", str(path), "--dry-run")
    assert out.returncode != 0
    assert "attention.tp 8 does not divide qwen3-30b-a3b's 4 KV heads (32 query heads)" in out.stderr
    assert "set attention.tp to 1, 2 or 4" in out.stderr
    assert "Traceback" not in out.stdout + out.stderr


def test_deploy_refuses_an_expert_tp_the_intermediate_size_does_not_divide_before_any_actor():
    from deploy.deployment import Deployment

    bad = qwen3_30b(4, 5)
    message = r"experts\.tp 5 does not divide qwen3-30b-a3b's expert intermediate size 768.*set experts\.tp to " \
              r"1, 2, 3, 4, 6 or 8"
    with pytest.raises(PlanError, match=message):
        runtime_of(bad)  # what --dry-run prints from
    with pytest.raises(PlanError, match=message):
        Deployment(bad)  # the plan is checked in the constructor; Ray and the actors start in start()
    assert runtime_of(qwen3_30b(4, 8)).attention[0].kv_heads_per_rank == 1


def test_each_side_knows_its_m2n_peers_and_their_slots_for_the_rdma_check():
    from deploy.node_link import data_link

    one_expert = Plan.from_dict({**plan().to_dict(), "experts": {"gpu": "L40S", "tp": 1, "nodes": 1},
                                 "transport": {"backend": "auto", "rdma_devices": ["mlx5_1"]}})
    runtime = runtime_of(one_expert)
    a, e = runtime.attention[0], runtime.experts[0]
    assert (a.peers, a.peer_slot_bytes) == (1, e.receive_slot_bytes)  # every expert node
    assert (e.peers, e.peer_slot_bytes) == (2, a.receive_slot_bytes)  # every attention rank (tp 2)
    spec = data_link(one_expert, a, "attention0", 0, b"k" * 32, "127.0.0.1")._spec
    assert (spec["expected_peers"], spec["peer_slot_bytes"], spec["rdma_devices"]) == \
        (1, e.receive_slot_bytes, ("mlx5_1",))
