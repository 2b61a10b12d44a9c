"""plan.yaml: round trip, and errors that name the key."""

from __future__ import annotations

import pytest

from megainfer.errors import PlanError
from megainfer.plan import Plan
from megainfer.presets import PRESETS

GOOD = """
model: mixtral-8x22b
dtype: bfloat16
attention: {gpu: H20, tp: 2, nodes: 8}
experts:   {gpu: L40S, tp: 1, nodes: 8}
pipeline:  {micro_batches: 3, global_batch: 1024}
scheduler: {prefill_policy: layered, group_tokens: 512, max_num_seqs: 256}
slo:       {tbt_ms: 150}
transport: {backend: auto}
serve:     {host: 127.0.0.1, port: 50051, router: round_robin}
predicted: {t_a_ms: 0.1, t_e_ms: 0.2, t_c_ms: 0.05, tbt_ms: 100.0, tokens_per_s: 10.0, tokens_per_s_per_cost: 1.0}
"""


def write(tmp_path, text):
    path = tmp_path / "plan.yaml"
    path.write_text(text)
    return path


def test_design_example_loads_and_round_trips(tmp_path):
    plan = Plan.load(write(tmp_path, GOOD))
    assert plan.attention.nodes == 8 and plan.experts.gpu == "L40S" and plan.slo.tbt_ms == 150.0
    again = Plan.load(plan.save(tmp_path / "again.yaml"))
    assert again == plan
    assert plan.expert_assignment(PRESETS["mixtral-8x22b"]) == [[e] for e in range(8)]


@pytest.mark.parametrize("change, match", [
    (("experts:   {gpu: L40S, tp: 1, nodes: 8}", "experts:   {gpu: L40S, tpp: 1, nodes: 8}"), "unknown key 'experts.tpp'"),
    (("pipeline:  {micro_batches: 3", "pipeline:  {micro_batches: 0"), "pipeline.micro_batches must be positive"),
    (("global_batch: 1024", "global_batch: 2"), "global_batch .2. must be at least pipeline.micro_batches"),
    (("tbt_ms: 150", "tbt_ms: fast"), "slo.tbt_ms must be float"),
    (("port: 50051", "port: 70000"), "serve.port must lie in 1..65535"),
    (("backend: auto", "backend: carrier-pigeon"), "transport.backend 'carrier-pigeon'"),
    (("prefill_policy: layered", "prefill_policy: eager"), "scheduler.prefill_policy 'eager'"),
    (("dtype: bfloat16", "dtype: int4"), "dtype 'int4'"),
    (("model: mixtral-8x22b\n", "modle: mixtral-8x22b\n"), "unknown key 'modle'"),
    (("tp: 2, nodes: 8}", "tp: true, nodes: 8}"), "attention.tp must be int"),
    (("global_batch: 1024}", "global_batch: 1024, device_slots: true}"),
     "pipeline.device_slots serves nodes of tensor-parallel size 1 .attention.tp is 2, experts.tp 1.: set it to false"),
    (("global_batch: 1024}", "global_batch: 1024, device_slots: yes please}"), "pipeline.device_slots must be bool"),
])
def test_bad_plans_name_the_key(tmp_path, change, match):
    with pytest.raises(PlanError, match=match):
        Plan.load(write(tmp_path, GOOD.replace(*change)))


def test_malformed_yaml_names_the_line(tmp_path):
    with pytest.raises(PlanError, match="not valid YAML at line"):
        Plan.load(write(tmp_path, "model: x\nattention: {gpu: H20\n"))


def test_cpu_plans_may_shard_attention_but_not_mix_cpus_and_gpus():
    assert Plan.from_dict({"model": "tiny-mixtral", "attention": {"gpu": "cpu", "tp": 2}}).attention.tp == 2
    with pytest.raises(PlanError, match="both be 'cpu' or both name GPU types"):
        Plan.from_dict({"model": "tiny-mixtral", "attention": {"gpu": "H20"}, "experts": {"gpu": "cpu"}})


def test_expert_nodes_must_cover_the_experts():
    plan = Plan.from_dict({"model": "tiny-mixtral", "experts": {"gpu": "cpu", "nodes": 3}})
    with pytest.raises(PlanError, match="experts.nodes .3. must divide the model's 8 experts"):
        plan.check_model(PRESETS["tiny-mixtral"])
    plan = Plan.from_dict({"model": "tiny-mixtral", "experts": {"gpu": "cpu", "nodes": 2, "experts_per_node": 3}})
    with pytest.raises(PlanError, match="2 x 3 = 6, but the model has 8 experts"):
        plan.check_model(PRESETS["tiny-mixtral"])


def test_max_model_len_is_a_checked_top_level_key(tmp_path):
    plan = Plan.load(write(tmp_path, GOOD + "max_model_len: 8192\n"))
    assert plan.max_model_len == 8192
    assert Plan.load(plan.save(tmp_path / "again.yaml")) == plan
    assert "max_model_len" not in Plan.load(write(tmp_path, GOOD)).to_yaml()  # unset: left out
    for value, match in (("0", "max_model_len must be positive"), ("long", "max_model_len must be int"),
                         ("true", "max_model_len must be int")):
        with pytest.raises(PlanError, match=match):
            Plan.load(write(tmp_path, GOOD + f"max_model_len: {value}\n"))
    too_long = Plan.load(write(tmp_path, GOOD + "max_model_len: 65537\n"))
    with pytest.raises(PlanError, match=r"max_model_len 65537 exceeds the model's max_position_embeddings \(65536\)"):
        too_long.check_model(PRESETS["mixtral-8x22b"])


def test_rdma_devices_is_a_checked_list_left_out_when_unset(tmp_path):
    plan = Plan.load(write(tmp_path, GOOD.replace("transport: {backend: auto}",
                                                  "transport: {backend: rdma, rdma_devices: [mlx5_0, mlx5_2]}")))
    assert plan.transport.rdma_devices == ["mlx5_0", "mlx5_2"]
    assert Plan.load(plan.save(tmp_path / "again.yaml")) == plan
    assert "rdma_devices" not in Plan.load(write(tmp_path, GOOD)).to_yaml()  # unset: written plans unchanged
    for bad, match in (("rdma_devices: mlx5_0", "transport.rdma_devices must be list, got 'mlx5_0'"),
                       ("rdma_devices: ['']", r"transport.rdma_devices must list verbs device names"),
                       ("rdma_device: [mlx5_0]", "unknown key 'transport.rdma_device'")):
        with pytest.raises(PlanError, match=match):
            Plan.load(write(tmp_path, GOOD.replace("transport: {backend: auto}", f"transport: {{{bad}}}")))
