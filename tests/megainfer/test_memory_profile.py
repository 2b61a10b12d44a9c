"""--gpu-memory-utilization as vLLM means it (megainfer/runner/memory_profile.py): the arithmetic on
injected readings, the profiling step's order, and the runners' wiring run on the CPU with a
CUDA device's readings injected (the profiling steps themselves run for real, on the CPU)."""

from __future__ import annotations

import argparse

import pytest
import torch

from megainfer.expert_replicas import ExpertReplicas
from megainfer import LLM
from megainfer.cli import build_parser
from megainfer.disagg.pipelined_runner import PipelinedModelRunner
from megainfer.engine_config import EngineConfig
from megainfer.errors import ConfigError, PlanError
from megainfer.model.weights import RandomWeights
from megainfer.plan import Plan
from megainfer.presets import PRESETS
from megainfer.runner import memory_profile
from megainfer.runner.memory_profile import MemoryProfile, MemorySnapshot
from megainfer.runner.model_runner import ModelRunner

GiB = 1 << 30
TOTAL = 80 * GiB
CONTEXT = GiB // 2  # the CUDA context: there before the baseline


def snapshot(free: float, reserved: float = 0, peak: float = 0) -> MemorySnapshot:
    return MemorySnapshot(TOTAL, int(free), int(reserved), int(peak))


def test_the_budget_is_the_share_of_total_memory_less_weights_peak_activations_and_new_non_torch_memory():
    before = snapshot(TOTAL - CONTEXT)
    # After the profile (activations freed, cache emptied): 30 GiB of weights held, 2 GiB of
    # cuBLAS/NCCL memory new; torch's peak saw the weights plus 5 GiB of activations.
    after = snapshot(TOTAL - CONTEXT - 30 * GiB - 2 * GiB, reserved=30 * GiB, peak=35 * GiB)
    found = MemoryProfile.of(before, after, 0.9)
    assert found.non_torch_bytes == 2 * GiB and found.torch_peak_bytes == 35 * GiB
    assert found.requested_bytes == int(0.9 * TOTAL)
    assert found.kv_budget_bytes == int(0.9 * TOTAL) - 37 * GiB
    assert memory_profile.kv_budget_bytes(found, min_bytes=GiB) == found.kv_budget_bytes


