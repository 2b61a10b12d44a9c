"""CUDA graphs of decode: each (layer, micro-batch)'s attention half on an attention rank and
expert half on an expert node, captured once per batch size and replayed, so a decode
(layer, micro-batch) costs the host one graph launch instead of dozens of kernel launches
(vLLM's `cudagraph_capture_sizes`; its AFD plugin and FastAFD run decode the same way).

A graph replays fixed addresses and fixed shapes. So every graph reads and writes static
buffers (a `AttentionSlot` or `ExpertSlot`): a step copies its rows in, padded up to the
nearest captured size, replays, and reads the outputs as views of the first rows. Padding
rows are harmless by construction: the gating kernel routes no row at or past the live count
(`valid`, a device scalar the graph reads at replay), an expert layer computes none, and on
an attention rank a padding row is a one-token sequence whose key and value land in a block
of its own (`pad_block`, one past the scheduler's blocks), which no sequence owns.

Attention graphs are per (layer, micro-batch, size): a micro-batch's inputs (positions, block
tables, lengths, slots) are copied once per step into its own slot and read by every layer's
graph, and its outputs stay in its slot until its answers come back, which is before the slot
is written again. Expert graphs are per (layer, size), one slot per size shared by the
micro-batches: the answers are copied out of it right after the replay, since the slot's next
user may replay before the answers' copy to the host has run.

Decode only: a micro-batch with prompt tokens, or larger than the largest size, runs eager.
The captured functions are the eager ones (`attend_and_pack`, `ExpertLayer.forward`): both
paths compute the same thing. `capture_audit.py` checks on the CPU that they are
capture-safe. On the CPU nothing is captured (`Capture` is injected: `RerunCapture` replays a
region by running it again, to check the static-buffer and padding logic).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

import kernels
from megainfer.engine_config import EngineConfig
from megainfer.disagg.attention_dispatch import DispatchParts, attend_and_pack
from megainfer.disagg.expert_link import unpack_dispatch
from megainfer.disagg.graph_sizes import capture_sizes, size_for  # noqa: F401 (this module's API too)
from megainfer.model.expert_layer import ExpertLayer
from megainfer.model.moe_model import MoEModel

logger = logging.getLogger(__name__)

BatchInputs = tuple[torch.Tensor, torch.Tensor, kernels.PagedAttentionBatch]  # ids, positions, metadata


class Replay(Protocol):
    def replay(self) -> None: ...


class Capture(Protocol):
    """Records a region once; the replay runs it again."""

    def warm_up(self, region: Callable[[], None]) -> None: ...

    def __call__(self, region: Callable[[], None]) -> Replay: ...


class CudaCapture:
    """`Capture` on CUDA: one `torch.cuda.CUDAGraph` per region, all in one memory pool (they
    never run at once), captured on a side stream as torch requires."""

    def __init__(self, device: torch.device) -> None:
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(device)

    def warm_up(self, region: Callable[[], None]) -> None:
        """Run once before capture (kernel compilation, cuBLAS workspaces), on the capture stream."""
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        with torch.cuda.stream(self.stream):
            region()
        torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)

    def __call__(self, region: Callable[[], None]) -> Replay:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
            region()
        return graph


class RerunCapture:
    """`Capture` where there is no GPU (the tests, the GPU check on a CPU): a replay runs the
    region again, op by op, on the same static buffers a graph would read and write, so
    everything but the recording itself is the real path. `lock`: held around each run (Triton's
    interpreter is not thread-safe, and a deployment in threads runs several nodes' regions)."""

    def __init__(self, lock: contextlib.AbstractContextManager | None = None) -> None:
        self.lock = lock if lock is not None else contextlib.nullcontext()
        self.regions = 0
        self.replays = 0

    def warm_up(self, region: Callable[[], None]) -> None:
        with self.lock:
            region()

    def __call__(self, region: Callable[[], None]) -> Replay:
        self.regions += 1
        return _Rerun(self, region)


class _Rerun:
    def __init__(self, capture: RerunCapture, region: Callable[[], None]) -> None:
        self.capture, self.region = capture, region

    def replay(self) -> None:
        self.capture.replays += 1
        with self.capture.lock, kernels.graph_region():
            self.region()


@dataclass
class CaptureReport:
    """What a node captured, for its log and status."""

    graphs: int
    sizes: tuple[int, ...]
    seconds: float
    pool_bytes: int  # device memory the captures took (the graphs' pool)
    static_bytes: int  # the static buffers the graphs read and write

    def status(self) -> str:
        """For the node's kernel report (alike on every rank of a node: no timing)."""
        return (f"CUDA graphs, {self.graphs} captured at {len(self.sizes)} batch sizes "
                f"{self.sizes[0]}..{self.sizes[-1]} (prompts and larger batches eager)")

    def summary(self) -> str:
        return (f"{self.status()} in {self.seconds:.1f} s; device memory: {self.static_bytes / 2 ** 20:.0f} MiB of "
                f"static buffers, {self.pool_bytes / 2 ** 20:.0f} MiB in the graphs' pool (outside the memory profile)")


def decode_capture(device: torch.device, enforce_eager: bool, node: str) -> "Capture | None":
    """How `node` captures decode's graphs, or None where it runs eager (said in its log where
    a GPU could have captured)."""
    if device.type != "cuda":
        return None
    reason = eager_reason(device, enforce_eager)
    if reason:
        (logger.info if enforce_eager else logger.warning)("%s: decode runs %s", node, reason)
        return None
    return CudaCapture(device)


def eager_reason(device: torch.device, enforce_eager: bool) -> str:
    """Why decode runs eager on `device` ("" where it can capture)."""
    if enforce_eager:
        return "eager (--enforce-eager)"
    if device.type != "cuda":
        return "eager (CUDA graphs need a GPU)"
    if kernels.backend(device) == "reference":
        return ("eager: MEGAINFER_KERNELS=reference, and the torch references synchronise with the host, which a "
                "CUDA graph cannot; unset it to capture")
    if not kernels.dispatch.triton_available():
        return "eager: Triton is not installed, and the graphs capture its kernels (pip install triton)"
    return ""


@dataclass
class AttentionSlot:
    """One micro-batch's static buffers at one size: what its attention graphs read and write."""

    size: int
    hidden: torch.Tensor  # [B, H]
    positions: torch.Tensor  # [B] int64
    batch: kernels.PagedAttentionBatch  # block tables [B, W], lengths, slots: all B rows decoding
    valid: torch.Tensor  # [1] int32: live rows this step
    # The graphs' outputs, copied there by every layer's graph: what a graph allocates comes
    # from the pool the graphs share, where the next capture may reuse it.
    out: DispatchParts
    pad_block: int  # the KV block padding rows write to (no sequence owns it)
    block_size: int
    records_per_row: int  # the most records one row gives (a token goes to at most this many nodes)
    rows: int = 0  # live rows this step
    padded_from: int = 0  # rows at or past this hold the padding row's metadata

    @classmethod
    def empty(cls, size: int, hidden_size: int, max_blocks: int, block_size: int, dtype: torch.dtype,
              device: torch.device, pad_block: int, records_per_row: int, record_size: int,
              expert_nodes: int, windowed: bool = False) -> "AttentionSlot":
        """`windowed`: the model has windowed layers, which read through a window batch of their
        own (block tables and slots; the lengths shared)."""
        i32 = dict(dtype=torch.int32, device=device)
        width = max_blocks * block_size  # the attention kernel plans its splits for the longest a sequence can be

        def paged(seq_lens: torch.Tensor, query_start_loc: torch.Tensor) -> kernels.PagedAttentionBatch:
            return kernels.PagedAttentionBatch(
                block_tables=torch.full((size, max_blocks), pad_block, **i32), seq_lens=seq_lens,
                query_start_loc=query_start_loc,
                slot_mapping=torch.full((size,), pad_block * block_size, dtype=torch.int64, device=device),
                num_single=size, seq_lens_host=[width] * size, query_start_host=list(range(size + 1)))

        batch = paged(torch.ones(size, **i32), torch.arange(size + 1, **i32))
        if windowed:
            batch.window_batch = paged(batch.seq_lens, batch.query_start_loc)
        rows = max(1, size * records_per_row)  # as the gating kernel sizes its send order
        out = DispatchParts(torch.zeros(size, hidden_size, dtype=dtype, device=device),
                            torch.zeros(rows, record_size, dtype=torch.uint8, device=device),
                            torch.zeros(expert_nodes + 1, dtype=torch.int64, device=device),
                            torch.zeros(rows, dtype=torch.int64, device=device))
        return cls(size, torch.zeros(size, hidden_size, dtype=dtype, device=device),
                   torch.zeros(size, dtype=torch.int64, device=device), batch, torch.zeros(1, **i32), out, pad_block,
                   block_size, records_per_row)

    def load(self, inputs: BatchInputs, rows: int) -> None:
        """This step's metadata of the micro-batch's `rows` decodes; rows past them padding."""
        _, positions, batch = inputs
        static = self.batch
        self.positions[:rows].copy_(positions, non_blocking=True)
        static.seq_lens[:rows].copy_(batch.seq_lens, non_blocking=True)  # the window batch's too: one tensor
        pairs = [(static, batch)] if static.window_batch is None else [(static, batch),
                                                                       (static.window_batch, batch.window_batch)]
        for held, given in pairs:
            held.block_tables[:rows, :given.block_tables.shape[1]].copy_(given.block_tables, non_blocking=True)
            held.slot_mapping[:rows].copy_(given.slot_mapping, non_blocking=True)
        if rows < self.padded_from:  # rows the last step used become padding again
            span = slice(rows, self.padded_from)
            self.positions[span].zero_()
            static.seq_lens[span] = 1
            for held, _ in pairs:
                held.block_tables[span, 0] = self.pad_block
                held.slot_mapping[span] = self.pad_block * self.block_size
        self.padded_from = rows
        self.valid.fill_(rows)
        self.rows = rows

    def outputs(self) -> DispatchParts:
        """The live rows' views of the outputs."""
        r, out, n = self.rows, self.out, self.rows * self.records_per_row
        return DispatchParts(out.residual[:r], out.records[:n], out.node_offsets, out.token_ids[:n])


class AttentionGraphs:
    """An attention rank's decode graphs: per (layer, micro-batch, size)."""

    def __init__(self, model: MoEModel, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], expert_counts: torch.Tensor,
                 sizes: tuple[int, ...], micro_batches: int, max_blocks: int, block_size: int, pad_block: int,
                 expert_nodes: int, record_size: int, tp_size: int = 1) -> None:
        """`expert_counts`: the runner's [layers, experts] counts, which the graphs add to (so it
        lives as long as they do); `pad_block`: a KV block no sequence owns."""
        self.model, self.kv_caches, self.expert_counts = model, kv_caches, expert_counts
        self.sizes, self.tp_size = sizes, tp_size
        records_per_row = min(model.cfg.top_k, expert_nodes)  # a token goes to at most this many nodes
        device, dtype = model.embed.weight.device, model.embed.weight.dtype
        self.slots = [{size: AttentionSlot.empty(size, model.cfg.hidden_size, max_blocks, block_size, dtype, device,
                                                 pad_block, records_per_row, record_size, expert_nodes,
                                                 windowed=bool(model.cfg.kv_window))
                       for size in sizes} for _ in range(micro_batches)]
        self.graphs: dict[tuple[int, int, int], Replay] = {}
        self.active: list[AttentionSlot | None] = [None] * micro_batches  # this step's slot of each micro-batch

    def static_bytes(self) -> int:
        return static_bytes(t for slots in self.slots for slot in slots.values() for t in (
            slot.hidden, slot.positions, slot.batch.block_tables, slot.batch.seq_lens, slot.batch.slot_mapping,
            slot.out.residual, slot.out.records, slot.out.token_ids) + (() if slot.batch.window_batch is None else (
                slot.batch.window_batch.block_tables, slot.batch.window_batch.slot_mapping)))

    def region(self, layer: int, slot: AttentionSlot) -> Callable[[], None]:
        """What `layer`'s graph on `slot` records (run it under `kernels.graph_region` to launch it op by op)."""
        def region() -> None:
            parts = attend_and_pack(self.model.attention_layers[layer], self.model.rotary, self.kv_caches[layer],
                                    slot.hidden, slot.positions, slot.batch, self.expert_counts[layer],
                                    self.tp_size, slot.valid)
            out = slot.out
            out.residual.copy_(parts.residual)
            out.records.copy_(parts.records)
            out.node_offsets.copy_(parts.node_offsets)
            out.token_ids.copy_(parts.token_ids)
        return region

    def capture(self, capture: Capture) -> int:
        """Every (layer, micro-batch, size) graph; returns how many. Each slot runs once first: the
        Triton kernels compile then, and the attention kernel's launch plan (device tensors made
        from host lists) is built then, for every layer's graph to read, not inside a capture.
        The regions run with padding rows only (valid = 0): they write the padding block and
        count nothing."""
        first_moe = self.model.cfg.first_k_dense  # DeepSeek's dense first layers run eager (no round)
        with kernels.graph_region():
            for size in self.sizes:
                for slots in self.slots:  # each slot's batch plans its attention launch once, here
                    capture.warm_up(self.region(first_moe, slots[size]))
                for layer in range(first_moe, len(self.kv_caches)):
                    for j, slots in enumerate(self.slots):
                        self.graphs[layer, j, size] = capture(self.region(layer, slots[size]))
        return len(self.graphs)

    def load(self, j: int, inputs: BatchInputs | None, rows: int) -> bool:
        """Micro-batch j's step inputs into its slot, where this step can replay graphs (a decode
        batch of at most the largest size); False: it runs eager this step."""
        size = size_for(self.sizes, rows) if inputs is not None and rows else None
        if size is None or inputs[2].num_single != rows:
            self.active[j] = None
            return False
        slot = self.active[j] = self.slots[j][size]
        slot.load(inputs, rows)
        return True

    def run(self, layer: int, j: int, hidden: torch.Tensor) -> DispatchParts:
        """Micro-batch j's attention half of `layer` by its graph (after `load` said yes)."""
        slot = self.active[j]
        slot.hidden[:slot.rows].copy_(hidden)
        self.graphs[layer, j, slot.size].replay()
        return slot.outputs()


