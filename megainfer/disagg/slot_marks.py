"""The marks of a device-slot region: how a receiver knows an rdma round's bytes are in its rows.

Each row of a region ([micro-batch, peer]) starts with MARK_ROOM bytes, then the payload. A
sender that writes a row by rdma has the transport write the round's mark (`round_mark`) into
the word MARK_LEAD bytes before the payload, after the payload and before the header, in one
chained post; RC places them in that order. The receiver reads a row only under the mark its
header names: on CUDA its compute stream waits for the marks in the driver (the link's
`hold_stream`: the host does not wait, and the wait flushes the adapter's writes where the GPU
needs it); on the CPU each mark is checked, and a row without its round's mark is an error, not
the bytes of an older round.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from megainfer.disagg.expert_link import MARK_LEAD
from megainfer.disagg.staging_sizes import ALIGN
from megainfer.errors import DataPlaneError

logger = logging.getLogger(__name__)

# Bytes before each row's payload: the mark lies there (the word MARK_LEAD before the payload),
# and the payload stays aligned.
MARK_ROOM = ALIGN


def round_mark(step, layer):
    """The word a round's rdma writes leave before each row's bytes, and the one its receiver's
    stream waits for: never 0 (no mark; a fresh region's rows), 32 bits, and different for the
    consecutive rounds one row takes (one micro-batch's successive (step, layer)). Works on
    ints (a post's, in plain Python: once per round) and on int64 arrays (a round's header
    fields: a step is 32 bits, so step << 16 stays inside 64)."""
    return ((step << 16) | layer) % 0xFFFFFFFF + 1


def payload_offset(micro_batch, row, peers: int, region_bytes: int):
    """Where the payload of row [micro_batch, row] lies in a region of `peers` rows per
    micro-batch and `region_bytes` per row's payload: the rdma target a sender aims at."""
    return (np.asarray(micro_batch) * peers + row) * (MARK_ROOM + region_bytes) + MARK_ROOM


class RegionMarks:
    """The mark words of one node's region ([micro-batches, peers, MARK_ROOM + payload] bytes,
    `memory`), and the wait of a read on them."""

    def __init__(self, name: str, peers: tuple[str, ...], memory: torch.Tensor) -> None:
        self.name, self.peers = name, peers
        self.device = memory.device
        self.on_cuda = self.device.type == "cuda"
        micro_batches, rows, row_bytes = memory.shape
        at = MARK_ROOM - MARK_LEAD
        self.words = memory[:, :, at:at + 4].view(torch.int32)[..., 0]  # [micro-batch, peer]
        self.addresses = memory.data_ptr() + payload_offset(np.arange(micro_batches)[:, None], np.arange(rows), rows,
                                                            row_bytes - MARK_ROOM) - MARK_LEAD
        self._stream_waits = True  # a CUDA stream waits on the marks; False: the host flushes (said once)

    def hold(self, link, micro_batch: int, rows: np.ndarray, marks: np.ndarray) -> None:
        """Reads of peers `rows`' bytes of `micro_batch` (written by rdma) ordered after their
        writes, whose marks (`marks`, as their headers name the round) the adapter placed after
        the bytes and before the headers: on CUDA the current stream waits on the marks in the
        driver (`link.hold_stream`; the host returns at once), or, where the stream cannot (said
        once), the host flushes the adapter's writes (`link.settle()`); on the CPU each mark is
        checked: a missing one is a DataPlaneError (the header came before its bytes).

        A wait on CUDA has no way out but its word: it is enqueued only once the round's
        headers arrived (so its marks were placed before), and a row's next write is the
        peer's next round of this micro-batch, which needs an answer computed on this stream
        after the wait (device_slots.py, "why a region is never overwritten while it is
        read"). A resend or a second round per (layer, micro-batch) would break that."""
        if not self.on_cuda:
            found = self.words[micro_batch].numpy().view(np.uint32)[rows]
            bad = np.flatnonzero(found != marks)
            if bad.size:
                i = int(rows[bad[0]])
                raise DataPlaneError(f"{self.name}: {self.peers[i]}'s rdma bytes for micro-batch {micro_batch} came "
                                     f"without their mark (found {found[bad[0]]}, expected {marks[bad[0]]}): the "
                                     f"header arrived before the bytes were placed")
            return
        if self._stream_waits:
            why = link.hold_stream(torch.cuda.current_stream(self.device).cuda_stream, self.device.index,
                                   self.addresses[micro_batch, rows].tolist(), marks.tolist())
            if why is None:
                return
            self._stream_waits = False
            logger.warning("%s: the GPU stream cannot wait on the rdma marks (%s): from now on the host flushes the "
                           "adapter's writes after each round's headers (slower: a host call per round)", self.name, why)
        link.settle()
