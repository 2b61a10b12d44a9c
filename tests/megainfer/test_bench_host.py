"""`megainfer bench host PLAN`: the host's CPU time per M2N round through the real runner and
expert worker (compute stubbed), at a plan's scale; here a small CPU plan, few rounds."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from megainfer.plan import Plan
from megainfer.tools.host_cost import beside_stall, routed_share, scale_of
from megainfer.tools.step_boundary import context_lengths
from tests.helpers import ROOT, megainfer

PLAN_235B = ROOT / "deploy" / "plans" / "qwen3-235b-h20-l40s.yaml"


def test_the_plans_scale_is_read_as_the_host_sees_it():
    scale = scale_of(Plan.load(PLAN_235B))
    assert (scale.expert_nodes, scale.attention_ranks, scale.micro_batches, scale.layers) == (32, 20, 4, 94)
    assert scale.rounds_per_step == 376 and scale.experts_per_node == 4
    # 4 of 128 experts on a node, top-8: 1 - C(124, 8) / C(128, 8) of a rank's tokens reach it.
    assert math.isclose(routed_share(128, 4, 8), 1 - math.comb(124, 8) / math.comb(128, 8))
    assert 20 <= scale.tokens_per_peer <= 40  # ~29 tokens of 8,256-byte records: ~230 KiB per message


def test_the_work_beside_the_layers_is_priced_against_one_layers_device_time():
    """On a GPU plan, each piece of the work beside the layers (one after each layer's dispatches)
    stalls the pipeline for at least what it takes beyond one layer's device time (m x
    max(t_a, t_e)); the pieces within it cost nothing."""
    scale = scale_of(Plan.load(PLAN_235B))  # m = 4, t_a 0.268 ms > t_e
    layer = 4 * max(scale.t_a_ms, scale.t_e_ms)
    stall = beside_stall([0.9, 0.8, 2.0, 1.5], scale, 126.9)
    assert math.isclose(stall["stall_ms"], (2.0 - layer) + (1.5 - layer)) and stall["largest_ms"] == 2.0
    assert "at least" in stall["line"] and "of the predicted 126.9 ms step" in stall["line"]
    assert beside_stall([0.5, 0.9], scale, 126.9)["stall_ms"] == 0.0  # each within a layer: hidden
    assert math.isclose(beside_stall([4.6], scale, 126.9)["stall_ms"], 4.6 - layer)  # one piece: as before
    unpredicted = dataclasses.replace(scale, t_a_ms=0.0, t_e_ms=0.0)
    assert beside_stall([4.6], unpredicted, 0.0) == {}


def test_the_boundarys_sequences_take_new_blocks_a_sixteenth_at_a_time():
    """As in steady serving, where lengths are spread: each decode step the same share of the
    running sequences fills its last KV block, not all of them in one step."""
    lengths = context_lengths(2290, 730, 16)
    assert len(lengths) == 2290 and abs(sum(lengths) / len(lengths) - 730) < 1
    crossing = [sum((n + step) % 16 == 0 for n in lengths) for step in range(16)]
    assert max(crossing) - min(crossing) <= 1 and sum(crossing) == 2290


def test_bench_host_measures_both_sides_at_both_sizes(tmp_path):
    path = tmp_path / "host.json"
    out = megainfer("bench", "host", str(ROOT / "deploy" / "plans" / "tiny-cpu-2a.yaml"), "--rounds", "20",
                    "--repeats", "1", "--json", str(path), timeout=600)
    assert out.returncode == 0, out.stderr
    assert "CPU us/round" in out.stdout and "attention  python" in out.stdout and "expert     python" in out.stdout
    assert "attention    core" in out.stdout and "expert       core" in out.stdout
    result = json.loads(path.read_text())
    for key in ("attention_round_cpu_us", "expert_round_cpu_us", "attention_round_cpu_us_plan_size",
                "expert_round_cpu_us_plan_size"):
        for path_name in ("core", "python"):  # both measured in the same run, against the same peers
            cost = result[key][path_name]
            assert cost["path"] == path_name and cost["cpu_us"] > 0 and cost["wall_us"] > 0 and cost["peers"] >= 1, key
    assert result["attention_round_cpu_us"]["python"]["message_bytes"] == 4096
    # The load round: tiny-cpu-2a's one expert node, 4 layers x 8 rows (the demo model's every expert).
    assert "load round, once per step" in out.stdout
    load = result["load_round_us"]
    assert load["expert_nodes"] == 1 and load["entries_per_node"] == 32
    assert load["expert_step_us"] > 0 and load["attention_collect_us"] > 0
    # The step boundary at 512, 1,024 and the plan's max_num_seqs, and the driver's share.
    assert "step boundary of one attention rank" in out.stdout and "driver:" in out.stdout
    assert result["step_boundary_cpu_ms"] > 0 and result["driver_delta_cpu_ms"] > 0
    # Measured on its own (from a step's last answer to the next one's first inputs), the wait
    # holds part of the node loop's turn, outside any step: about the step's size at most here.
    assert 0 < result["boundary_wait_ms"] <= 2 * result["step_boundary_cpu_ms"]
    by_running = result["step_boundary_by_running"]
    assert {"512", "1024"} <= set(by_running)
    phases = ("prepare", "sample", "beside", "bookkeeping", "deltas_out")
    assert all(row["total"] == pytest.approx(sum(row[k] for k in phases)) for row in by_running.values())
    # A CPU plan schedules synchronously (its default): nothing runs beside the layers.
    assert "synchronous scheduling" in out.stdout and all(row["beside"] < 0.1 for row in by_running.values())
    # Launches per (layer, micro-batch), counted by the dispatcher on the plan's family.
    launches = result["launches_per_layer_micro_batch"]
    assert launches["attention"]["launches"] > launches["expert"]["launches"] > 0
    assert "launches per (layer, micro-batch)" in out.stdout


@pytest.mark.slow
def test_on_the_235b_plan_the_core_is_several_times_cheaper_than_the_python_path(tmp_path):
    """The issue's bar is <= 60 us per round on both sides (docs/benchmarks.md records the
    figures); what a shared, noisy CI machine can hold to is the ratio, measured in one run."""
    path = tmp_path / "host.json"
    out = megainfer("bench", "host", str(PLAN_235B), "--rounds", "600", "--json", str(path), timeout=900)
    assert out.returncode == 0, out.stderr
    result = json.loads(path.read_text())
    for key in ("attention_round_cpu_us", "expert_round_cpu_us"):
        assert result[key]["core"]["cpu_us"] * 3 < result[key]["python"]["cpu_us"], result[key]


def test_rounds_over_tcp_are_measured_on_both_paths_against_the_cores_tcp_peers():
    """`bench host --backend tcp`'s rows: the runner's and the expert worker's rounds over tcp
    loopback, the compiled core's and the reference's, against the core's tcp stand-in peers."""
    from megainfer.tools.host_cost import hidden_for_record, measure_attention, measure_expert

    scale = scale_of(Plan.load(ROOT / "deploy" / "plans" / "tiny-cpu-2a.yaml"))
    hidden = hidden_for_record(4096, scale.top_k)
    for measure, count in ((measure_attention, 20), (measure_expert, 5)):
        for core, path in (("on", "core"), ("off", "python")):
            cost = measure(scale, hidden, 1, count, core, "tcp")
            assert cost.path == path and cost.cpu_us > 0 and cost.message_bytes == 4096 and cost.peers >= 1


@pytest.mark.slow
def test_on_the_235b_plan_over_tcp_the_core_is_several_times_cheaper_than_the_python_path(tmp_path):
    path = tmp_path / "host.json"
    out = megainfer("bench", "host", str(PLAN_235B), "--backend", "tcp", "--rounds", "400", "--json", str(path),
                    timeout=1200)
    assert out.returncode == 0, out.stderr
    result = json.loads(path.read_text())
    assert result["backend"] == "tcp"
    # 1.7-2.7x measured (docs/benchmarks.md): the kernel's system calls are what is left, and the
    # reference's figures move by tens of percent between runs.
    for key in ("attention_round_cpu_us", "expert_round_cpu_us"):
        assert result[key]["core"]["cpu_us"] * 1.3 < result[key]["python"]["cpu_us"], result[key]


def test_the_small_variant_sends_4_kib_records():
    from megainfer.disagg.expert_link import record_bytes
    from megainfer.tools.host_cost import DTYPE, hidden_for_record

    for top_k in (1, 2, 4, 8):
        assert record_bytes(hidden_for_record(4096, top_k), top_k, DTYPE) == 4096
