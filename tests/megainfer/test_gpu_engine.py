"""megainfer's colocated engine on CUDA against transformers on CUDA, from the same tiny
checkpoints (tests/conftest.py). float32: the greedy tokens are equal and the logits agree.
bfloat16: megainfer's greedy tokens leave float32's clearly no more often than transformers'
bfloat16 ones do (give or take one prompt), and measured against float32 along the same
contexts, megainfer's logits are as faithful as transformers' own bfloat16 ones. The engine's weights and KV cache live on the GPU. Skipped, with the reason,
where there is no GPU."""

from __future__ import annotations

import math

import pytest
import torch

from megainfer import LLM, SamplingParams
from megainfer.tools.gpucheck.engine_check import (BFLOAT16_ERROR_RATIO, FLOAT32_LOGIT_ATOL, Greedy, bfloat16_misses,
                                                   bfloat16_partings, clear_misses, first_disagreement, free_memory,
                                                   mean_error, megainfer_greedy, transformers_forced,
                                                   transformers_greedy)
from megainfer.tools.gpucheck.engine_check import highest_float32_precision as float32_in_ieee


def free_cuda() -> None:
    free_memory(torch.device("cuda"))


@pytest.fixture
def highest_float32_precision():
    """transformers' float32 matmuls in full IEEE precision (no TF32), as megainfer's are."""
    with float32_in_ieee():
        yield


@pytest.mark.gpu
def test_engine_on_cuda_in_float32_matches_transformers_on_cuda(hf_ref, highest_float32_precision):
    ref = transformers_greedy(hf_ref.path, hf_ref.prompts, "float32", "cuda")
    free_cuda()
    ours = megainfer_greedy(hf_ref.path, hf_ref.prompts, "float32", "cuda")
    free_cuda()
    assert ours.tokens == ref.tokens
    problem = first_disagreement(ours, ref, FLOAT32_LOGIT_ATOL, near_tie=0.0)
    assert not problem, problem


@pytest.mark.gpu
def test_engine_on_cuda_in_bfloat16_agrees_with_transformers_up_to_rounding(hf_ref,
                                                                            highest_float32_precision):
    ref = transformers_greedy(hf_ref.path, hf_ref.prompts, "bfloat16", "cuda")
    float32 = transformers_greedy(hf_ref.path, hf_ref.prompts, "float32", "cuda")
    free_cuda()
    ours = megainfer_greedy(hf_ref.path, hf_ref.prompts, "bfloat16", "cuda")
    free_cuda()
    truth = transformers_forced(hf_ref.path, hf_ref.prompts, ours.tokens, "float32", "cuda")
    theirs = transformers_forced(hf_ref.path, hf_ref.prompts, ours.tokens, "bfloat16", "cuda")
    free_cuda()
    # Rounding moves single logits too far for a per-logit bound (a token routed to other
    # experts), so the tokens are judged by their misses of float32's and the logits by their mean error.
    _, problem = bfloat16_misses(ours, ref, float32)
    assert not problem, problem
    ours_error, their_error = mean_error(ours.logits, truth), mean_error(theirs, truth)
    assert 0 < ours_error <= BFLOAT16_ERROR_RATIO * their_error, (
        f"megainfer's bfloat16 logits are off float32 by {ours_error:.4f} on average, transformers' by "
        f"{their_error:.4f}")


