"""Kernels for the hot paths, taking tensors only (never models or requests).

This module is the one import point the engine uses. Today every kernel is its torch
reference; Triton implementations bind here behind the same signatures.
"""

from kernels.paged_attention_ref import PagedAttentionBatch, paged_attention, store_kv

__all__ = ["PagedAttentionBatch", "paged_attention", "store_kv"]
