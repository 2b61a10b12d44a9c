"""The one place that picks an implementation for each kernel: Triton on CUDA tensors, the
torch reference elsewhere; `MEGAINFER_KERNELS=reference|triton` overrides (Triton on CPU
tensors needs `TRITON_INTERPRET=1`, Triton's interpreter: correct and slow, for tests).

The Triton modules are imported on first use, so CPU-only runs never import Triton."""

from __future__ import annotations

import importlib
import os

import torch

BACKENDS = ("reference", "triton")
ENV = "MEGAINFER_KERNELS"


class KernelUnavailable(RuntimeError):
    """The requested kernel backend cannot run here (the message says why and what to do)."""


def interpreted() -> bool:
    """Whether Triton runs its interpreter (read when a kernel module is imported: `@triton.jit`
    picks interpreted or compiled functions then)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def _triton_available() -> bool:
    try:
        importlib.import_module("triton")
    except ImportError:
        return False
    return True


def backend(device: torch.device) -> str:
    """The backend kernels on `device` use now."""
    choice = os.environ.get(ENV, "").strip().lower()
    if choice and choice not in BACKENDS:
        raise KernelUnavailable(f"{ENV}={choice!r}: choose one of {', '.join(BACKENDS)} (or leave it unset)")
    if choice == "reference":
        return "reference"
    if choice == "triton":
        if not _triton_available():
            raise KernelUnavailable(f"{ENV}=triton but Triton is not installed: pip install triton")
        if device.type != "cuda" and not interpreted():
            raise KernelUnavailable(f"{ENV}=triton on {device.type} tensors needs Triton's interpreter: set "
                                    "TRITON_INTERPRET=1 (slow; meant for tests), or unset " + ENV)
        return "triton"
    return "triton" if device.type == "cuda" and _triton_available() else "reference"


def _module(device: torch.device, name: str):
    """kernels.<name>_triton or kernels.<name>_ref for `device`."""
    suffix = "triton" if backend(device) == "triton" else "ref"
    return importlib.import_module(f"kernels.{name}_{suffix}")


def paged_attention(query, key_cache, value_cache, batch, scale: float):
    """A hybrid batch's attention (decodes first, then prefill chunks): POD's fused kernel on Triton."""
    if backend(query.device) == "triton":
        from kernels import attention_triton as t

        return t.pod_attention(query, key_cache, value_cache, batch.block_tables, batch.seq_lens,
                               batch.query_start_loc, batch.query_start_host, batch.num_single, scale)
    from kernels import paged_attention_ref as r

    return r.paged_attention(query, key_cache, value_cache, batch, scale)


def decode_attention(query, key_cache, value_cache, block_tables, seq_lens, scale: float):
    if backend(query.device) == "triton":
        from kernels import attention_triton as t

        return t.decode_attention(query, key_cache, value_cache, block_tables, seq_lens, scale)
    from kernels import paged_attention_ref as r

    return r.decode_attention(query, key_cache, value_cache, block_tables, seq_lens, scale)


def prefill_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                      query_start_host: list[int], scale: float):
    if backend(query.device) == "triton":
        from kernels import attention_triton as t

        return t.prefill_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                                   query_start_host, scale)
    from kernels import paged_attention_ref as r

    return r.prefill_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_host, scale)


def fused_gating(logits, top_k: int, renormalize: bool, expert_node=None, num_nodes: int = 0):
    return _module(logits.device, "moe").fused_gating(logits, top_k, renormalize, expert_node, num_nodes)


def grouped_expert_gemm(x, expert_offsets: list[int], w_gate_up, w_down, row_weights):
    return _module(x.device, "moe").grouped_expert_gemm(x, expert_offsets, w_gate_up, w_down, row_weights)
