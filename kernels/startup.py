"""A node's kernels, ready before it serves: every Triton variant it will launch built, and the
implementation of every shape it will meet decided (`kernels.choice`), at start, so no serving
step compiles a kernel or stops to time one, and a kernel that cannot run on this GPU is a
start-up error naming it.

The node (the colocated engine, an attention rank, an expert node) begins a `Warmup`, calls the
warm-ups for the operators it runs with its own tensors and limits (sequences, tokens, context
per call), `freeze()`s the choices (and frees what timing the references gathered) before its
memory profile, whose largest step then runs what serving will run, and `finish()`es after it:
the compile watch then counts any later build as one while serving, and the node logs and
reports the `KernelReport`.

The grid: Triton's variants here depend on the model (heads, head dim, page, dtype, expert dims,
tile row), not on batch sizes (those arguments are `do_not_specialize`), except the grouped
GEMM's tile row, chosen by rows per expert; so one call per tile row and per attention kind
builds every variant. Timing decides per shape bucket; the attention grid times decodes and
prefill tokens at powers of 16 (and the node's maxima) over a short, a middle and the longest
context, and a shape met later takes the nearest decided one's implementation."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kernels import dispatch
from kernels.choice import Decision
from kernels.compile_watch import WATCH
from kernels.paged_attention_ref import PagedAttentionBatch, release_scratch

log = logging.getLogger("kernels")


@dataclass(frozen=True)
class KernelReport:
    """Which implementation each of a node's operators runs (crosses processes: node start-up)."""

    mode: str  # dispatch.backend(): "fastest" (per shape, timed), "triton" or "reference"
    why: str  # what chose the mode
    decisions: tuple[Decision, ...] = ()  # per shape, where the mode is "fastest"
    built: int = 0  # Triton variants built during the warm-up
    seconds: float = 0.0  # the warm-up's wall time
    decode: str = ""  # how decode runs: CUDA graphs captured (how many, at which sizes), or eager and why

    def by_operator(self) -> dict[str, dict[str, int]]:
        """operator -> implementation -> shapes that run it."""
        out: dict[str, dict[str, int]] = {}
        for d in self.decisions:
            counts = out.setdefault(d.op, {})
            counts[d.implementation] = counts.get(d.implementation, 0) + 1
        return out

    def lines(self, timing: bool = True) -> list[str]:
        """For the start-up log: the mode, then per operator its implementations (timing: with
        the warm-up's time and builds, which differ between nodes of the same choices)."""
        head = f"kernels: {self.mode} ({self.why})"
        decode = [f"  decode: {self.decode}"] if self.decode else []
        if self.mode != dispatch.FASTEST:
            return [head, *decode]
        if timing:
            head += f"; warm-up {self.seconds:.1f} s, {self.built} Triton variants built"
        ops = [f"  {op}: " + ", ".join(f"{impl} on {n} shape{'s' if n > 1 else ''}" for impl, n in sorted(c.items()))
               for op, c in sorted(self.by_operator().items())]
        refs = [f"    {d.key}: reference ({d.reason}: Triton {d.triton_ms:.3f} ms, reference {d.reference_ms:.3f} ms)"
                for d in self.decisions if d.implementation == "reference" and d.triton_ms and d.reference_ms]
        return [head, *ops, *refs, *decode]


def mode_of(device: torch.device) -> tuple[str, str]:
    """(dispatch mode, why) for kernels on `device`."""
    mode = dispatch.backend(device)
    if mode == "reference" and dispatch.env_choice():
        return mode, f"{dispatch.ENV}=reference"
    if mode == "reference":
        return mode, (f"{device.type} tensors: the torch references (the Triton kernels run on CUDA)"
                      if device.type != "cuda" else "Triton is not installed (pip install triton)")
    if mode == "triton":
        return mode, f"{dispatch.ENV}=triton: every shape, untimed"
    return mode, "per shape, the faster of Triton and the torch reference, timed at start"


@dataclass
class Warmup:
    """One node's warm-up: begin, call the operators' warm-ups, `finish()`."""

    device: torch.device
    mode: str = ""
    why: str = ""
    _start: float = field(default=0.0, repr=False)
    _built: int = field(default=0, repr=False)

    def __post_init__(self) -> None:
        self.mode, self.why = mode_of(self.device)
        self._start = time.perf_counter()
        if self.active:
            WATCH.install()
            WATCH.warming_up()
            dispatch.thaw()
        self._built = WATCH.built

    @property
    def active(self) -> bool:
        """Whether this device compiles Triton kernels (CUDA, not the interpreter)."""
        return self.device.type == "cuda" and self.mode != "reference"

    def freeze(self) -> None:
        """The choices are made: nothing is timed from here on, and the buffers the references'
        timing gathered are freed (before the memory profile, which would count them)."""
        if self.active:
            dispatch.freeze()
            release_scratch()
            torch.cuda.empty_cache()

    def finish(self) -> KernelReport:
        """Serving begins (after the memory profile): a Triton variant built from now on is a
        stall while serving. Returns the report (built: every variant built since `begin`)."""
        self.freeze()
        report = KernelReport(self.mode, self.why,
                              tuple(dispatch.decisions()) if self.mode == dispatch.FASTEST else (),
                              WATCH.built - self._built, time.perf_counter() - self._start)
        if self.active:
            dispatch.serving_begins()
            WATCH.serving()
        for line in report.lines():
            log.info(line)
        return report


def _powers(limit: int, step: int) -> list[int]:
    """1, step, step^2, ... below `limit`, then `limit` itself (limit >= 1)."""
    out, n = [], 1
    while n < limit:
        out.append(n)
        n *= step
    return out + [limit]


