"""The `memory` check: pinned host<->device copy bandwidth (what the staging between nodes
runs at), the KV cache's sizing on the device (weights and cache where they belong, within the
memory the engine may use), one NVML energy read over a second of GEMMs, and a tensor's memory
exported as a dma-buf (what GPUDirect RDMA registers)."""

from __future__ import annotations

import time

import torch

from megainfer.tools.gpucheck.context import CheckContext

COPY_BYTES = 256 << 20
COPY_REPS = 10
DEFAULT_UTILIZATION = 0.9  # vLLM's default --gpu-memory-utilization, megainfer's too
SLACK_BYTES = 512 << 20  # allocator rounding and the CUDA context, beyond the utilization


def _copy_gb_per_s(src: torch.Tensor, dst: torch.Tensor) -> float:
    dst.copy_(src, non_blocking=True)  # warm-up
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(COPY_REPS):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    return src.numel() * src.element_size() * COPY_REPS / (time.perf_counter() - start) / 1e9


def check_copies(ctx: CheckContext) -> None:
    with ctx.case(f"host<->device copies of {COPY_BYTES >> 20} MiB, pinned and pageable") as case:
        if not ctx.on_gpu:
            case.skip("no CUDA device: host<->device copies need one")
            return
        device_buffer = torch.empty(COPY_BYTES, dtype=torch.uint8, device=ctx.device)
        pinned = torch.empty(COPY_BYTES, dtype=torch.uint8, pin_memory=True)
        pageable = torch.empty(COPY_BYTES, dtype=torch.uint8)
        f = case.figures
        f["pinned_h2d_gb_s"] = round(_copy_gb_per_s(pinned, device_buffer), 2)
        f["pinned_d2h_gb_s"] = round(_copy_gb_per_s(device_buffer, pinned), 2)
        f["pageable_h2d_gb_s"] = round(_copy_gb_per_s(pageable, device_buffer), 2)
        f["pinned_over_pageable"] = round(f["pinned_h2d_gb_s"] / f["pageable_h2d_gb_s"], 2)


