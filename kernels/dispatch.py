"""The one place that picks an implementation for each kernel call: on CUDA, per shape
bucket, the faster of the Triton kernel and the torch reference (`kernels.choice` times both
once, at node start: `kernels.startup`); elsewhere the reference. `MEGAINFER_KERNELS=
reference|triton` overrides (Triton on CPU tensors needs `TRITON_INTERPRET=1`, Triton's
interpreter: correct and slow, for tests). A Triton kernel that fails raises
`choice.KernelFailed`; nothing falls back to the reference unasked.

The Triton modules are imported on first use, so CPU-only runs never import Triton."""

from __future__ import annotations

import contextlib
import importlib
import threading

import torch

from kernels.choice import KernelFailed, ShapeChoice, ShapeKey, bucket
from kernels.kernel_settings import KERNELS, SettingError
from kernels.launch import interpreted
from kernels.moe_ref import SWIGLU

BACKENDS = KERNELS.choices  # what MEGAINFER_KERNELS may force
ENV = KERNELS.name
FASTEST = "fastest"  # what `backend` answers on CUDA without an override: per shape, timed
_choice = ShapeChoice()
ATTENTION_DIMS = ("decodes", "prefill_tokens", "max_len")
GATING_RULE = "always Triton on CUDA: every rank must route alike (and the reference syncs the host)"
FUSED_RULE = "always Triton on CUDA: one launch where the reference takes several, each a pass over memory"
# The most the torch reference may gather (keys and values of a batch's pages) to be timed or
# run: beyond it the Triton kernel, which pages in place, runs untimed. A warm-up's largest
# shapes would otherwise hold tens of GB through the memory profile, and a serving step that
# took the reference at a larger shape than any timed one could run out of memory mid-serving.
REFERENCE_GATHER_LIMIT = 2 << 30


class KernelUnavailable(RuntimeError):
    """The requested kernel backend cannot run here (the message says why and what to do)."""


def triton_available() -> bool:
    try:
        importlib.import_module("triton")
    except ImportError:
        return False
    return True


# Inside `graph_region`, on this thread: Triton kernels only, nothing timed. Per thread: in a
# process running several nodes (tests, the GPU check's pair) the others' eager calls are theirs.
_region = threading.local()


@contextlib.contextmanager
def graph_region():
    """A CUDA graph's region is being warmed up or captured: every kernel is the Triton one (the
    references synchronise with the host, and timing one against the other would launch and
    wait inside the capture), on CUDA or under Triton's interpreter."""
    if not triton_available():
        raise KernelUnavailable("CUDA graphs capture the Triton kernels, and Triton is not installed: "
                                "pip install triton, or run eager (--enforce-eager)")
    before, _region.active = _capturing(), True
    try:
        yield
    finally:
        _region.active = before


def _capturing() -> bool:
    return getattr(_region, "active", False)


def backend(device: torch.device) -> str:
    """How kernels on `device` are picked now: "reference", "triton", or FASTEST (on CUDA: per
    shape bucket, whichever of the two measured faster)."""
    if _capturing():
        return "triton"
    choice = env_choice()
    if choice == "reference":
        return "reference"
    if choice == "triton":
        if not triton_available():
            raise KernelUnavailable(f"{ENV}=triton but Triton is not installed: pip install triton")
        if device.type != "cuda" and not interpreted():
            raise KernelUnavailable(f"{ENV}=triton on {device.type} tensors needs Triton's interpreter: set "
                                    "TRITON_INTERPRET=1 (slow; meant for tests), or unset " + ENV)
        return "triton"
    return FASTEST if device.type == "cuda" and triton_available() else "reference"


def env_choice() -> str:
    """MEGAINFER_KERNELS now: one of BACKENDS, or "" when unset; KernelUnavailable naming the fix when
    it holds anything else."""
    try:
        return KERNELS.read()
    except SettingError as exc:
        raise KernelUnavailable(str(exc)) from None


def decisions() -> list:
    """Every shape decided in this process so far (`choice.Decision`s, oldest first)."""
    return list(_choice.decisions.values())


def freeze() -> None:
    """Serving starts: no more timing; a new shape takes the nearest decided one's choice."""
    _choice.frozen = True


def thaw() -> None:
    """Another warm-up begins in this process (a second engine): shapes may be timed again."""
    _choice.frozen = False


def serving_begins() -> None:
    """The node serves from now on: shapes first met count as met while serving."""
    _choice.met_while_serving = 0


