"""Every running sequence's KV block table as a row of one persistent array (vLLM's block table
of its input batch), so a step's block tables are one gather instead of a rebuild.

A sequence's table (`Sequence.block_table`, the block manager's list) only grows while it runs,
by the blocks a step allocated; it is replaced by a new list when the sequence is freed
(preempted, finished). Each step, a sequence whose list is the one its row mirrors and has not
grown costs a lookup and a comparison; one that grew copies its new blocks; any other (new, or
given a new list) copies its whole table. The array past a row's blocks is always zero, as the
batch built from scratch has it.

A model with windowed layers (gpt-oss) mirrors each sequence's window table too, in `window`
(rows of the same kind over `Sequence.window_table`). Released entries of a window table are
overwritten in place, so its row may still hold the released ids: harmless, as the kernels
never read entries before a query's window.
"""

from __future__ import annotations

import numpy as np

from megainfer.scheduling.sequence import REQUEST_ID


class BlockTableRows:
    def __init__(self, rows: int, max_blocks: int, windowed: bool = False, attr: str = "block_table") -> None:
        self.attr = attr  # the Sequence attribute mirrored
        self.window = BlockTableRows(rows, max_blocks, attr="window_table") if windowed else None
        self.array = np.zeros((max(rows, 1), max(max_blocks, 1)), dtype=np.int64)
        self._row: dict[str, int] = {}  # request id -> its row
        self._mirrored: list[list[int] | None] = [None] * self.array.shape[0]  # the list each row copies
        self._filled = [0] * self.array.shape[0]  # blocks copied into each row
        self._free = list(range(self.array.shape[0] - 1, -1, -1))

    def retain(self, seqs: list) -> None:
        """At a step's start, with all of its sequences: when the free rows would not hold those
        without one, the rows of requests not in the step are let go."""
        if self.window is not None:
            self.window.retain(seqs)
        row_of = self._row
        if len(self._free) >= len(seqs) - len(row_of):
            return
        keep = set(map(REQUEST_ID, seqs))
        for request_id in [r for r in row_of if r not in keep]:
            self._release(request_id)

    def gather(self, seqs: list) -> tuple[np.ndarray, np.ndarray]:
        """([n, widest] block tables of `seqs`, zero past each one's blocks; [n] their widths)."""
        row_of, mirrored, filled, array, attr = self._row, self._mirrored, self._filled, self.array, self.attr
        rows = []
        for seq in seqs:
            table = getattr(seq, attr)
            row = row_of.get(seq.request_id)
            if row is None:
                row = self._take(seq.request_id)
                array, mirrored, filled = self.array, self._mirrored, self._filled  # may have grown
            if mirrored[row] is not table or filled[row] != len(table):
                if len(table) > array.shape[1]:
                    self._widen(len(table))
                    array = self.array
                start = filled[row] if mirrored[row] is table and filled[row] < len(table) else 0
                array[row, start:len(table)] = table[start:]
                if filled[row] > len(table):
                    array[row, len(table):filled[row]] = 0
                mirrored[row], filled[row] = table, len(table)
            rows.append(row)
        index = np.asarray(rows, dtype=np.int64)
        widths = np.asarray([filled[r] for r in rows], dtype=np.int64)
        return array[index, :max(int(widths.max(initial=0)), 1)], widths

    def _take(self, request_id: str) -> int:
        if not self._free:
            self._grow()
        row = self._row[request_id] = self._free.pop()
        return row

    def _release(self, request_id: str) -> None:
        row = self._row.pop(request_id)
        self.array[row, :self._filled[row]] = 0
        self._mirrored[row], self._filled[row] = None, 0
        self._free.append(row)

    def _grow(self) -> None:
        """Twice the rows (more sequences than it was sized for: retain found none to let go)."""
        old = self.array.shape[0]
        self.array = np.concatenate([self.array, np.zeros_like(self.array)])
        self._mirrored += [None] * old
        self._filled += [0] * old
        self._free += range(2 * old - 1, old - 1, -1)

    def _widen(self, blocks: int) -> None:
        wider = np.zeros((self.array.shape[0], max(blocks, 2 * self.array.shape[1])), dtype=self.array.dtype)
        wider[:, :self.array.shape[1]] = self.array
        self.array = wider