@pytest.mark.gpu
def test_engine_on_cuda_holds_weights_and_kv_cache_on_the_gpu(mixtral_ref):
    total = torch.cuda.get_device_properties(0).total_memory
    llm = LLM(str(mixtral_ref.path), dtype="bfloat16", device="cuda")  # the cache sized by --gpu-memory-utilization
    try:
        runner = llm.engine.runner
        tensors = dict(runner.model.named_parameters()) | dict(runner.model.named_buffers())
        off_gpu = [name for name, t in tensors.items() if t.device.type != "cuda"]
        assert not off_gpu, f"weights off the GPU: {off_gpu}"
        assert {t.dtype for t in runner.model.parameters()} == {torch.bfloat16}
        assert sum(t.numel() for t in runner.model.parameters()) == llm.engine.model_config.num_params  # all of them
        caches = [t for pair in runner.kv_caches for t in pair]
        assert all(t.device.type == "cuda" and t.dtype == torch.bfloat16 for t in caches)
        cache_bytes = sum(t.numel() * t.element_size() for t in caches)
        # --gpu-memory-utilization 0.9 (the default), vLLM's meaning: of the GPU's total memory.
        assert 0 < cache_bytes <= torch.cuda.memory_reserved() <= 0.9 * total + (256 << 20)
        out = llm.generate([mixtral_ref.prompts[0]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 4
    finally:
        del llm
        free_cuda()


# The comparison itself, on the CPU: it must fail where a GPU run would be wrong.

def _greedy(tokens: list[int], logits: list[list[float]]) -> Greedy:
    return Greedy([tokens], [torch.tensor(logits)])


def test_a_parting_at_a_near_tie_is_accepted_and_later_steps_ignored():
    ref = _greedy([0, 1, 1], [[2.0, 1.0], [1.0, 1.1], [0.0, 5.0]])
    ours = _greedy([0, 0, 0], [[2.0, 1.0], [1.1, 1.0], [9.0, 0.0]])  # parts at step 1 by 0.1
    assert first_disagreement(ours, ref, logit_atol=math.inf, near_tie=0.25) == ""


def test_a_parting_without_a_near_tie_is_reported():
    ref = _greedy([0, 1], [[2.0, 1.0], [0.0, 1.0]])
    ours = _greedy([0, 0], [[2.0, 1.0], [1.0, 0.0]])
    assert "step 1: chose 0, transformers 1" in first_disagreement(ours, ref, math.inf, near_tie=0.25)


def test_a_bfloat16_parting_is_recorded_with_both_margins_and_later_steps_ignored():
    # transformers' bfloat16 prefers its pick by 3 (a routing flip on its side); float32 is
    # nearly tied between the two; later steps are not looked at.
    ref = _greedy([0, 1, 1], [[2.0, 1.0], [0.0, 3.0], [0.0, 9.0]])
    ours = _greedy([0, 0, 0], [[2.0, 1.0], [1.0, 0.0], [9.0, 0.0]])
    truth = [torch.tensor([[2.0, 1.0], [1.0, 1.1], [9.0, 0.0]])]
    figures = bfloat16_partings(ours, ref, truth)
    assert figures == {"partings": 1, "worst_float32_margin": pytest.approx(0.1), "worst_bfloat16_margin": 3.0}


def _prompts(*rows: tuple[list[int], list[list[float]]]) -> Greedy:
    return Greedy([tokens for tokens, _ in rows], [torch.tensor(logits) for _, logits in rows])


# float32's greedy picks over four prompts, each decided at step 1 by a margin of 2 (prompt 3: by 0.1).
FLOAT32 = _prompts(([0, 1], [[2.0, 1.0], [0.0, 2.0]]), ([0, 1], [[2.0, 1.0], [0.0, 2.0]]),
                   ([0, 1], [[2.0, 1.0], [0.0, 2.0]]), ([0, 1], [[2.0, 1.0], [1.0, 1.1]]))


def _bfloat16(picks: list[int]) -> Greedy:
    """Step 1's picks of the four prompts (logits unused by the judge)."""
    return _prompts(*[([0, p], [[2.0, 1.0], [0.0, 0.0]]) for p in picks])


def test_a_clear_miss_of_float32_counts_and_a_near_tie_does_not():
    assert clear_misses(_bfloat16([1, 1, 1, 0]), FLOAT32, near_tie=0.25) == []  # prompt 3: a near-tie
    assert clear_misses(_bfloat16([0, 1, 1, 1]), FLOAT32, near_tie=0.25) == ["prompt 0 step 1: chose 0, float32 1 by 2"]


def test_megainfer_may_miss_as_often_as_transformers_plus_one():
    transformers = _bfloat16([0, 1, 1, 1])  # one clear miss: rounding's, on transformers' side
    figures, problem = bfloat16_misses(_bfloat16([0, 0, 1, 1]), transformers, FLOAT32, extra=1)
    assert problem == "" and figures == {"clear_misses": 2, "transformers_clear_misses": 1}
    figures, problem = bfloat16_misses(_bfloat16([0, 0, 0, 1]), transformers, FLOAT32, extra=1)
    assert figures["clear_misses"] == 3
    assert "clearly left float32's in 3 of 4 prompts, transformers' in 1 (allowed 1 more); first: prompt 0" in problem


def test_logits_beyond_the_tolerance_are_reported_even_with_equal_tokens():
    ref = _greedy([0], [[2.0, 1.0]])
    ours = _greedy([0], [[2.0, 1.01]])
    assert "logits differ" in first_disagreement(ours, ref, FLOAT32_LOGIT_ATOL, near_tie=0.0)
    assert mean_error(ours.logits, ref.logits) == pytest.approx(0.005)


@pytest.mark.gpu
def test_kernels_are_decided_at_start_and_none_built_while_serving(tmp_path):
    """The GPU check's case: an engine timed per shape at start (MEGAINFER_KERNELS unset) serves
    prompts of many lengths without building a Triton variant."""
    from megainfer.tools.gpucheck.context import CheckContext
    from megainfer.tools.gpucheck.engine_check import check_no_build_while_serving
    from megainfer.tools.gpucheck.records import RecordLog, Status

    check_no_build_while_serving(CheckContext("engine", torch.device("cuda"), tmp_path, float("inf")))
    failed = [r for r in RecordLog(tmp_path).read() if r.status is not Status.PASSED]
    assert not failed, [(r.case, r.detail) for r in failed]