def shapes_met_while_serving() -> int:
    """Shapes first met after `freeze()`, given the nearest decided shape's implementation."""
    return _choice.met_while_serving


def _pick(mode: str, key, triton_fn, reference_fn):
    """Run the implementation `mode` (what `backend` answered) picks; `key` (a shape bucket) is
    built only when it is needed."""
    if mode == "reference":
        return reference_fn()
    if mode == "triton":
        try:
            return triton_fn()
        except Exception as exc:
            raise KernelFailed(f"Triton kernel failed at {key()} (MEGAINFER_KERNELS=triton): "
                               f"{type(exc).__name__}: {exc}") from exc
    return _choice.run(key(), triton_fn, reference_fn)


def _attention_shape(query, key_cache, sinks=None, window: int = 0) -> tuple:
    """dtype, query heads, kv heads, head dim, page size: fixed by the model; then "sinks" and
    "window=W" where the layer has them (other Triton builds, other timings: a model's sliding
    and full layers decide their shapes apart)."""
    variant = (("sinks",) if sinks is not None else ()) + ((f"window={window}",) if window else ())
    return query.dtype, query.shape[1], key_cache.shape[2], query.shape[2], key_cache.shape[1], *variant


def paged_attention(query, key_cache, value_cache, batch, scale: float, sinks=None, window: int = 0):
    """A hybrid batch's attention (decodes first, then prefill chunks): POD's fused kernel on
    Triton, its plan and shape bucket built once per batch and reused by every layer (once per
    window: gpt-oss's sliding and full layers plan their decode splits apart). sinks, window:
    gpt-oss's, as `paged_attention_ref` defines them."""
    from kernels import paged_attention_ref as r

    shape = _attention_shape(query, key_cache, sinks, window)

    def triton_fn():
        from kernels import attention_triton as t

        plan = batch.memo(("pod", shape, query.device), lambda: t.plan_pod(
            query, key_cache, batch.block_tables, batch.query_start_host, batch.num_single,
            max(batch.seq_lens_host[:batch.num_single], default=0), window=window))
        return t.pod_attention(query, key_cache, value_cache, batch.block_tables, batch.seq_lens,
                               batch.query_start_loc, batch.query_start_host, batch.num_single, scale, plan=plan,
                               sinks=sinks, window=window)

    def key():
        return batch.memo(("bucket", shape), lambda: ShapeKey(
            "paged_attention", shape, (bucket(batch.num_single), bucket(batch.query_start_host[-1] - batch.num_single),
                                       bucket(max(batch.seq_lens_host, default=0))), ATTENTION_DIMS))

    mode = backend(query.device)
    if mode == FASTEST and query.shape[-1] > TRITON_MAX_HEAD_DIM:
        return _choice.reference_only(key(), lambda: r.paged_attention(query, key_cache, value_cache, batch, scale,
                                                                       sinks, window), WIDE_HEADS_RULE)
    if mode == FASTEST:  # once per batch, reused by every layer of the step
        too_large = batch.memo(("reference_gather", shape),
                               lambda: _over_gather_limit(r.gather_bytes(key_cache, batch, window)))
        if too_large:
            return _choice.fixed(key(), triton_fn, too_large)
    return _pick(mode, key, triton_fn,
                 lambda: r.paged_attention(query, key_cache, value_cache, batch, scale, sinks, window))


# The generic Triton attention kernels hold a head's whole width in registers and shared memory:
# a 576-wide head spills and overflows an H100's shared memory there (`python -m
# kernels.compile_check`), so such shapes run the torch reference, said so. MLA's latent heads
# (DeepSeek) do not come here: `latent_attention` has kernels of its own.
TRITON_MAX_HEAD_DIM = 256
WIDE_HEADS_RULE = (f"heads wider than {TRITON_MAX_HEAD_DIM} exceed the generic Triton attention kernels' tiles; "
                   "the torch reference runs them (MLA's latent heads take kernels.latent_attention)")