@dataclass
class ExpertSlot:
    """One size's static buffers on an expert node."""

    size: int
    records: torch.Tensor  # [B * record bytes] uint8
    valid: torch.Tensor  # [1] int32
    out: torch.Tensor  # [B, H] the graphs' output, copied there (see AttentionSlot.out)


class ExpertGraphs:
    """An expert node's (or rank's) decode graphs: per (layer, size)."""

    def __init__(self, layers: list[ExpertLayer], sizes: tuple[int, ...], record_size: int, dtype: torch.dtype,
                 device: torch.device, reduce: Callable[[torch.Tensor], None] | None = None) -> None:
        """`reduce`: a tensor-parallel rank's sum of the partial outputs onto its leader."""
        self.layers, self.sizes, self.record_size, self.dtype, self.reduce = layers, sizes, record_size, dtype, reduce
        hidden = layers[0].cfg.hidden_size
        self.slots = {size: ExpertSlot(size, torch.zeros(size * record_size, dtype=torch.uint8, device=device),
                                       torch.zeros(1, dtype=torch.int32, device=device),
                                       torch.zeros(size, hidden, dtype=dtype, device=device)) for size in sizes}
        self.graphs: dict[tuple[int, int], Replay] = {}

    def static_bytes(self) -> int:
        return static_bytes(t for slot in self.slots.values() for t in (slot.records, slot.out))

    def region(self, layer: int, slot: ExpertSlot) -> Callable[[], None]:
        """What `layer`'s graph on `slot` records."""
        cfg = self.layers[layer].cfg

        def region() -> None:
            x, ids, weights = unpack_dispatch(slot.records, slot.size, cfg.hidden_size, cfg.top_k, self.dtype)
            y = self.layers[layer](x, ids.to(torch.int64), weights, slot.valid)
            if self.reduce is not None:
                self.reduce(y)
            slot.out.copy_(y)
        return region

    def capture(self, capture: Capture) -> int:
        """Every (MoE layer, size) graph; returns how many (each size run once first, as above).
        DeepSeek's dense first layers hold no experts (no slot) and are never served here."""
        moe_layers = [i for i, layer in enumerate(self.layers) if layer.slots.room]
        with kernels.graph_region():
            for size in self.sizes:
                capture.warm_up(self.region(moe_layers[0], self.slots[size]))
                for layer in moe_layers:
                    self.graphs[layer, size] = capture(self.region(layer, self.slots[size]))
        return len(self.graphs)

    def run(self, layer: int, records: torch.Tensor, tokens: int) -> torch.Tensor | None:
        """`tokens` tokens' answers of `layer` by its graph, or None where no size holds them (run
        eager). The answers are a copy: the slot's next replay may come before they are sent."""
        size = size_for(self.sizes, tokens)
        if size is None:
            return None
        slot = self.slots[size]
        slot.records[:records.numel()].copy_(records.view(-1), non_blocking=True)
        slot.valid.fill_(tokens)
        self.graphs[layer, size].replay()
        return slot.out[:tokens].clone()


