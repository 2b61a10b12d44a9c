"""Paged KV-cache block manager: owns every block id; sequences hold only their tables.

Plain Python with no tensors, so the scheduler (and the simulator driving it) can use it
without a model. The tensors the blocks index are allocated by the runners
(`megainfer.runner.model_runner.allocate_kv_caches`).
"""

from __future__ import annotations

from collections import deque

from megainfer.scheduling.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size  # tokens per block
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

    def num_new_blocks(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks `seq` must gain before `num_new_tokens` more of its tokens can be computed."""
        needed = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size)
        have = len(seq.block_table)
        return needed - have if needed > have else 0

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.num_new_blocks(seq, num_new_tokens) <= len(self.free_block_ids)

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        n = self.num_new_blocks(seq, num_new_tokens)
        if n == 0:  # most decode steps: the last block has room
            return
        if n > len(self.free_block_ids):
            raise RuntimeError(f"allocate: {n} blocks wanted, {len(self.free_block_ids)} free (check can_allocate)")
        seq.block_table.extend(self.free_block_ids.pop() for _ in range(n))

    def free(self, seq: Sequence) -> None:
        # Reversed so that a table freed whole is handed out again in its own order.
        self.free_block_ids.extend(reversed(seq.block_table))
        seq.block_table = []