def check_kv_sizing(ctx: CheckContext) -> None:
    """The engine sized on its own (no block count given): weights and cache on the device, the
    cache non-empty, and the process within the memory it may use."""
    from megainfer import LLM, SamplingParams
    from megainfer.model_resolution import DEMO_MODEL

    dtype = "bfloat16" if ctx.on_gpu else "float32"
    with ctx.case(f"KV cache sized by the engine ({DEMO_MODEL}, {dtype}, no block count given)") as case:
        if ctx.on_gpu:
            total = torch.cuda.get_device_properties(ctx.device).total_memory
            free_before = torch.cuda.mem_get_info(ctx.device)[0]
        llm = LLM(DEMO_MODEL, dtype=dtype, device=ctx.device.type)
        runner = llm.engine.runner
        tensors = dict(runner.model.named_parameters()) | dict(runner.model.named_buffers())
        off_device = [name for name, t in tensors.items() if t.device.type != ctx.device.type]
        if off_device:
            raise AssertionError(f"weights off the {ctx.device.type}: {off_device[:5]}")
        caches = [t for pair in runner.kv_caches for t in pair]
        cache_bytes = sum(t.numel() * t.element_size() for t in caches)
        case.figures |= {"kv_blocks": runner.num_blocks, "kv_cache_gib": round(cache_bytes / 2 ** 30, 3)}
        if cache_bytes <= 0 or any(t.device.type != ctx.device.type for t in caches):
            raise AssertionError("the KV cache is empty or off the device")
        out = llm.generate([[0, 5, 9]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        if len(out[0].outputs[0].token_ids) != 4:
            raise AssertionError("the engine did not generate 4 tokens after sizing its cache")
        if ctx.on_gpu:
            reserved = torch.cuda.memory_reserved(ctx.device)
            case.figures |= {"total_gib": round(total / 2 ** 30, 2), "free_before_gib": round(free_before / 2 ** 30, 2),
                             "torch_reserved_gib": round(reserved / 2 ** 30, 2),
                             "reserved_share_of_total": round(reserved / total, 3)}
            if reserved > DEFAULT_UTILIZATION * total + SLACK_BYTES:
                raise AssertionError(f"torch holds {reserved / 2 ** 30:.1f} GiB, over {DEFAULT_UTILIZATION:.0%} of the "
                                     f"GPU's {total / 2 ** 30:.1f} GiB")
        del llm, runner, tensors, caches


def check_energy(ctx: CheckContext) -> None:
    from megainfer.runner.energy import EnergyMeter

    with ctx.case("NVML energy counter over a second of bf16 GEMMs") as case:
        meter = EnergyMeter(str(ctx.device))
        if not meter.available:
            case.skip(meter.reason)
            return
        a = torch.randn(8192, 8192, device=ctx.device, dtype=torch.bfloat16)
        start = time.perf_counter()
        while time.perf_counter() - start < 1.0:
            for _ in range(10):
                a @ a
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        joules = meter.joules()
        case.figures |= {"joules": round(joules, 1), "watts": round(joules / seconds, 1)}
        if not joules > 0:
            raise AssertionError(f"the energy counter moved by {joules} J over {seconds:.2f} s of GEMMs")


def check_dmabuf_export(ctx: CheckContext) -> None:
    """GPUDirect RDMA's GPU half, which needs no adapter: the driver exports a tensor's memory
    as a dma-buf (transport/cuda_dmabuf.py, ctypes over libcuda) for an adapter to register,
    and whether the GPU orders an adapter's writes into it for its own kernels (else the
    receiver of a device-slot round by rdma flushes them first: the flush is called here). A
    driver without dma-buf support (the closed kernel modules) is recorded, not failed: the
    core's rdma channels then stage GPU payloads through host memory, saying so."""
    import os

    from transport.cuda_dmabuf import CudaDriver, dmabuf_span
    from transport.errors import BackendUnavailable

    with ctx.case("a CUDA tensor exported as a dma-buf through libcuda (for ibv_reg_dmabuf_mr)") as case:
        if not ctx.on_gpu:
            case.skip("no CUDA device: dma-buf export needs one")
            return
        driver = CudaDriver()
        try:  # whether an adapter's writes into this GPU need a flush before its kernels read them
            flush = driver.needs_flush(ctx.device.index or 0)
            case.figures["rdma_writes_need_flush"] = flush
            if flush:
                driver.flush_rdma_writes(ctx.device.index or 0)  # what Endpoint.settle calls after such a round
        except BackendUnavailable as exc:
            case.figures["rdma_writes_need_flush"] = str(exc)
        try:
            driver.check_export(ctx.device.index or 0)
        except BackendUnavailable as exc:
            case.figures["dmabuf_export"] = str(exc)
            return
        tensor = torch.empty(4 << 20, dtype=torch.uint8, device=ctx.device)
        start, span, offset = dmabuf_span(tensor.data_ptr() + 512, (4 << 20) - 1024)
        fd = driver.export(start, span)
        try:
            case.figures |= {"dmabuf_export": "supported", "span_bytes": span, "offset": offset,
                             "fd_size_bytes": os.fstat(fd).st_size}
        finally:
            os.close(fd)


def check_mark_wait(ctx: CheckContext) -> None:
    """The wait a device-slot receiver's stream makes on an rdma round's marks
    (Endpoint.hold_stream: cuStreamBatchMemOp through ctypes), with no adapter: a side stream
    held on a word must not run the work behind the wait until another stream writes the
    value, then must run it. Records the wait's flags for this GPU (FLUSH or not) and how long
    the release took."""
    from transport.cuda_dmabuf import CudaDriver
    from transport.errors import BackendUnavailable

    with ctx.case("a stream held by a wait on a word in GPU memory until another stream writes it") as case:
        if not ctx.on_gpu:
            case.skip("no CUDA device: a stream memory operation needs one")
            return
        driver = CudaDriver()
        try:
            wait = driver.mark_wait(ctx.device.index or 0)
        except BackendUnavailable as exc:  # neither orders nor flushes an adapter's writes
            case.figures["mark_wait"] = str(exc)
            return
        case.figures |= {"wait_flags": hex(wait.flags), "host_flush": wait.host_flush}
        marks = torch.zeros(2, dtype=torch.int32, device=ctx.device)
        behind = torch.zeros(1, dtype=torch.float32, device=ctx.device)
        held, writer = torch.cuda.Stream(ctx.device), torch.cuda.Stream(ctx.device)
        torch.cuda.synchronize(ctx.device)
        with torch.cuda.stream(held):
            driver.wait_values(ctx.device.index or 0, held.cuda_stream, [marks[1].data_ptr()], [7], wait.flags)
            behind.add_(1)
            done = held.record_event()
        time.sleep(0.05)
        ran_early = done.query()
        with torch.cuda.stream(writer):
            marks[1].fill_(7)
        start = time.perf_counter()
        while not done.query() and time.perf_counter() - start < 5.0:
            time.sleep(0.0005)
        released = done.query()
        case.figures |= {"held_until_written": not ran_early, "released": released,
                         "release_ms": round((time.perf_counter() - start) * 1e3, 3)}
        if ran_early or not released:
            raise AssertionError("the work behind the wait " + ("ran before the word was written" if ran_early else
                                                              "did not run within 5 s of the word being written"))
        if behind.item() != 1:
            raise AssertionError(f"the work behind the wait left {behind.item()}, not 1")


def run(ctx: CheckContext) -> None:
    check_copies(ctx)
    check_kv_sizing(ctx)
    check_energy(ctx)
    check_dmabuf_export(ctx)
    check_mark_wait(ctx)