def static_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def capture_timed(graphs: "AttentionGraphs | ExpertGraphs", capture: Capture, device: torch.device) -> CaptureReport:
    """Capture every graph of `graphs` and report what it took."""
    start = time.perf_counter()
    before = torch.cuda.memory_reserved(device) if device.type == "cuda" else 0
    count = graphs.capture(capture)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    used = (torch.cuda.memory_reserved(device) if device.type == "cuda" else 0) - before
    report = CaptureReport(count, graphs.sizes, time.perf_counter() - start, used, graphs.static_bytes())
    logger.info("%s", report.summary())
    return report


def capture_attention(capture: Capture | None, model: MoEModel, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                      expert_counts: torch.Tensor, config: EngineConfig, micro_batches: int, max_model_len: int,
                      pad_block: int, expert_nodes: int, record_size: int,
                      tp_size: int) -> tuple[AttentionGraphs | None, str]:
    """An attention rank's decode graphs, every (layer, micro-batch, size), captured, and the line
    its kernels report for decode; (None, why) where it runs eager."""
    device = torch.device(config.device)
    if capture is None:
        return None, eager_reason(device, config.enforce_eager)
    sizes = capture_sizes(-(-config.max_num_seqs // micro_batches), config.cuda_graph_sizes)
    graphs = AttentionGraphs(model, kv_caches, expert_counts, sizes, micro_batches,
                             -(-max_model_len // config.block_size), config.block_size, pad_block, expert_nodes,
                             record_size, tp_size)
    with torch.inference_mode():
        return graphs, capture_timed(graphs, capture, device).status()


def capture_experts(most_tokens: int, sizes: tuple[int, ...] | None, layers: list[ExpertLayer], record_size: int,
                    dtype: torch.dtype, device: torch.device, reduce: Callable[[torch.Tensor], None] | None,
                    node: str) -> tuple[ExpertGraphs | None, str]:
    """An expert node's decode graphs, every (layer, size), captured on CUDA, and the line its
    kernels report for decode: (layer, micro-batch)s of up to `most_tokens` (a decode's most from
    every attention node) replay them, at `sizes` or a ladder's; (None, why) where it runs eager
    (0 tokens: --enforce-eager). `reduce`: a tensor-parallel node's sum of its ranks' outputs."""
    capture = decode_capture(device, False, node) if most_tokens else None
    if capture is None:
        return None, eager_reason(device, False) if most_tokens else \
            "eager (no decode batch size to capture for: --enforce-eager, or decode_graph_tokens 0)"
    graphs = ExpertGraphs(layers, capture_sizes(most_tokens, sizes), record_size, dtype, device, reduce)
    with torch.inference_mode():
        return graphs, capture_timed(graphs, capture, device).status()
