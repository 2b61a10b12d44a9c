"""A tensor-parallel node's groups: control values over gloo, activations over the compute
device's backend, and every collective refusing a tensor its backend cannot take, so the
NCCL class of bug (a host tensor in an NCCL collective) fails on the CPU too."""

from __future__ import annotations

import ast
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from megainfer import tensor_parallel
from megainfer.tensor_parallel import CollectiveDeviceError, TensorParallelGroup
from tests.helpers import ROOT


def test_activations_off_the_compute_device_are_refused_before_any_collective():
    group = TensorParallelGroup(0, 2, torch.device("cuda"))  # what a GPU rank holds; no collective runs
    assert group.data_backend == "nccl"
    for op in (group.all_reduce, group.reduce, group.broadcast):
        with pytest.raises(CollectiveDeviceError, match="over nccl on cuda, got a tensor on cpu"):
            op(torch.zeros(4))


def test_control_values_must_be_host_tensors():
    group = TensorParallelGroup(0, 2, torch.device("cpu"))
    with pytest.raises(CollectiveDeviceError, match="must be on the CPU, got one on meta"):
        group.broadcast_control(torch.zeros(3, dtype=torch.int64, device="meta"))


def _rank(rank: int, master: str, results) -> None:
    group = tensor_parallel.join(master, rank, 2, "cpu", timeout_s=30)
    try:
        least = group.min_over_ranks(1000 - 300 * rank)  # e.g. free memory: each rank has its own
        header = torch.tensor([7, 8, 9] if rank == 0 else [0, 0, 0], dtype=torch.int64)
        group.broadcast_control(header)
        partial = torch.full((2,), float(rank + 1))
        group.all_reduce(partial)
        results.put((rank, least, header.tolist(), partial.tolist()))
    finally:
        tensor_parallel.leave()


def test_two_ranks_agree_on_the_least_value_and_exchange_control_and_activations():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        master = f"127.0.0.1:{s.getsockname()[1]}"
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, master, results)) for r in range(2)]
    for p in procs:
        p.start()
    answers = sorted(results.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(30)
    assert answers == [(0, 700, [7, 8, 9], [3.0, 3.0]), (1, 700, [7, 8, 9], [3.0, 3.0])]


def test_collectives_go_through_the_node_group_only():
    """Outside megainfer/tensor_parallel.py no code calls torch.distributed's collectives, so
    none can bypass the device checks."""
    collectives = {"broadcast", "all_reduce", "reduce", "all_gather", "scatter", "gather", "send", "recv"}
    offenders = []
    for package in ("megainfer", "deploy"):
        for path in sorted((ROOT / package).rglob("*.py")):
            if path == ROOT / "megainfer" / "tensor_parallel.py":
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Attribute) and node.attr in collectives:
                    base = ast.unparse(node.value)
                    if base in ("dist", "torch.distributed"):
                        offenders.append(f"{Path(path).relative_to(ROOT)}:{node.lineno} {base}.{node.attr}")
    assert offenders == []