def attention_grid(max_decodes: int, max_tokens: int, max_len: int) -> list[tuple[int, int, int]]:
    """(decodes, prefill tokens, context) points to decide: decodes and prefill tokens at 0,
    powers of 16 and the maxima, within a step's `max_tokens` together; contexts short (256),
    middle (geometric) and the longest."""
    decodes = [0, *_powers(min(max_decodes, max_tokens), 16)] if max_decodes > 0 else [0]
    prefill = [0, *[p for p in _powers(max_tokens, 16) if p >= 16]] if max_tokens > 0 else [0]
    short = min(256, max_len)
    lens = sorted({short, int(math.sqrt(short * max_len)), max_len})
    return [(d, p, n) for d in decodes for p in prefill for n in lens if (d or p) and p <= n and d + p <= max_tokens]


def _paged_batch(decodes: int, prefill: int, length: int, page: int, num_blocks: int,
                 device: torch.device) -> tuple[PagedAttentionBatch, int]:
    """A batch of `decodes` one-token sequences and (if `prefill`) one chunk of `prefill` tokens,
    every sequence `length` tokens long, their pages taken round-robin from the cache's blocks
    (read only: the warm-up writes nothing to the cache)."""
    seqs = decodes + (1 if prefill else 0)
    pages = -(-length // page)
    tables = (torch.arange(seqs * pages, dtype=torch.int32) % num_blocks).view(seqs, pages).to(device)
    batch = PagedAttentionBatch.of(tables, [length] * seqs, [1] * decodes + ([prefill] if prefill else []))
    return batch, batch.query_start_host[-1]


def warm_up_attention(key_cache: torch.Tensor, value_cache: torch.Tensor, query_heads: int, scale: float,
                      grid: list[tuple[int, int, int]], sinks: torch.Tensor | None = None, window: int = 0) -> None:
    """The paged attention (POD's fused kernel on Triton) at every grid point, over this cache;
    sinks, window: the variant a layer serves (gpt-oss: once per layer kind)."""
    num_blocks, page, _, head_dim = key_cache.shape
    for decodes, prefill, length in grid:
        batch, tokens = _paged_batch(decodes, prefill, length, page, num_blocks, key_cache.device)
        query = torch.randn(tokens, query_heads, head_dim, device=key_cache.device, dtype=key_cache.dtype)
        dispatch.paged_attention(query, key_cache, value_cache, batch, scale, sinks=sinks, window=window)


def warm_up_norm_rope(query_heads: int, kv_heads: int, norm_weight: torch.Tensor, eps: float, cos: torch.Tensor,
                      sin: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      add_norm: Callable = dispatch.add_rms_norm, rotary: bool = True) -> None:
    """The attention half's fused kernels (one variant each per model): the rotation with the
    KV write, over a projection laid out as the layer's (q, k, v side by side: strided views),
    into this scratch cache (not for MLA, `rotary` False: it rotates its few rotary dims itself);
    the residual add with the norm after it (`add_norm`: the layer's, RMSNorm's or DBRX's LayerNorm's)."""
    device, dtype, d = key_cache.device, key_cache.dtype, key_cache.shape[-1]
    hidden = torch.randn(2, norm_weight.shape[0], device=device, dtype=dtype)
    add_norm(hidden, hidden, norm_weight, eps)
    if not rotary:
        return
    qkv = torch.randn(2, (query_heads + 2 * kv_heads) * d, device=device, dtype=dtype)
    qk = qkv[:, :(query_heads + kv_heads) * d].view(2, query_heads + kv_heads, d)
    v = qkv[:, (query_heads + kv_heads) * d:].view(2, kv_heads, d)
    positions = torch.zeros(2, dtype=torch.int64, device=device)
    dispatch.rotary_store_kv(qk, v, positions, cos, sin, key_cache, value_cache, positions, query_heads)


def warm_up_gating(route: Callable[[torch.Tensor], object], width: int, max_tokens: int, dtype: torch.dtype,
                   device: torch.device) -> None:
    """Fused gating as the node routes (`route`: its input [tokens, width] to the gating, which
    fixes the variant: the logits' dtype, the node map, the slot table), at the node's token counts."""
    for tokens in _powers(max_tokens, 16):
        route(torch.randn(tokens, width, device=device, dtype=dtype))


def warm_up_experts(w_gate_up: torch.Tensor, w_down: torch.Tensor, top_k: int, max_pairs: int,
                    activation=None, gate_up_bias: torch.Tensor | None = None,
                    down_bias: torch.Tensor | None = None) -> None:
    """The grouped expert GEMM with this node's weights, at pair counts from one token's to the
    node's largest (powers of 4: every tile row, by rows per expert, is built and decided);
    activation and biases: the variant the node serves (gpt-oss's clamped SwiGLU with biases)."""
    variant = {} if activation is None else dict(activation=activation)
    variant.update(gate_up_bias=gate_up_bias, down_bias=down_bias)
    experts, _, hidden = w_gate_up.shape
    for pairs in _powers(max_pairs, 4):
        if pairs < top_k and pairs != max_pairs:
            continue
        x = torch.randn(pairs, hidden, device=w_gate_up.device, dtype=w_gate_up.dtype)
        per_expert = [pairs * e // experts for e in range(experts + 1)]  # spread evenly: rows per expert as served
        offsets = torch.tensor(per_expert, dtype=torch.int64, device=w_gate_up.device)
        dispatch.grouped_expert_gemm(x, offsets, w_gate_up, w_down, torch.rand(pairs, device=w_gate_up.device),
                                     **variant)