def latent_attention(query, cache, batch, scale: float, rank: int):
    """DeepSeek's latent attention (MLA, absorbed) of a hybrid batch over its [c | k_r] cache ->
    [T, H, rank]: Triton's split-KV decode and prefill tiles (`latent_attention_triton`), their
    plan built once per batch and reused by every layer, or the reference."""
    from kernels import latent_attention_ref as r
    from kernels import paged_attention_ref

    shape = (query.dtype, query.shape[1], query.shape[2], rank, cache.shape[1])

    def triton_fn():
        from kernels import latent_attention_triton as t

        plan = batch.memo(("latent", shape, query.device), lambda: t.plan_latent(
            query, rank, batch.block_tables, cache.shape[1], batch.query_start_host, batch.num_single,
            max(batch.seq_lens_host[:batch.num_single], default=0)))
        return t.latent_attention(query, cache, batch.block_tables, batch.seq_lens, batch.query_start_loc,
                                  batch.query_start_host, batch.num_single, scale, rank, plan=plan)

    def key():
        return batch.memo(("latent bucket", shape), lambda: ShapeKey(
            "latent_attention", shape, (bucket(batch.num_single), bucket(batch.query_start_host[-1] - batch.num_single),
                                        bucket(max(batch.seq_lens_host, default=0))), ATTENTION_DIMS))

    def reference():
        return r.latent_attention(query, cache, batch, scale, rank)

    mode = backend(query.device)
    if mode == FASTEST:  # once per batch, reused by every layer of the step
        too_large = batch.memo(("latent reference_gather", shape),
                               lambda: _over_gather_limit(paged_attention_ref.gather_bytes(cache, batch)))
        if too_large:
            return _choice.fixed(key(), triton_fn, too_large)
    return _pick(mode, key, triton_fn, reference)


def _over_gather_limit(gather: int) -> str:
    """Why the reference is not timed at this shape ("" where it may be)."""
    if gather <= REFERENCE_GATHER_LIMIT:
        return ""
    return f"the torch reference would gather {gather / 2 ** 30:.1f} GiB of pages: not timed"


def decode_attention(query, key_cache, value_cache, block_tables, seq_lens, scale: float, sinks=None,
                     window: int = 0):
    from kernels import paged_attention_ref as r

    def triton_fn():
        from kernels import attention_triton as t

        return t.decode_attention(query, key_cache, value_cache, block_tables, seq_lens, scale, sinks=sinks,
                                  window=window)

    def key():
        return ShapeKey("decode_attention", _attention_shape(query, key_cache, sinks, window),
                        (bucket(query.shape[0]), bucket(block_tables.shape[1] * key_cache.shape[1])), ("seqs", "len"))

    return _pick(backend(query.device), key, triton_fn,
                 lambda: r.decode_attention(query, key_cache, value_cache, block_tables, seq_lens, scale, sinks, window))


def prefill_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                      query_start_host: list[int], scale: float, sinks=None, window: int = 0):
    from kernels import paged_attention_ref as r

    def triton_fn():
        from kernels import attention_triton as t

        return t.prefill_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                                   query_start_host, scale, sinks=sinks, window=window)

    def key():
        return ShapeKey("prefill_attention", _attention_shape(query, key_cache, sinks, window),
                        (bucket(query.shape[0]), bucket(block_tables.shape[1] * key_cache.shape[1])), ("tokens", "len"))

    return _pick(backend(query.device), key, triton_fn, lambda: r.prefill_attention(
        query, key_cache, value_cache, block_tables, seq_lens, query_start_host, scale, sinks, window))


def fused_gating(logits, top_k: int, renormalize: bool, expert_node=None, num_nodes: int = 0, valid=None,
                 expert_slots=None):
    """On CUDA always the Triton kernel (not timed): every rank of a tensor-parallel node must
    route its tokens alike, and a per-process timed choice could pick differently on two ranks
    (ties rounded differently); the reference also synchronises the host (`nonzero`). Only
    MEGAINFER_KERNELS=reference runs the reference there."""
    from kernels import moe_ref as r

    def triton_fn():
        from kernels import moe_triton as t

        return t.fused_gating(logits, top_k, renormalize, expert_node, num_nodes, valid, expert_slots)

    def key():
        nodes = num_nodes if expert_node is not None else 0
        buckets = 0 if expert_slots is None else expert_slots.shape[1]
        return ShapeKey("fused_gating", (logits.dtype, logits.shape[1], top_k, renormalize, nodes, buckets),
                        (bucket(logits.shape[0]),), ("tokens",))

    def reference():
        return r.fused_gating(logits, top_k, renormalize, expert_node, num_nodes, valid, expert_slots)

    mode = backend(logits.device)
    if mode == FASTEST:
        return _choice.fixed(key(), triton_fn, GATING_RULE)
    return _pick(mode, key, triton_fn, reference)


def add_rms_norm(x, residual, weight, eps: float):
    """(RMSNorm(residual + x), residual + x): a layer's residual add and the norm after it, one
    kernel on CUDA (not timed: `FUSED_RULE`)."""
    return _add_norm("add_rms_norm", x, residual, weight, eps)


