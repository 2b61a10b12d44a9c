"""Pinned staging sized to the largest message of each slot and direction
(megainfer/disagg/staging_sizes.py), what the dry run says every rank will pin, and the KV
estimate the planner and the dry run share with the nodes (config.kv_cache_budget_bytes)."""

from __future__ import annotations

import itertools
import logging

import pytest
import torch

from deploy.dry_run import describe, gpu_memory_bytes
from deploy.runtime_config import check_batch, runtime_of
from megainfer.disagg import device_staging
from megainfer.disagg.device_staging import PinnedBuffer
from megainfer.disagg.expert_link import pack_records, rank_share, record_bytes
from megainfer.disagg.staging_sizes import (StagingBytes, aligned_layout, answer_rows, attention_staging,
                                            dispatch_rows, expert_staging)
from megainfer.plan import Plan
from megainfer.presets import PRESETS
from planner.catalog import Catalog
from planner.perf_model import PREFILL_CHUNK_TOKENS, PerfModel
from tests.helpers import ROOT

QWEN_235B = ROOT / "deploy" / "plans" / "qwen3-235b-h20-l40s.yaml"
MiB = 1 << 20


def test_the_235b_attention_rank_pins_its_largest_messages_far_below_the_old_two_gib():
    runtime = runtime_of(Plan.load(QWEN_235B))
    # By hand: qwen3-235b-a22b, bfloat16, hidden 4096, top_k 8; 32 expert nodes; attention tp 4;
    # one micro-batch carries up to max_num_batched_tokens = 2396 tokens.
    assert runtime.micro_batch_tokens == 2396
    record = 4096 * 2 + 8 * 4 + 8 * 4  # x, int32 ids, float32 weights: 8256 bytes
    records = 2396 * 8 * record  # a token once per expert node it chose, min(8, 32): 158,251,008 bytes
    offsets = 320  # 33 int64 node offsets, 264 bytes, ALIGN-ed to 64
    answers = (2396 * 8 + 32 * 3) // 4 * 4096 * 2  # this rank's share of each node's tokens, at most 4816 rows
    assert runtime.attention[0].staging_bytes == StagingBytes(records + offsets, answers) == (158_251_328, 39_452_672)
    per_rank = 4 * (158_251_328 + 39_452_672)  # 4 micro-batch slots: 754.2 MiB
    assert per_rank == 790_816_000 and per_rank < 0.4 * (2 << 30)
    # The same plan's old reservation: the records' size + 64 KiB in both directions, 8 x 176.6 MiB
    # at the plan's old 2802 tokens (2 GiB if each buffer had grown to a power of two instead).
    old_shape = attention_staging(2802, 4096, 8, 2, 32, 4)
    assert 4 * old_shape.per_slot == 924_685_568 < 8 * (2802 * 8 * record + (1 << 16))  # 881.8 of 1412.5 MiB
    # An expert node (its leader) takes at most every attention node's 2396 tokens: 5 x 2396 records in,
    # their answers out.
    assert runtime.experts[0].staging_bytes == (5 * 2396 * 4096 * 2, 5 * 2396 * record)


def test_the_dry_run_prints_what_each_rank_will_pin_per_rank_and_per_host():
    runtime = runtime_of(Plan.load(QWEN_235B))
    out = describe(runtime, check_batch(runtime, gpu_memory_bytes(runtime)))
    assert "attention rank: 150.9 MiB + 37.6 MiB = 754.2 MiB; 8 per 8-GPU H20 host: 5.89 GiB" in out
    assert "expert node (its leader): 93.6 MiB + 94.3 MiB = 751.7 MiB; 8 per 8-GPU L40S host: 5.87 GiB" in out
    rehearsal = runtime_of(Plan.load(QWEN_235B), "cpu")
    assert "(this rehearsal pins none)" in describe(rehearsal, check_batch(rehearsal, None))


@pytest.mark.parametrize("tokens,top_k,nodes,tp", [(5, 2, 3, 2), (4, 3, 3, 3), (6, 2, 2, 4), (3, 4, 2, 2),
                                                   (7, 1, 3, 2)])
def test_answer_rows_is_the_most_any_rank_can_receive(tokens, top_k, nodes, tp):
    """Every way the tokens can spread over the expert nodes (each node gets at most every token,
    a token at most min(top_k, nodes) nodes): the largest sum of any rank's shares is the bound."""
    most = 0
    for counts in itertools.product(range(tokens + 1), repeat=nodes):
        if sum(counts) <= tokens * min(top_k, nodes):
            for rank in range(tp):
                most = max(most, sum(end - begin for begin, end in (rank_share(c, tp, rank) for c in counts)))
    assert answer_rows(tokens, top_k, nodes, tp) == most


