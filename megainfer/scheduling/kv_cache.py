"""Paged KV-cache block manager: owns every block id; sequences hold only their tables.

Plain Python with no tensors, so the scheduler (and the simulator driving it) can use it
without a model. The tensors the blocks index are allocated by the runners
(`megainfer.runner.model_runner.allocate_kv_caches`).

A model with sliding-window layers beside full-attention ones (gpt-oss) has each sequence hold
two tables from the one pool (vLLM's hybrid allocator): `block_table` for the full-attention
layers, `window_table` for the windowed ones, both indexed by position. A windowed layer's
query at position p sees keys from p - window + 1 on, so once a sequence's computed tokens
pass a block by a window, that block of its window table is released and its entry left at
`RELEASED` (the kernels skip entries before a query's window). Its window table then holds at
most a window's worth of blocks however long the sequence grows.
"""

from __future__ import annotations

from collections import deque

from megainfer.scheduling.sequence import Sequence


RELEASED = 0  # a window table's entry whose block was released (any valid id: it is never read)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, window: int = 0) -> None:
        """`window` > 0: sequences also hold window tables for layers that see that many
        positions (a model mixing windowed and full-attention layers)."""
        self.num_blocks = num_blocks
        self.block_size = block_size  # tokens per block
        self.window = window
        self.tables_per_sequence = 2 if window else 1
        # A stack: the most recently freed block is handed out first. Its memory is warm, and the
        # blocks a node ever touches are the most it held at once: on a CPU the cache's pages are
        # mapped lazily (model_runner._zeroed), so resident memory follows the peak use instead
        # of creeping up to the whole cache as a queue would cycle through every block.
        self.free_block_ids: deque[int] = deque(range(num_blocks - 1, -1, -1))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0..1."""
        return 1.0 - len(self.free_block_ids) / self.num_blocks

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def blocks_for_sequence(self, num_tokens: int) -> int:
        """Block ids a sequence of `num_tokens` holds decoding its last token: its blocks, and in
        its window table a window's worth (ModelConfig.kv_blocks_per_sequence)."""
        blocks = self.blocks_for_tokens(num_tokens)
        if not self.window:
            return blocks
        return blocks + min(blocks, -(-(self.window - 1) // self.block_size) + 1)

    def num_new_blocks(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks `seq` must gain before `num_new_tokens` more of its tokens can be computed, less
        the window blocks it releases first (so it may be negative)."""
        needed = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size)
        have = len(seq.block_table)
        new = needed - have if needed > have else 0
        if self.window:
            new += max(needed - len(seq.window_table), 0) - self._releasable(seq)
        return new

    def _releasable(self, seq: Sequence) -> int:
        """Leading window-table blocks no query of `seq` will read again: wholly before the window
        of its next token (position num_computed_tokens). A step scheduled ahead (asynchronous
        scheduling) may still read them, but it runs before any step that writes a block
        handed out here."""
        first_needed = max(seq.num_computed_tokens - self.window + 1, 0) // self.block_size
        return max(min(first_needed, len(seq.window_table)) - seq.window_released, 0)

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.num_new_blocks(seq, num_new_tokens) <= len(self.free_block_ids)

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        if self.window:
            self._release_window(seq)
        needed = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size)
        n = needed - len(seq.block_table)
        w = needed - len(seq.window_table) if self.window else 0
        if n <= 0 and w <= 0:  # most decode steps: the last block has room
            return
        if max(n, 0) + max(w, 0) > len(self.free_block_ids):
            raise RuntimeError(f"allocate: {max(n, 0) + max(w, 0)} blocks wanted, {len(self.free_block_ids)} free "
                               "(check can_allocate)")
        free = self.free_block_ids
        if n > 0:
            seq.block_table.extend(free.pop() for _ in range(n))
        if w > 0:
            seq.window_table.extend(free.pop() for _ in range(w))

    def _release_window(self, seq: Sequence) -> None:
        n = self._releasable(seq)
        if n:
            table, start = seq.window_table, seq.window_released
            self.free_block_ids.extend(table[start + n - 1:start - 1 if start else None:-1])
            table[start:start + n] = [RELEASED] * n
            seq.window_released = start + n

    def free(self, seq: Sequence) -> None:
        # Reversed so that a table freed whole is handed out again in its own order.
        self.free_block_ids.extend(reversed(seq.block_table))
        seq.block_table = []
        if self.window:
            self.free_block_ids.extend(reversed(seq.window_table[seq.window_released:]))
            seq.window_table, seq.window_released = [], 0

    def held_blocks(self, seq: Sequence) -> int:
        """Block ids `seq` holds now, in both of its tables."""
        return len(seq.block_table) + (len(seq.window_table) - seq.window_released if self.window else 0)
