"""Kernels for the hot paths, taking tensors only (never models or requests).

This module is the one import point the engine uses. Each kernel has a torch reference
(`*_ref.py`) and a Triton implementation (`*_triton.py`) of the same signature;
`kernels.dispatch` picks one per call: on CUDA, per shape bucket, whichever of the two
measured faster the first time (`kernels.choice`); the reference elsewhere;
`MEGAINFER_KERNELS=reference|triton` to override. Tile sizes come from `kernels.tiles`;
`python -m kernels.compile_check` compiles every tile row for NVIDIA GPUs without one.
"""

from kernels.dispatch import (KernelUnavailable, add_layer_norm, add_rms_norm, backend, decode_attention, fused_gating,
                              graph_region, grouped_expert_gemm, latent_attention, paged_attention, prefill_attention, rotary_store_kv)
from kernels.moe_ref import REPLICA_BUCKETS, SWIGLU, ExpertActivation, Gating
from kernels.paged_attention_ref import PagedAttentionBatch, store_kv

__all__ = ["ExpertActivation", "Gating", "REPLICA_BUCKETS", "SWIGLU", "KernelUnavailable", "PagedAttentionBatch",
           "add_layer_norm", "add_rms_norm", "backend", "decode_attention",
           "fused_gating", "graph_region", "grouped_expert_gemm", "latent_attention", "paged_attention", "prefill_attention",
           "rotary_store_kv", "store_kv"]