def add_layer_norm(x, residual, weight, eps: float):
    """(LayerNorm(residual + x), residual + x) without a bias (DBRX), one kernel on CUDA (`FUSED_RULE`)."""
    return _add_norm("add_layer_norm", x, residual, weight, eps)


def _add_norm(op: str, x, residual, weight, eps: float):
    """`op` ("add_rms_norm" or "add_layer_norm"), by the function of that name in the reference
    and the Triton module."""
    from kernels import norm_rope_ref as r

    def triton_fn():
        from kernels import norm_rope_triton as t

        return getattr(t, op)(x, residual, weight, eps)

    def key():
        return ShapeKey(op, (x.dtype, x.shape[1]), (bucket(x.shape[0]),), ("tokens",))

    return _fused(x.device, key, triton_fn, lambda: getattr(r, op)(x, residual, weight, eps))


def rotary_store_kv(qk, v, positions, cos, sin, key_cache, value_cache, slot_mapping, num_q_heads: int):
    """q and k side by side ([T, Hq + Hkv, D]) rotated at `positions`, the rotated keys and the
    values written to their cache slots; returns the rotated qk. One kernel on CUDA (`FUSED_RULE`)."""
    from kernels import norm_rope_ref as r

    def triton_fn():
        from kernels import norm_rope_triton as t

        return t.rotary_store_kv(qk, v, positions, cos, sin, key_cache, value_cache, slot_mapping, num_q_heads)

    def key():
        return ShapeKey("rotary_store_kv", (qk.dtype, num_q_heads, qk.shape[1], qk.shape[2]), (bucket(qk.shape[0]),),
                        ("tokens",))

    return _fused(qk.device, key, triton_fn, lambda: r.rotary_store_kv(qk, v, positions, cos, sin, key_cache,
                                                                         value_cache, slot_mapping, num_q_heads))


def _fused(device, key, triton_fn, reference):
    mode = backend(device)
    if mode == FASTEST:
        return _choice.fixed(key(), triton_fn, FUSED_RULE)
    return _pick(mode, key, triton_fn, reference)


def grouped_expert_gemm(x, expert_offsets, w_gate_up, w_down, row_weights, packed=None, activation=SWIGLU,
                        gate_up_bias=None, down_bias=None):
    """`expert_offsets`: a list, or an int64 tensor [E + 1] on x's device (the Triton kernel reads
    it there; the torch reference, which loops over experts on the host, reads it back).
    `packed`: the same experts prepacked for the CPU (`moe_packed.PackedExperts`): used on CPU
    tensors unless MEGAINFER_KERNELS asks for another backend.
    `activation` (`moe_ref.ExpertActivation`, plain SwiGLU by default) and the biases
    (gate_up_bias [E, 2I], down_bias [E, H], or None): gpt-oss's experts, as
    `moe_ref.grouped_expert_gemm` computes them on every backend, the packed one included. Each
    bias is added as given (under tensor parallelism the caller passes down_bias on one rank)."""
    from kernels import moe_ref as r

    variant = dict(activation=activation, gate_up_bias=gate_up_bias, down_bias=down_bias)
    if packed is not None and x.device.type == "cpu" and not env_choice() and not _capturing():
        from kernels import moe_packed

        offsets = expert_offsets.tolist() if isinstance(expert_offsets, torch.Tensor) else list(expert_offsets)
        return moe_packed.grouped_expert_gemm(x, [b - a for a, b in zip(offsets, offsets[1:])], packed, row_weights,
                                              **variant)

    def triton_fn():
        from kernels import moe_triton as t

        return t.grouped_expert_gemm(x, expert_offsets, w_gate_up, w_down, row_weights, **variant)

    def key():
        # The plain variant keeps its key (decisions already reported); gpt-oss's adds the activation
        # and which biases it carries: each variant is its own kernel and is timed on its own.
        kind = () if activation == SWIGLU else (str(activation),)
        biases = "+".join(n for n, b in (("gate_up", gate_up_bias), ("down", down_bias)) if b is not None)
        kind += (f"bias={biases}",) if biases else ()
        return ShapeKey("grouped_expert_gemm", (x.dtype, *w_gate_up.shape, w_down.shape[2], *kind),
                        (bucket(x.shape[0]),), ("pairs",))

    def reference():
        offsets = expert_offsets.tolist() if isinstance(expert_offsets, torch.Tensor) else expert_offsets
        return r.grouped_expert_gemm(x, offsets, w_gate_up, w_down, row_weights, **variant)

    return _pick(backend(x.device), key, triton_fn, reference)