def test_non_torch_memory_never_counts_negative():
    before = snapshot(TOTAL - 3 * GiB)  # a neighbour freed memory during our profile
    after = snapshot(TOTAL - GiB, reserved=GiB // 2, peak=GiB)
    assert MemoryProfile.of(before, after, 0.5).non_torch_bytes == 0


def test_a_second_process_on_the_gpu_gets_its_own_share_not_a_tenth():
    """Two engines asking 0.45 each: the second's budget equals the first's (the old rule, 90% of
    what was free after the first took 90% of the GPU, gave it ~9%)."""
    u, weights = 0.45, 10 * GiB
    first_after = snapshot(TOTAL - CONTEXT - weights - GiB, reserved=weights, peak=weights + 2 * GiB)
    first = MemoryProfile.of(snapshot(TOTAL - CONTEXT), first_after, u)
    taken = CONTEXT + weights + GiB + first.kv_budget_bytes  # what the first holds once its KV cache is allocated
    second_before = snapshot(TOTAL - taken - CONTEXT)
    second_after = snapshot(second_before.free_bytes - weights - GiB, reserved=weights, peak=weights + 2 * GiB)
    second = MemoryProfile.of(second_before, second_after, u)
    assert not second.others_hold_too_much
    assert second.kv_budget_bytes == first.kv_budget_bytes == int(u * TOTAL) - weights - 3 * GiB


def test_refusals_name_the_flag_and_the_numbers():
    crowded = MemoryProfile.of(snapshot(TOTAL - 20 * GiB), snapshot(TOTAL - 25 * GiB, 4 * GiB, 4 * GiB), 0.9)
    assert crowded.others_hold_too_much and memory_profile.offered_budget(crowded) == -1
    with pytest.raises(ConfigError, match=r"--gpu-memory-utilization .* 0\.9 asks for 72\.00 GiB .* only 60\.00 GiB"):
        memory_profile.kv_budget_bytes(crowded, GiB)
    with pytest.raises(ConfigError, match="other processes hold the rest"):
        memory_profile.check_fits(crowded)
    tight = MemoryProfile.of(snapshot(TOTAL - CONTEXT), snapshot(TOTAL - 39.5 * GiB, 39 * GiB, 39.5 * GiB), 0.5)
    assert tight.kv_budget_bytes == 40 * GiB - int(39.5 * GiB)  # half a GiB
    with pytest.raises(ConfigError, match=r"--gpu-memory-utilization \(serve.gpu_memory_utilization in a plan\) 0\.5 "
                                          r"gives this process 40\.00 GiB of the GPU's 80\.00 GiB.*0\.50 GiB for the "
                                          r"KV cache: less than one sequence of max_model_len needs \(2\.00 GiB\)"):
        memory_profile.kv_budget_bytes(tight, 2 * GiB)
    memory_profile.check_fits(tight)  # an expert node needs no KV cache
    over = MemoryProfile.of(snapshot(TOTAL - CONTEXT), snapshot(TOTAL - 45 * GiB, 44 * GiB, 44 * GiB), 0.5)
    with pytest.raises(ConfigError, match="the weights and the largest micro-batch need more"):
        memory_profile.check_fits(over)


def test_tensor_parallel_ranks_take_the_least_budget_and_refuse_together():
    found = MemoryProfile.of(snapshot(TOTAL - CONTEXT), snapshot(TOTAL - 20 * GiB, 19 * GiB, 20 * GiB), 0.9)
    assert memory_profile.kv_budget_bytes(found, GiB, agreed=10 * GiB) == 10 * GiB
    with pytest.raises(ConfigError, match="another rank of this node has"):
        memory_profile.kv_budget_bytes(found, GiB, agreed=-1)


class FakeMemory:
    """A CUDA device's readings, injected: `after` is what the snapshot after the profile reads."""

    def __init__(self, after: MemorySnapshot) -> None:
        self.after, self.calls = after, []

    def reset_peak(self) -> None:
        self.calls.append("reset_peak")

    def release_cached(self) -> None:
        self.calls.append("release_cached")

    def snapshot(self) -> MemorySnapshot:
        self.calls.append("snapshot")
        return self.after


def test_the_profile_resets_the_peak_runs_the_step_frees_it_then_reads():
    memory = FakeMemory(snapshot(TOTAL - 10 * GiB, 8 * GiB, 9 * GiB))
    found = memory_profile.profile(memory, snapshot(TOTAL - CONTEXT), lambda: memory.calls.append("step"), 0.9)
    assert memory.calls == ["reset_peak", "step", "release_cached", "snapshot"]
    assert found.used_bytes == 9 * GiB + (2 * GiB - CONTEXT)  # the peak, and the non-torch memory's growth


def inject_cuda_readings(monkeypatch, after: MemorySnapshot, before: MemorySnapshot | None = None) -> FakeMemory:
    """The runners on the CPU take the CUDA path's profile with these readings."""
    memory = FakeMemory(after)
    monkeypatch.setattr(memory_profile, "baseline", lambda device: before or snapshot(TOTAL - CONTEXT))
    monkeypatch.setattr(memory_profile, "CudaMemory", lambda device: memory)
    return memory


def test_the_colocated_runner_sizes_its_cache_from_the_profile(monkeypatch):
    model = PRESETS["tiny-mixtral"]
    config = EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256, gpu_memory_utilization=0.5)
    block = config.kv_block_bytes(model)
    # total * 0.5 - used leaves exactly 20 blocks (wanted: 4 sequences x 16 blocks = 64); non-torch
    # memory grew from the context's to 1 GiB
    peak = TOTAL // 2 - 20 * block - (GiB - CONTEXT)
    memory = inject_cuda_readings(monkeypatch, snapshot(TOTAL - GiB - peak, reserved=peak, peak=peak))
    runner = ModelRunner(model, config, RandomWeights(0), 256)
    assert memory.calls == ["reset_peak", "release_cached", "snapshot"]
    assert runner.num_blocks == 20


