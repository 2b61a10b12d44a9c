"""The link from an attention node to the expert nodes (`ExpertLink`) and what travels over it:
the dispatch payload, its record layout, and the BUSY flag on answers.

Per (step, layer, micro-batch) each attention node sends each expert node one message: the
tokens that chose at least one of that node's experts, once per token, as `n` records (n in
the header's token count) laid end to end, one per token:

    offset 0                 hidden * itemsize   x        post-attention-normed hidden state, model dtype
    hidden * itemsize        top_k * 4           ids      global expert ids, int32 (the node ignores others')
    hidden * itemsize + 4k   top_k * 4           weights  routing weights, float32

so a record is `record_bytes(hidden, top_k, dtype)` bytes, and any run of tokens (one expert
node's, or one tensor-parallel rank's share of it) is one contiguous byte range of a buffer
holding every node's tokens in node order: the attention node builds that buffer once per
(layer, micro-batch) on its device and sends slices of it. `hidden * itemsize` must be a
multiple of 4 so the int32 and float32 fields stay aligned.

The expert node answers with [n, hidden] in the model dtype, row i for record i: the
routing-weighted sum of that token's outputs from the node's experts. A node with nothing to
say sends n = 0, so nobody waits on silence. The header flag BUSY on an answer says some
attention node had tokens for that (layer, micro-batch), so idle attention nodes keep pace.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

from megainfer.disagg.staging_sizes import FIELD_BYTES, record_size

BUSY = 1  # header flag on expert answers
# Columns of `LinkArrivals.fields` that the runtime reads: the wire header's step, layer, flags
# and payload length, where the transport lays them out (transport.rounds; the binding,
# deploy/link.py, checks that they agree, so the runtime names them without importing the transport).
STEP, LAYER, FLAGS, BYTE_LENGTH = 1, 2, 5, 8
# Where a post's mark lands: this many bytes before each targeted payload (transport.wire
# MARK_LEAD; the binding checks that too).
MARK_LEAD = 8


def row_ranges(token_counts, row_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """[begin, end) bytes of each peer's rows, the peers' rows end to end (what `post_rows` sends)."""
    sizes = np.asarray(token_counts, dtype=np.int64) * row_bytes
    ends = np.cumsum(sizes)
    return ends - sizes, ends


class LinkArrivals(Protocol):
    """One collected round (transport.rounds.Arrivals): a message from each peer."""

    fields: np.ndarray  # [N, 9] int64, the headers' fields (columns above)
    token_counts: np.ndarray
    byte_lengths: np.ndarray

    def gather_into(self, buffer: torch.Tensor) -> np.ndarray: ...

    def mismatch(self, step: int, layer: int, row_bytes: int = -1, token_counts: np.ndarray | None = None) -> int: ...

    def release(self) -> None: ...


class ExpertLink(Protocol):
    """A node's view of its peers (deploy/ binds it to a transport Endpoint). Payloads are
    host tensors: the runner stages device tensors through pinned memory first. The data
    plane runs in rounds (transport/rounds.py): a (layer, micro-batch) is posted to every
    peer in one call and collected from every peer in one call."""

    def post_round(self, peers: tuple[str, ...], buffer: torch.Tensor, begins: np.ndarray, ends: np.ndarray,
                   token_counts: np.ndarray, *, step: int, layer: int, micro_batch: int, flags: int = 0,
                   targets: np.ndarray | None = None, mark: int = 0) -> None:
        """peers[i] gets bytes [begins[i], ends[i]) of `buffer`, token count token_counts[i];
        where targets[i] >= 0, written at that offset of the region peer i exposed (`aim`), its
        header saying 0 bytes, and `mark` (0: none) as the word MARK_LEAD bytes before them,
        written after them and before the header."""
        ...

    def post_rows(self, peers: tuple[str, ...], buffer: torch.Tensor, token_counts: np.ndarray, row_bytes: int, *,
                  step: int, layer: int, micro_batch: int, flags: int = 0) -> None:
        """post_round where peers[i] gets token_counts[i] rows of `row_bytes`, end to end."""
        ...

    def collect_round(self, peers: tuple[str, ...], *, micro_batch: int) -> LinkArrivals: ...

    def poll_round(self, peers: tuple[str, ...], *, micro_batch: int) -> LinkArrivals | None:
        """The round `collect_round` would return if all of it has arrived, else None at once."""
        ...

    def register(self, buffer: torch.Tensor) -> None:
        """Host memory payloads will be sent from, for the link's life (the pinned staging):
        a backend that writes from registered memory then skips its own staging copy."""
        ...

    def expose(self, buffer: torch.Tensor):
        """Memory the peers may write into (a node's device-slot region), for the current
        wiring: the grant a peer needs (`.to_plain()`: its fields, for an offer to carry), or
        None where the link cannot take such writes (only rdma in the compiled transport core can)."""
        ...

    def can_aim(self, peer: str) -> bool:
        """Whether the link's channel to `peer` writes into a region the peer exposes (`aim`)."""
        ...

    def aim(self, peer: str, grant: list | None) -> None:
        """The region `peer` exposed (its grant's plain fields), for posts with `targets`; set
        after every wiring. ValueError for fields that are not a grant."""
        ...

    def reads_in_place(self, buffer: torch.Tensor) -> bool:
        """Whether the link's adapter reads payloads lying in `buffer` (given to `register`)
        where they lie: a GPU buffer it reads can be posted from (GPUDirect RDMA)."""
        ...

    def settle(self) -> None:
        """After messages into exposed GPU memory arrived, before a kernel reads them: the
        adapter's writes made visible to the GPU's kernels (a flush where the platform needs one)."""
        ...

    def hold_stream(self, stream: int, device: int, addresses, values) -> str | None:
        """GPU `device`'s stream `stream` (a CUstream handle) waits, in the driver, until each
        word at `addresses` (marks in exposed GPU memory) holds its value; its later work then
        sees the payloads written before the marks. The host does not wait. None where the
        stream now waits; else why the link cannot make it (no stream memory operations on
        this driver, no GPU region exposed), and nothing was enqueued."""
        ...


def record_bytes(hidden: int, top_k: int, dtype: torch.dtype) -> int:
    """Bytes of one token's dispatch record."""
    x_bytes = hidden * dtype.itemsize
    if x_bytes % FIELD_BYTES:
        raise ValueError(f"a hidden state of {hidden} x {dtype} is {x_bytes} bytes; the record layout needs a "
                         f"multiple of {FIELD_BYTES}")
    return record_size(hidden, top_k, dtype.itemsize)


def dispatch_bytes(tokens: int, hidden: int, top_k: int, dtype: torch.dtype) -> int:
    return tokens * record_bytes(hidden, top_k, dtype)


def pack_records(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """[n, record_bytes] uint8 on x's device: row i is token i's record (x, int32 ids, float32
    weights). Runs as device kernels: nothing is read back to the host."""
    n, top_k = ids.shape
    if n == 0:
        return torch.empty(0, record_bytes(x.shape[1], top_k, x.dtype), dtype=torch.uint8, device=x.device)
    parts = [x.contiguous().view(torch.uint8), ids.to(torch.int32).contiguous().view(torch.uint8),
             weights.to(torch.float32).contiguous().view(torch.uint8)]
    return torch.cat(parts, dim=1)


def pack_dispatch(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """One message's payload: the records of these tokens as flat bytes."""
    return pack_records(x, ids, weights).view(-1)


def unpack_dispatch(buf: torch.Tensor, tokens: int, hidden: int, top_k: int,
                    dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Views (no copy, strided by the record) of x [n, hidden], ids [n, top_k] int32 and
    weights [n, top_k] float32 in `buf`, the flat bytes of n records."""
    size = record_bytes(hidden, top_k, dtype)
    if buf.numel() != tokens * size:
        raise ValueError(f"dispatch payload of {buf.numel()} bytes does not hold {tokens} tokens "
                         f"(expected {tokens * size})")
    # split_with_sizes: the C op itself (Tensor.split is a Python wrapper around it, twice the
    # cost, once per (layer, micro-batch) on an expert node)
    x, ids, weights = buf.view(tokens, size).split_with_sizes(
        (hidden * dtype.itemsize, top_k * FIELD_BYTES, top_k * FIELD_BYTES), dim=1)
    return x.view(dtype), ids.view(torch.int32), weights.view(torch.float32)


class RecordViews:
    """`unpack_dispatch` of rounds that land in reused buffers (the CPU's landing slices, one
    tensor per micro-batch slot and length: `DeviceStaging.landing`), each slice's views made
    once and kept with it: an expert node unpacks a round per (layer, micro-batch), and the
    five view ops cost more host time than the rest of its bookkeeping there. A slot's views
    are let go when its landing buffer is replaced (it grew), so no old buffer outlives it.
    Nothing is kept where rounds land in fresh tensors: on CUDA (`keep` False: a device copy
    each round), from device slots, or a tensor-parallel follower's share (`slot` None)."""

    def __init__(self, hidden: int, top_k: int, dtype: torch.dtype, keep: bool, limit: int = 512) -> None:
        self.hidden, self.top_k, self.dtype = hidden, top_k, dtype
        self.keep, self.limit = keep, limit
        self._kept: dict[int, dict[int, tuple[torch.Tensor, tuple[torch.Tensor, ...]]]] = {}  # slot, id(slice)
        self._buffer: dict[int, int] = {}  # slot -> the address of the landing buffer its kept slices view

    def of(self, buf: torch.Tensor, tokens: int, slot: int | None = None) -> tuple[torch.Tensor, ...]:
        """x, ids and weights of `buf`'s `tokens` records. slot: the micro-batch slot whose
        landing buffer `buf` is a slice of (its views may be kept); None: a buffer of this round's."""
        if not self.keep or slot is None:
            return unpack_dispatch(buf, tokens, self.hidden, self.top_k, self.dtype)
        kept = self._kept.setdefault(slot, {})
        entry = kept.get(id(buf))
        if entry is not None and entry[0] is buf and entry[1][0].shape[0] == tokens:  # (the entry holds `buf`)
            return entry[1]
        views = unpack_dispatch(buf, tokens, self.hidden, self.top_k, self.dtype)
        address = buf.untyped_storage().data_ptr()
        if self._buffer.get(slot) != address or len(kept) >= self.limit:
            kept.clear()  # slices of the slot's old buffer (it grew), or too many lengths
            self._buffer[slot] = address
        kept[id(buf)] = (buf, views)
        return views


def rank_share(count: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """[begin, end) of `count` tokens carried by rank `tp_rank` of `tp_size`: the split
    `torch.tensor_split(count, tp_size)` makes (the first count % tp_size ranks take one more)."""
    base, extra = divmod(count, tp_size)
    begin = tp_rank * base + min(tp_rank, extra)
    return begin, begin + base + (tp_rank < extra)
