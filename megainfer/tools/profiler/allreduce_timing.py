"""The `allreduce` table: one tensor-parallel all-reduce per size, measured across `tp`
processes spawned here, each joining a node group as an attention node's ranks do
(`megainfer.tensor_parallel`: NCCL over tp GPUs from the profiled one on CUDA, gloo on the
CPU) and timing the group's own `all_reduce`, the call the attention layer makes.

Every rank must issue the same collectives, so the repeat count is agreed first (the largest
any rank wants), then every rank times the same blocks; a size's time is the slowest rank's
median block (a collective ends when its last rank does).
"""

from __future__ import annotations

import datetime
import math
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megainfer import tensor_parallel
from megainfer.tensor_parallel import TensorParallelGroup

BLOCKS = 5
WARMUP_CALLS = 3
TIMEOUT = datetime.timedelta(minutes=5)


def measure_allreduce(bytes_axis: tuple[int, ...], tp: int, device: torch.device, dtype: torch.dtype,
                      min_time_s: float, threads: int) -> list[float]:
    """Seconds of one all-reduce of a tensor of each size in `bytes_axis` across tp ranks: on
    CUDA, rank r on GPU device.index + r."""
    port = _free_port()
    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    mp.start_processes(_rank_main, args=(tp, port, str(device), dtype, bytes_axis, min_time_s, threads, results),
                       nprocs=tp, start_method="spawn")
    return results.get()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, tp: int, port: int, first_device: str, dtype: torch.dtype,
               bytes_axis: tuple[int, ...], min_time_s: float, threads: int, results) -> None:
    device = torch.device(first_device)
    if device.type == "cuda":
        device = torch.device("cuda", (device.index or 0) + rank)
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, threads // tp))
    group = tensor_parallel.join(f"127.0.0.1:{port}", rank, tp, str(device), TIMEOUT.total_seconds())
    try:
        element = torch.tensor([], dtype=dtype).element_size()
        seconds = [_time_all_reduce(group, torch.zeros(max(1, size // element), dtype=dtype, device=device),
                                    min_time_s) for size in bytes_axis]
        if rank == 0:
            results.put(seconds)
    finally:
        tensor_parallel.leave()


def _largest(group: TensorParallelGroup, value: int) -> int:
    """The largest of every rank's `value`, over the group's control channel."""
    return -group.min_over_ranks(-value)


def _time_all_reduce(group: TensorParallelGroup, tensor: torch.Tensor, min_time_s: float) -> float:
    for _ in range(WARMUP_CALLS):
        group.all_reduce(tensor)
    one = _block(group, tensor, 1)
    calls = _largest(group, max(1, math.ceil(min_time_s / BLOCKS / max(one, 1e-7))))
    median_ns = round(statistics.median(_block(group, tensor, calls) / calls for _ in range(BLOCKS)) * 1e9)
    return _largest(group, median_ns) / 1e9


def _block(group: TensorParallelGroup, tensor: torch.Tensor, calls: int) -> float:
    """Seconds of `calls` all-reduces, started together (a barrier) and drained."""
    dist.barrier()
    if tensor.device.type == "cuda":
        torch.cuda.synchronize(tensor.device)
    began = time.perf_counter()
    for _ in range(calls):
        group.all_reduce(tensor)
    if tensor.device.type == "cuda":
        torch.cuda.synchronize(tensor.device)
    return time.perf_counter() - began