def test_a_budget_below_one_sequence_refuses_to_start(monkeypatch):
    model = PRESETS["tiny-mixtral"]
    config = EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256, gpu_memory_utilization=0.5)
    peak = TOTAL // 2 - 15 * config.kv_block_bytes(model)  # 15 blocks; a sequence of 256 tokens needs 16
    inject_cuda_readings(monkeypatch, snapshot(TOTAL - CONTEXT - peak, reserved=peak, peak=peak))
    with pytest.raises(ConfigError, match=r"--gpu-memory-utilization .* 0\.5 .*less than one sequence"):
        ModelRunner(model, config, RandomWeights(0), 256)


def test_an_explicit_cache_size_is_not_profiled(monkeypatch):
    memory = inject_cuda_readings(monkeypatch, snapshot(0))
    runner = ModelRunner(PRESETS["tiny-mixtral"], EngineConfig(num_kv_blocks=7), RandomWeights(0), 256)
    assert runner.num_blocks == 7 and memory.calls == []


def test_the_colocated_profile_step_leaves_no_trace():
    llm = LLM("tiny-mixtral", device="cpu", num_kv_blocks=64, max_num_seqs=8, max_num_batched_tokens=96)
    runner = llm.engine.runner
    rng = runner.sampler.generator.get_state()
    runner.profile_step()
    assert all(not k.any() and not v.any() for k, v in runner.kv_caches)  # no KV written
    assert torch.equal(runner.sampler.generator.get_state(), rng)  # the engine's random stream untouched


class NoLink:
    """The link a runner registers its staging with; the profiling step sends nothing."""

    def register(self, buffer) -> None:
        raise AssertionError("nothing is staged on the CPU")


@pytest.mark.parametrize("prefill_policy", ["chunked", "layered"])
def test_the_attention_half_profiles_its_largest_micro_batch_and_sizes_its_cache(monkeypatch, prefill_policy):
    model = PRESETS["tiny-qwen3-moe"]
    config = EngineConfig(max_num_seqs=6, max_num_batched_tokens=48, layered_chunk_tokens=64, max_model_len=128,
                          prefill_policy=prefill_policy)
    block = config.kv_block_bytes(model)
    peak = int(TOTAL * 0.9) - 20 * block - config.layered_hidden_reserve(model)
    inject_cuda_readings(monkeypatch, snapshot(TOTAL - CONTEXT - peak, reserved=peak, peak=peak))
    steps = []
    profile_step = PipelinedModelRunner.profile_step
    monkeypatch.setattr(PipelinedModelRunner, "profile_step", lambda self: steps.append(profile_step(self)))
    runner = PipelinedModelRunner(model, config, RandomWeights(0), 128, link=NoLink(), expert_nodes=["e0", "e1"],
                                  replicas=ExpertReplicas.of_assignment([list(range(8)), list(range(8, 16))],
                                                                             model.num_layers), micro_batches=2)
    assert len(steps) == 1 and runner.num_blocks == 20
    rng = runner.sampler.generator.get_state()
    runner.profile_step()  # runs again: nothing kept, nothing written
    assert all(not k.any() and not v.any() for k, v in runner.kv_caches)
    assert torch.equal(runner.sampler.generator.get_state(), rng)


