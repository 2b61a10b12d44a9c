"""Rounds: one call posts a (layer, micro-batch)'s messages to all its peers, one call
collects a message from each of them.

A round is what the M2N exchange is made of: an attention rank sends every expert node its
tokens of a micro-batch and takes their answers; an expert node takes every attention rank's
tokens and answers each. The caller lays a round's payloads end to end in one buffer (each
peer's bytes a range of it) and gets the arrivals back as `Arrivals`: per-peer header fields
in one array, payloads readable in place or gathered into one buffer in one call.

Where every channel of a round is driven by the compiled core (transport/core.py), a post
and a collect are one C++ call each (`CoreRound`); otherwise the round is a loop of the
per-message calls (`MessageRound`), which is the reference the tests compare against. The
endpoint keeps the one each set of peers runs in a `RoundTable`; transport/round_poster.py
posts rounds and transport/round_collector.py collects them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from transport.errors import RoundFailed, TransportError
from transport.wire import MAGIC

if TYPE_CHECKING:
    from transport.message import Message

# Columns of Arrivals.fields: the wire header's fields, magic first (transport/wire.py HEADER).
MAGIC_COL, STEP, LAYER, MICRO_BATCH, SENDER, FLAGS, TOKEN_COUNT, SEQ, BYTE_LENGTH = range(9)


def row_ranges(token_counts, row_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """[begin, end) bytes of each peer's rows, the peers' rows end to end (what post_rows sends)."""
    sizes = np.asarray(token_counts, dtype=np.int64) * row_bytes
    ends = np.cumsum(sizes)
    return ends - sizes, ends


def byte_address(buffer) -> tuple[int, int]:
    """(address, bytes) of a contiguous CPU torch tensor or numpy array: what the core copies from."""
    address, nbytes, device = send_span(buffer)
    if device:
        raise TypeError("round payloads are host memory: stage CUDA tensors through pinned buffers first")
    return address, nbytes


def send_span(buffer) -> tuple[int, int, bool]:
    """(address, bytes, on a GPU) of what a post sends: a contiguous torch tensor (CPU, or CUDA
    where every peer's channel sends GPU memory itself: rdma in the core, from a buffer given
    to Endpoint.register; the core refuses the post otherwise) or numpy array."""
    try:
        address = buffer.data_ptr()  # torch
    except AttributeError:
        if not isinstance(buffer, np.ndarray):
            raise TypeError(f"a round's buffer is a contiguous CPU torch tensor or numpy array, not "
                            f"{type(buffer).__name__}") from None
        if not buffer.flags.c_contiguous:
            raise ValueError("a round's buffer must be contiguous") from None
        return buffer.__array_interface__["data"][0], buffer.nbytes, False
    if not buffer.is_contiguous():
        raise ValueError("a round's buffer must be contiguous (call .contiguous())")
    return address, buffer.nbytes, buffer.is_cuda


class Arrivals:
    """One collected round: a message from each peer, valid until `release()`.

    `fields` is [N, 9] int64 (magic, step, layer, micro_batch, sender, flags, token_count,
    seq, byte_length), row i for peers[i]."""

    __slots__ = ("peers", "fields", "_round", "_released")

    def __init__(self, peers: tuple[str, ...], fields: np.ndarray, round_) -> None:
        self.peers = peers
        self.fields = fields
        self._round = round_
        self._released = False

    @property
    def token_counts(self) -> np.ndarray:
        return self.fields[:, TOKEN_COUNT]

    @property
    def byte_lengths(self) -> np.ndarray:
        return self.fields[:, BYTE_LENGTH]

    def payload(self, i: int) -> memoryview:
        """peers[i]'s payload, a view of its slot (no copy)."""
        return self._round.payload(i)

    def mismatch(self, step: int, layer: int, row_bytes: int = -1, token_counts: np.ndarray | None = None) -> int:
        """The first peer whose message is not of (`step`, `layer`) (step < 0: the first peer's
        step), or whose byte length is not its token count x `row_bytes` (< 0: not checked), or
        whose token count is not token_counts[i] (None: not checked); -1 if none."""
        return self._round.check(step, layer, row_bytes, token_counts)

    def gather_into(self, buffer) -> np.ndarray:
        """Every payload, peer order, end to end at the start of `buffer` (a contiguous CPU
        tensor or array); returns their byte offsets [N + 1]."""
        address, capacity = byte_address(buffer)
        return self._round.gather(address, capacity)

    def release(self) -> None:
        """Frees every slot of the round: the senders may write them again."""
        if not self._released:
            self._released = True
            self._round.release()

    def __enter__(self) -> "Arrivals":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class CoreRound:
    """A round whose channels the core drives: post and collect are one C++ call each."""

    def __init__(self, peers: tuple[str, ...], outbound: list, inbound: list, doorbell_fd: int) -> None:
        from transport.core import native

        self.peers = peers
        self.outbound, self.inbound = outbound, inbound
        # A tcp channel's reads see its peer go (its control socket is its data socket).
        controls = [ch.control.fileno() if ch.control is not None and ch.kind != "tcp" else -1 for ch in inbound]
        self.native = native.Round([ch.core for ch in outbound], [ch.core for ch in inbound], doorbell_fd, controls)
        self.partial: int | None = None  # the micro-batch of a round partly collected (a poll, a timeout)
        self.handed_out = False  # a collected round not released yet
        self.fields = self.native.fields()
        self.arrived, self.broken, self.pending, self.slots = (self.native.arrived(), self.native.broken(),
                                                               self.native.pending(), self.native.slots())
        self.offsets = np.zeros(len(inbound) + 1, dtype=np.int64)

    def payload(self, i: int) -> memoryview:
        ch = self.inbound[i]
        if not self.arrived[i]:
            raise IndexError(f"no message from {self.peers[i]} in this round")
        return ch.payload(int(self.slots[i]), int(self.fields[i, BYTE_LENGTH]))

    def gather(self, address: int, capacity: int) -> np.ndarray:
        self.native.gather(address, capacity, self.offsets)
        return self.offsets

    def check(self, step: int, layer: int, row_bytes: int, token_counts) -> int:
        return self.native.check(step, layer, row_bytes, token_counts)

    def release(self) -> None:
        self.handed_out = False
        self.native.release()


