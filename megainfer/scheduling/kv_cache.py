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

With automatic prefix caching (`prefix_salt` given; `prefix_cache.PrefixCache` keeps the names and
counts, `prefix_tables.PrefixTables` a sequence's tables) a block may be held by several
sequences: it returns to the free blocks when the last one lets it go, and a named one stays
findable there (evictable) until the blocks that never held a named full block run out. A
waiting sequence takes the cached blocks of its prompt with `claim_prefix` before it is
admitted; with windowed layers, the blocks of both tables that its window needs.
"""

from __future__ import annotations

from collections import deque

from megainfer.scheduling.prefix_cache import PrefixCache
from megainfer.scheduling.prefix_tables import RELEASED, PrefixTables
from megainfer.scheduling.scheduler_output import SchedulerOutput
from megainfer.scheduling.sequence import Sequence, SequenceStatus

__all__ = ["RELEASED", "BlockManager"]


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, window: int = 0, prefix_salt: bytes | None = None) -> None:
        """`window` > 0: sequences also hold window tables for layers that see that many
        positions (a model mixing windowed and full-attention layers). `prefix_salt`: cache full
        blocks by name for later prompts (prefix_hash.model_salt of the served model)."""
        self.num_blocks = num_blocks
        self.block_size = block_size  # tokens per block
        self.window = window
        self.tables_per_sequence = 2 if window else 1
        # A stack: the most recently freed block is handed out first. Its memory is warm, and the
        # blocks a node ever touches are the most it held at once: on a CPU the cache's pages are
        # mapped lazily (model_runner._zeroed), so resident memory follows the peak use instead
        # of creeping up to the whole cache as a queue would cycle through every block.
        self.free_block_ids: deque[int] = deque(range(num_blocks - 1, -1, -1))
        self.prefix = PrefixCache(num_blocks, block_size, prefix_salt) if prefix_salt is not None else None
        self.tables = PrefixTables(self.prefix, block_size, window) if self.prefix is not None else None

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence holds: never-named ones, and cached ones that may be evicted."""
        prefix = self.prefix
        return len(self.free_block_ids) + (len(prefix.evictable) if prefix is not None else 0)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by sequences, 0..1 (cached blocks nobody holds count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

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
            new += max(needed - len(seq.window_table), 0) - self._freed_by_release(seq)
        return new

    def _freed_by_release(self, seq: Sequence) -> int:
        """Blocks releasing `seq`'s passed window blocks returns to the free ones: with prefix
        caching, not those another sequence holds too."""
        n = self._releasable(seq)
        if not n or self.tables is None:
            return n
        holders, start = self.prefix.holders, seq.window_released
        return sum(holders[block] == 1 for block in seq.window_table[start:start + n])

    def _releasable(self, seq: Sequence) -> int:
        """Leading window-table blocks no query of `seq` will read again: wholly before the window
        of its next token (position num_computed_tokens). A step scheduled ahead (asynchronous
        scheduling) may still read them, but it runs before any step that writes a block
        handed out here."""
        first_needed = max(seq.num_computed_tokens - self.window + 1, 0) // self.block_size
        return max(min(first_needed, len(seq.window_table)) - seq.window_released, 0)

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.num_new_blocks(seq, num_new_tokens) <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        if self.tables is not None:
            self.tables.register(seq)
        if self.window:
            self._release_window(seq)
        needed = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size)
        n = needed - len(seq.block_table)
        w = needed - len(seq.window_table) if self.window else 0
        if n <= 0 and w <= 0:  # most decode steps: the last block has room
            return
        if max(n, 0) + max(w, 0) > self.num_free_blocks:
            raise RuntimeError(f"allocate: {max(n, 0) + max(w, 0)} blocks wanted, {self.num_free_blocks} free "
                               "(check can_allocate)")
        if n > 0:
            seq.block_table.extend(self._take(n))
        if w > 0:
            seq.window_table.extend(self._take(w))

    def _take(self, n: int) -> list[int]:
        """`n` free blocks: never-named ones first (most recently freed first), then cached ones,
        least recently released first, their names dropped."""
        free, prefix = self.free_block_ids, self.prefix
        if prefix is None:
            return [free.pop() for _ in range(n)]
        taken = [free.pop() for _ in range(min(n, len(free)))]
        while len(taken) < n:
            block, _ = prefix.evictable.popitem(last=False)
            prefix.drop(block)
            taken.append(block)
        holders = prefix.holders
        for block in taken:
            holders[block] = 1
        return taken

    # -- prefix caching (prefix_cache.PrefixCache keeps the names and holders) ------------------
    def claim_prefix(self, seq: Sequence) -> int:
        """A waiting sequence with no blocks takes the cached blocks of its longest cached prefix
        and counts them computed; returns the tokens taken (0 with caching off). Undone by
        `unclaim_prefix` if the sequence is not admitted after all."""
        if self.tables is None or seq.block_table:
            return 0
        return self.tables.claim(seq)

    def unclaim_prefix(self, seq: Sequence) -> None:
        """`seq` stays waiting after `claim_prefix`: the blocks it took go back, still cached."""
        if seq.block_table and seq.status is SequenceStatus.WAITING:
            self.free(seq)
            seq.num_computed_tokens = 0

    def register_computed(self, seq: Sequence) -> None:
        if self.tables is not None:
            self.tables.register(seq)

    def register_prompt_chunks(self, out: SchedulerOutput) -> None:
        """Name the blocks step `out`'s prompt chunks filled, as soon as the step is counted done
        (or advanced ahead), so prompts admitted next step share them. A decode's filled block is
        named when its next block is allocated, the step after."""
        if self.tables is None:
            return
        for seq in out.seqs[out.num_single_token:]:
            self.tables.register(seq)
        if out.layered is not None and out.layered.last:
            for seq in out.layered.seqs:
                self.tables.register(seq)

    def count_lookup(self, seq: Sequence) -> None:
        """An admitted sequence's lookup into the counters (vLLM's prefix_cache_queries/hits, tokens)."""
        if self.prefix is not None:
            self.prefix.queries += len(seq.token_ids)
            self.prefix.hits += seq.num_computed_tokens

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (vLLM's reset_prefix_cache). False when nothing is cached."""
        if self.prefix is None:
            return False
        self.free_block_ids.extend(self.prefix.reset())
        return True

    def _release_window(self, seq: Sequence) -> None:
        n = self._releasable(seq)
        if n and self.tables is not None:
            self.tables.release_window(seq, n, self.free_block_ids)
        elif n:
            table, start = seq.window_table, seq.window_released
            self.free_block_ids.extend(table[start + n - 1:start - 1 if start else None:-1])
            table[start:start + n] = [RELEASED] * n
            seq.window_released = start + n

    def free(self, seq: Sequence, keep_cache: bool = True) -> None:
        """`seq` lets its blocks go. `keep_cache` False (a sequence that failed: its last step's
        KV may not have been written) names none of its blocks and forgets those only it held."""
        if self.tables is not None:
            self.tables.release(seq, keep_cache, self.free_block_ids)
            return
        # Reversed so that a table freed whole is handed out again in its own order.
        self.free_block_ids.extend(reversed(seq.block_table))
        seq.block_table = []
        if self.window:
            self.free_block_ids.extend(reversed(seq.window_table[seq.window_released:]))
            seq.window_table, seq.window_released = [], 0

    def held_blocks(self, seq: Sequence) -> int:
        """Block ids `seq` holds now, in both of its tables."""
        return len(seq.block_table) + (len(seq.window_table) - seq.window_released if self.window else 0)
