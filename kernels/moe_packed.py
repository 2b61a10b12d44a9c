"""The grouped SwiGLU expert GEMM on the CPU with every expert's weights packed once, at load,
into oneDNN's blocked layout (`torch.ops.mkldnn._reorder_linear_weight`, what
`torch.jit.freeze` and Inductor's CPU backend do for a frozen linear layer).

Why: a CPU GEMM library repacks its B operand into cache-sized panels on every call. For an
expert layer at decode sizes (a few to a few dozen rows per expert) that repacking, a read
and a write of every active expert's weights, costs more than the multiply, and the
ping-pong pipeline pays it once per micro-batch. Measured on the 2-core EPYC this project
runs on, tiny-mixtral's experts (8 x 256 x 512, float32) over 64 tokens, top-2, weights of
four layers in turn: 1.8 ms packed against 3.1-3.4 ms for per-expert `F.linear` or the
padded batched GEMM; over 21 tokens, 1.5 ms against 3.2 ms.

float32 and bfloat16. oneDNN packs bfloat16 only where its effective ISA has avx512bw/vl/dq
or avx_ne_convert (an AVX2-only EPYC has neither; ONEDNN_MAX_CPU_ISA can also cap it): what
this CPU allows is found by one tiny pack and multiply per dtype, at first use, and where it
fails the experts stay unpacked (the dispatcher's per-expert torch GEMM), logged once with
oneDNN's reason.

gpt-oss's variant (biases, the clamped SwiGLU) runs here too: the biases are taken per call,
as the reference takes them, and go into oneDNN's linear as its bias operand (added in the
same call, as `F.linear` adds them: the same numbers as the reference's per-expert loop). They
are not packed: a bias is read once per call, not re-blocked, so packing would save nothing,
and the expert layer keeps one copy of them for every backend.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch

from kernels import moe_ref
from kernels.launch import check_expert_biases

PACKED_DTYPES = (torch.float32, torch.bfloat16)

log = logging.getLogger("kernels")


def available(device: torch.device, dtype: torch.dtype) -> bool:
    return (device.type == "cpu" and dtype in PACKED_DTYPES and torch.backends.mkldnn.is_available()
            and onednn_packs(dtype))


@functools.lru_cache(maxsize=None)
def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN packs and multiplies `dtype` weights on this CPU: the real calls, tried
    once on a 16 x 16 weight (torch's own check, `mkldnn._is_mkldnn_bf16_supported`, agrees
    for bfloat16; the probe also covers what it does not ask). Logged once per dtype."""
    try:
        weight = torch.ops.mkldnn._reorder_linear_weight(torch.ones(16, 16, dtype=dtype), None)
        _linear(torch.ones(1, 16, dtype=dtype), weight)
    except RuntimeError as exc:
        log.warning("CPU experts in %s: unpacked weights, the per-expert torch GEMM (oneDNN cannot pack them "
                    "on this CPU: %s)", dtype, str(exc).splitlines()[0])
        return False
    log.info("CPU experts in %s: weights packed for oneDNN at load", dtype)
    return True


@dataclass
class PackedExperts:
    """Per local expert, its gate/up [2I, H] and down [H, I] projections in oneDNN's layout."""

    gate_up: list[torch.Tensor]
    down: list[torch.Tensor]

    @classmethod
    def pack(cls, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> "PackedExperts":
        """w_gate_up [E, 2I, H], w_down [E, H, I] -> packed copies (the originals are untouched)."""
        if not onednn_packs(w_gate_up.dtype):
            raise ValueError(f"w_gate_up: oneDNN cannot pack {w_gate_up.dtype} weights on this CPU "
                             "(check moe_packed.available first)")
        reorder = torch.ops.mkldnn._reorder_linear_weight
        return cls([reorder(w.contiguous(), None) for w in w_gate_up], [reorder(w.contiguous(), None) for w in w_down])


def _linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def grouped_expert_gemm(x: torch.Tensor, counts: list[int], experts: PackedExperts, row_weights: torch.Tensor,
                        activation: moe_ref.ExpertActivation = moe_ref.SWIGLU, gate_up_bias: torch.Tensor | None = None,
                        down_bias: torch.Tensor | None = None) -> torch.Tensor:
    """As `moe_ref.grouped_expert_gemm`, with per-expert row counts read on the host: rows
    [sum(counts[:e]), sum(counts[:e + 1])) go through expert e (the reference's per-expert loop
    over the packed weights); rows past the last count come out zero. `activation` and the
    biases ([E, 2I] and [E, H], x's dtype) as there."""
    two_i = experts.gate_up[0].shape[0] if experts.gate_up else 0  # a packed weight keeps its logical shape
    check_expert_biases(x.dtype, len(experts.gate_up), two_i, x.shape[1], gate_up_bias, down_bias)
    total = sum(counts)
    x = x.contiguous()  # oneDNN reads dense rows
    variant = dict(linear=_linear, activation=activation, gate_up_bias=gate_up_bias, down_bias=down_bias)
    if total == x.shape[0]:
        out = moe_ref._per_expert(x, counts, experts.gate_up, experts.down, **variant)
    else:
        out = torch.zeros_like(x)
        if total:
            out[:total] = moe_ref._per_expert(x[:total], counts, experts.gate_up, experts.down, **variant)
    return (out * row_weights[:, None]).to(x.dtype)
