"""A sequence's block tables under automatic prefix caching: naming its computed full blocks,
taking the cached blocks of its prompt's prefix, letting blocks go (`PrefixCache` keeps the names
and holders; `kv_cache.BlockManager` calls this).

A model with sliding-window layers (gpt-oss) keeps two tables per sequence (kv_cache.py). Both
are named: block k of the window table under block k's name with a mark, since its KV is the
windowed layers' of the same tokens. A hit of k blocks then needs the full table's blocks
0..k-1 and the window table's blocks from the first one the window of position k*block_size
reaches; the rest of that window table is `RELEASED`, as if the sequence had computed its way
there. Window blocks released as a sequence moves on keep their names (evictable), so the next
prompt of the same prefix finds them while they last.
"""

from __future__ import annotations

from collections import deque

from megainfer.scheduling.prefix_cache import PrefixCache
from megainfer.scheduling.prefix_hash import extend_block_hashes, request_salt
from megainfer.scheduling.sequence import Sequence

RELEASED = 0  # a window table's entry whose block was released (any valid id: it is never read)
WINDOW_MARK = b"w"  # a window-table block's name: its tokens' name and this


class PrefixTables:
    def __init__(self, cache: PrefixCache, block_size: int, window: int = 0) -> None:
        self.cache = cache
        self.block_size = block_size
        self.window = window  # 0: the model has no windowed layers

    def first_in_window(self, num_computed: int) -> int:
        """The first block a query at position `num_computed` reads in a windowed layer."""
        return max(num_computed - self.window + 1, 0) // self.block_size

    def _names(self, seq: Sequence, blocks: int) -> list[bytes]:
        root = request_salt(self.cache.salt, seq.params.cache_salt)
        return extend_block_hashes(seq.block_hashes, root, seq.token_ids, self.block_size, blocks)

    def register(self, seq: Sequence) -> None:
        """Name the full blocks of `seq` whose KV is computed (or being computed by a step that
        runs before any step scheduled after this call) and not yet named, in both tables."""
        full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        if full <= seq.hashed_blocks:
            return
        names, cache = self._names(seq, full), self.cache
        table = seq.block_table
        for k in range(seq.hashed_blocks, full):
            cache.register(table[k], names[k])
        if self.window:
            window = seq.window_table
            for k in range(max(seq.hashed_blocks, seq.window_released), min(full, len(window))):
                cache.register(window[k], names[k] + WINDOW_MARK, routed=False)
        seq.hashed_blocks = full

    def claim(self, seq: Sequence) -> int:
        """`seq` (no blocks yet) takes the blocks of its longest cached prefix of full blocks, never
        its last token (computed to sample from), and counts them computed; returns the tokens."""
        if seq.params.prompt_logprobs is not None:
            return 0  # prompt logprobs need every prompt position's logits: computed, not cached
        limit = (len(seq.token_ids) - 1) // self.block_size
        if limit <= 0:
            return 0
        names, cache = self._names(seq, limit), self.cache
        blocks = cache.match(names, limit)
        window, first = [], 0
        if self.window:
            blocks, window, first = self._with_window(names, blocks)
        cache.take(blocks)
        cache.take(window)
        seq.block_table = blocks
        if self.window:
            seq.window_table, seq.window_released = [RELEASED] * first + window, first
        seq.hashed_blocks = len(blocks)
        seq.num_computed_tokens = len(blocks) * self.block_size
        return seq.num_computed_tokens

    def _with_window(self, names: list[bytes], blocks: list[int]) -> tuple[list[int], list[int], int]:
        """The longest hit whose window-table blocks are cached too: (full-table blocks, window
        blocks from the first the window reaches, that first index)."""
        block_of = self.cache.block_of
        for k in range(len(blocks), 0, -1):
            first = self.first_in_window(k * self.block_size)
            window = [block_of.get(name + WINDOW_MARK) for name in names[first:k]]
            if None not in window:
                return blocks[:k], window, first
        return [], [], 0

    def release_window(self, seq: Sequence, n: int, free: deque[int]) -> None:
        """`seq`'s next `n` window blocks fall behind its window: let go, names kept."""
        start = seq.window_released
        self.register(seq)
        self.cache.let_go(seq.window_table[start + n - 1:start - 1 if start else None:-1], True, free)
        seq.window_table[start:start + n] = [RELEASED] * n
        seq.window_released = start + n

    def release(self, seq: Sequence, keep_cache: bool, free: deque[int]) -> None:
        """`seq` lets every block go. `keep_cache` False (a failed sequence): nothing of it is
        named, and the blocks only it held lose their names."""
        if keep_cache:
            self.register(seq)
        # Reversed: a freed table's tail is evicted before its head (prompts share heads), and
        # its unnamed blocks are handed out again in its own order.
        self.cache.let_go(reversed(seq.block_table), keep_cache, free)
        seq.block_table = []
        if self.window:
            self.cache.let_go(reversed(seq.window_table[seq.window_released:]), keep_cache, free)
            seq.window_table, seq.window_released = [], 0
        seq.hashed_blocks = 0