@pytest.fixture
def host_pinned(monkeypatch):
    """PinnedBuffer on a machine without CUDA: plain host memory, every allocation counted."""
    allocations = []

    def pinned(nbytes: int) -> torch.Tensor:
        allocations.append(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8)

    monkeypatch.setattr(device_staging, "_pinned", pinned)
    return allocations


def test_the_largest_messages_fill_their_reservations_exactly(host_pinned, caplog):
    model, value_bytes, tokens, nodes, tp = PRESETS["tiny-qwen3-moe"], 4, 40, 3, 2
    staging = attention_staging(tokens, model.hidden_size, model.top_k, value_bytes, nodes, tp)
    # The dispatch as the gating kernel sizes it for the largest micro-batch, and its node offsets:
    # the two parts DeviceStaging.to_host lays out.
    rows = dispatch_rows(tokens, model.top_k, nodes)
    records = pack_records(torch.zeros(rows, model.hidden_size), torch.zeros(rows, model.top_k, dtype=torch.int64),
                           torch.zeros(rows, model.top_k))
    offsets = torch.zeros(nodes + 1, dtype=torch.int64)
    _, outgoing = aligned_layout([records.numel(), offsets.numel() * offsets.element_size()])
    incoming = answer_rows(tokens, model.top_k, nodes, tp) * model.hidden_size * value_bytes
    assert (outgoing, incoming) == staging
    out, into = PinnedBuffer("to host #0", staging.to_host), PinnedBuffer("to device #0", staging.to_device)
    with caplog.at_level(logging.INFO, logger=device_staging.__name__):
        assert out.claim(outgoing).numel() == outgoing and into.claim(incoming).numel() == incoming
        assert host_pinned == list(staging) and not caplog.records  # reserved once, never grown
        out.claim(outgoing + 1)  # the guard: a larger message still goes, with a warning
    assert host_pinned[-1] == outgoing + 64 and caplog.records[-1].levelno == logging.WARNING
    expert = expert_staging(tokens, model.hidden_size, model.top_k, value_bytes, attention_nodes=2)
    assert expert.to_device == 2 * tokens * record_bytes(model.hidden_size, model.top_k, torch.float32)
    assert expert.to_host == aligned_layout([2 * tokens * model.hidden_size * value_bytes])[1]


def test_a_buffer_reserved_with_nothing_grows_to_the_message_aligned(host_pinned, caplog):
    buffer = PinnedBuffer("to host #1")
    with caplog.at_level(logging.INFO, logger=device_staging.__name__):
        buffer.claim(1000)
    assert host_pinned == [0, 1024] and caplog.records[-1].levelno == logging.INFO  # no power of two beyond ALIGN


@pytest.mark.parametrize("name", ["qwen3-235b-a22b", "mixtral-8x22b", "qwen3-30b-a3b"])
@pytest.mark.parametrize("gpu,tp", [("H20", 4), ("H800", 2), ("L40S", 8)])
def test_the_planner_and_the_dry_run_size_kv_alike(name, gpu, tp):
    """The planner's most sequences per attention node, written into a plan, is what the dry run's
    estimate of the node's KV cache holds: one formula (config.kv_cache_budget_bytes)."""
    model, memory = PRESETS[name], Catalog.load()[gpu].memory_bytes
    if model.num_kv_heads % tp:
        pytest.skip(f"{name} cannot split {model.num_kv_heads} KV heads over {tp}")
    fit = int(PerfModel(model, 730).max_sequences_per_attention_node(memory, tp))
    if fit < 1:
        pytest.skip(f"{name} does not fit {gpu} x{tp}")
    nodes = 2
    data = {"model": name, "attention": {"gpu": gpu, "tp": tp, "nodes": nodes},
            "experts": {"gpu": "L40S", "nodes": model.num_experts, "experts_per_node": 1},
            "scheduler": {"max_num_seqs": fit, "max_num_batched_tokens": fit + PREFILL_CHUNK_TOKENS},
            "pipeline": {"micro_batches": 2, "global_batch": nodes * fit}, "predicted": {"seq_len": 730}}
    check = check_batch(runtime_of(Plan.from_dict(data)), memory)
    assert check.kv_sequences >= fit and check.reaches_prediction