def test_the_profile_step_is_the_largest_step_the_scheduler_forms():
    from megainfer.runner.model_runner import profile_inputs

    chunked = EngineConfig(max_num_seqs=5, max_num_batched_tokens=40)
    (ids, _, batch), cache, last_rows = profile_inputs(PRESETS["tiny-mixtral"], chunked, torch.device("cpu"),
                                                       torch.float32)
    assert ids.numel() == 40 and batch.num_seqs == 5 and batch.num_single == 4
    assert last_rows.tolist() == [0, 1, 2, 3, 39] and cache[0].shape[0] == 3  # 36 tokens: 3 blocks of 16
    layered = EngineConfig(max_num_seqs=5, max_num_batched_tokens=40, prefill_policy="layered",
                           layered_chunk_tokens=100)
    assert layered.max_step_tokens == 105  # every decode plus one cohort
    few = EngineConfig(max_num_seqs=64, max_num_batched_tokens=16)
    (ids, _, batch), _, _ = profile_inputs(PRESETS["tiny-mixtral"], few, torch.device("cpu"), torch.float32)
    assert ids.numel() == 16 and batch.num_seqs == batch.num_single == 16


@pytest.mark.parametrize("value", [0, -0.1, 1.01, float("nan"), True, "0.5"])
def test_the_utilization_is_checked_wherever_a_user_gives_it(value):
    with pytest.raises(ConfigError, match="gpu_memory_utilization"):
        EngineConfig(gpu_memory_utilization=value)
    with pytest.raises(ConfigError, match="gpu_memory_utilization"):
        LLM("tiny-mixtral", gpu_memory_utilization=value)
    data = Plan.load("deploy/plans/tiny-cpu.yaml").to_dict()
    data["serve"]["gpu_memory_utilization"] = value
    with pytest.raises(PlanError, match="serve.gpu_memory_utilization"):
        Plan.from_dict(data)


@pytest.mark.parametrize("command", [["serve"], ["generate", "--prompt", "hi"]])
def test_the_flag_is_checked_on_the_command_line(command, capsys):
    parser = build_parser()
    args = parser.parse_args([*command, "--gpu-memory-utilization", "0.6"])
    assert args.gpu_memory_utilization == 0.6
    for bad in ("0", "1.5", "half"):
        with pytest.raises(SystemExit):
            parser.parse_args([*command, "--gpu-memory-utilization", bad])
        assert "--gpu-memory-utilization" in capsys.readouterr().err
    assert parser.parse_args(command).gpu_memory_utilization == 0.9


def test_the_plan_field_reaches_every_node(tmp_path):
    from deploy.runtime_config import runtime_of

    data = Plan.load("deploy/plans/qwen3-235b-h20-l40s.yaml").to_dict()
    data["serve"]["gpu_memory_utilization"] = 0.6
    runtime = runtime_of(Plan.from_dict(data))
    assert {a.engine.gpu_memory_utilization for a in runtime.attention} == {0.6}
    assert {e.gpu_memory_utilization for e in runtime.experts} == {0.6}
    assert runtime.experts[0].profile_tokens == 5 * runtime.micro_batch_tokens  # every attention node's tokens


def test_gpu_memory_utilization_type_error_is_argparse_friendly():
    from megainfer.cli.options import gpu_memory_utilization

    assert gpu_memory_utilization("1") == 1.0
    with pytest.raises(argparse.ArgumentTypeError, match="0 < u <= 1"):
        gpu_memory_utilization("0")


def test_an_expert_node_checks_its_largest_micro_batch_fits(monkeypatch):
    from megainfer.disagg.expert_worker import ExpertWorker

    model = PRESETS["tiny-qwen3-moe"]
    build = dict(attention_nodes=["a0"], micro_batches=2, link=None, profile_tokens=96, gpu_memory_utilization=0.5)
    memory = inject_cuda_readings(monkeypatch, snapshot(TOTAL - 30 * GiB, 29 * GiB, 30 * GiB))
    ExpertWorker(model, [0, 1, 2, 3], "float32", "cpu", RandomWeights(0), **build)  # 30 of its 40 GiB
    assert memory.calls == ["reset_peak", "release_cached", "snapshot"]
    inject_cuda_readings(monkeypatch, snapshot(TOTAL - 41 * GiB, 40 * GiB, 41 * GiB))
    with pytest.raises(ConfigError, match=r"--gpu-memory-utilization .* 0\.5 .*need more than this process's share"):
        ExpertWorker(model, [0, 1, 2, 3], "float32", "cpu", RandomWeights(0), **build)