class MessageRound:
    """A round as a loop of per-message calls: the reference, and the path for channels the
    core does not drive (rdma, nixl, or an endpoint with core='off')."""

    def __init__(self, peers: tuple[str, ...]) -> None:
        self.peers = peers
        self.messages: list[Message | None] = []
        self.fields = np.zeros((len(peers), 9), dtype=np.int64)
        self.partial: int | None = None  # the micro-batch of a round partly collected (a poll, a timeout)
        self.handed_out = False  # a collected round not released yet

    def take(self, messages: list[Message]) -> None:
        """A whole round: `messages[i]` from peers[i]."""
        self.messages = messages
        for i, msg in enumerate(messages):
            self.fields[i, 0] = MAGIC
            self.fields[i, 1:] = msg.header

    def payload(self, i: int) -> memoryview:
        return self.messages[i].data

    def check(self, step: int, layer: int, row_bytes: int, token_counts) -> int:
        f = self.fields
        bad = (f[:, STEP] != (f[0, STEP] if step < 0 else step)) | (f[:, LAYER] != layer)
        if row_bytes >= 0:
            bad |= f[:, BYTE_LENGTH] != f[:, TOKEN_COUNT] * row_bytes
        if token_counts is not None:
            bad |= f[:, TOKEN_COUNT] != np.asarray(token_counts)
        where = np.flatnonzero(bad)
        return int(where[0]) if where.size else -1

    def gather(self, address: int, capacity: int) -> np.ndarray:
        import ctypes

        offsets = np.zeros(len(self.peers) + 1, dtype=np.int64)
        total = sum(len(m.data) for m in self.messages)
        if total > capacity:
            raise ValueError(f"gather: {total} bytes arrived for a {capacity}-byte buffer")
        dest = (ctypes.c_char * capacity).from_address(address)
        view = memoryview(dest).cast("B")
        at = 0
        for i, msg in enumerate(self.messages):
            offsets[i] = at
            n = len(msg.data)
            view[at:at + n] = msg.data
            at += n
        offsets[-1] = at
        return offsets

    def release(self) -> None:
        self.handed_out = False
        for msg in self.messages:
            if msg is not None:
                msg.release()
        self.messages = []


class RoundTable:
    """How rounds with each set of peers run, chosen on first use and kept until the channels
    go (`clear`): a CoreRound where the core drives every channel involved, else a MessageRound.
    `rounds` is the table itself, for the post and collect paths to look up directly."""

    def __init__(self, endpoint: str, outbound: dict, inbound: dict, doorbell) -> None:
        self.endpoint = endpoint
        self.outbound, self.inbound = outbound, inbound  # the endpoint's channels (never replaced)
        self.doorbell = doorbell
        self.rounds: dict[tuple[str, ...], CoreRound | MessageRound] = {}

    def round_for(self, peers) -> CoreRound | MessageRound:
        peers = tuple(peers)
        round_ = self.rounds.get(peers)
        if round_ is not None:
            return round_
        unknown = [p for p in peers if p not in self.outbound or p not in self.inbound]
        if unknown or not peers:
            raise TransportError(f"endpoint {self.endpoint} has no peer {', '.join(map(repr, unknown)) or '(none)'}; "
                                 f"peers: {', '.join(self.outbound)}")
        channels = [self.outbound[p] for p in peers] + [self.inbound[p] for p in peers]
        if all(getattr(ch, "core_driven", False) for ch in channels):
            round_ = CoreRound(peers, [self.outbound[p] for p in peers], [self.inbound[p] for p in peers],
                               self.doorbell.sock.fileno() if self.doorbell is not None else -1)
        else:
            round_ = MessageRound(peers)
        self.rounds[peers] = round_
        return round_

    def clear(self) -> None:
        self.rounds.clear()


def round_failed(endpoint: str, what: str, micro_batch: int, failures: dict[str, TransportError]) -> RoundFailed:
    """The error of a round's post or collect that failed for `failures`' peers."""
    detail = "; ".join(f"{peer}: {exc}" for peer, exc in failures.items())
    return RoundFailed(f"endpoint {endpoint}: the {what} of micro-batch {micro_batch}'s round failed for "
                       f"{len(failures)} peer(s): {detail}", failures)
