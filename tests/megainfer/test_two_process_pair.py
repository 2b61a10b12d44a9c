"""One attention node and one expert node in two processes (torch.multiprocessing spawn, no
Ray), ping-ponging m = 2 micro-batches over M2N endpoints (staged through the host, or over
device slots: megainfer/disagg/device_slots.py): the attention node's greedy tokens
equal the colocated engine's, and the expert node served exactly the attention node's steps.
On the CPU by default; the same test runs on CUDA under the `gpu` marker, where it also
prints the pair's decode tokens/s. The processes are the GPU check's (`megainfer.gpucheck`'s
`pair` check), here on the tiny transformers-written Mixtral."""

from __future__ import annotations

import pytest
import torch

from megainfer.tools.gpucheck.pair_check import PairSpec, colocated, run_pair


@pytest.mark.parametrize("device_slots", [False, True], ids=["staged", "device-slots"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_attention_and_expert_processes_match_the_colocated_engine(mixtral_ref, device, device_slots):
    max_tokens = 12 if device == "cpu" else 64  # the CPU here is slow and shared; a GPU run measures decode
    spec = PairSpec(str(mixtral_ref.path), device, "float32", "shm", micro_batches=2, max_tokens=max_tokens,
                    device_slots=device_slots)
    expected = colocated(spec, mixtral_ref.prompts)
    attention, expert = run_pair(spec, mixtral_ref.prompts)
    assert attention.tokens == expected
    assert expert.steps == attention.steps
    assert attention.direct_peers == (1 if device_slots else 0)
    if device == "cuda":
        rate = attention.decode_tokens / attention.decode_seconds
        print(f"\ntwo-process pair on {torch.cuda.get_device_name()}: decode {rate:.1f} tokens/s "
              f"({attention.decode_tokens} tokens in {attention.decode_seconds:.3f} s, {len(mixtral_ref.prompts)} "
              f"sequences, m = {spec.micro_batches}, float32, tiny Mixtral, device slots {device_slots})")
