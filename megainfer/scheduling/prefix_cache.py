"""Automatic prefix caching's bookkeeping (vLLM v1's, SGLang's RadixAttention in spirit): which
KV blocks hold which named full blocks (`prefix_hash`), how many sequences hold each block, and
which cached blocks no sequence holds, least recently used first.

A full block's KV, once computed, is registered under its name. A new sequence whose prompt's
leading blocks are registered takes those blocks (read-only: a sequence writes only past its
computed prefix, and a hit ends on a block boundary) and starts computing after them. A block
no sequence holds stays registered and evictable: the block manager hands out never-cached free
blocks first, then evicts the least recently released cached one (dropping its name).

`PrefixCache` holds no block ids of its own: `kv_cache.BlockManager` owns them and calls it.
It also logs names registered and dropped since a router last read them (`take_summary`), so a
router can tell how much of a prompt each node caches without asking per request.
"""

from __future__ import annotations

from collections import OrderedDict

from megainfer.messages import PrefixSummary
from megainfer.scheduling.prefix_hash import routing_key

# Every this many summaries lists every name again, so a reader that missed one (a summary taken
# by another caller, a lost answer) is whole again within seconds at the routers' polling rate.
WHOLE_EVERY = 64


class PrefixCache:
    def __init__(self, num_blocks: int, block_size: int, salt: bytes) -> None:
        self.block_size = block_size
        self.salt = salt  # the first block's parent (prefix_hash.model_salt)
        self.block_of: dict[bytes, int] = {}  # name -> block holding its KV
        self.name_of: dict[int, bytes] = {}  # block -> its name (registered blocks only)
        self.holders = [0] * num_blocks  # sequences holding each block
        # Registered blocks no sequence holds: evictable, least recently released first.
        self.evictable: OrderedDict[int, None] = OrderedDict()
        self.queries = 0  # prompt tokens looked up at admission (vLLM's prefix_cache_queries)
        self.hits = 0  # of those, tokens found cached (prefix_cache_hits)
        # For routers: names registered and dropped since the last summary; `whole` when the
        # next summary must list every name (the first one, after a reset or an overflow).
        self._stored: list[int] = []
        self._removed: list[int] = []
        self._whole = True
        self._log_limit = 4 * num_blocks + 1024  # nobody reading (an offline engine): stop logging
        self._summaries = 0

    # -- names ---------------------------------------------------------------------------------
    def register(self, block: int, name: bytes, routed: bool = True) -> None:
        """`block`'s KV is now the full block `name`. A name already held by another block stays
        with that one (two sequences computed the same block at once): this block stays unnamed.
        `routed` False: routers are not told (a window table's block: they count full blocks)."""
        if name in self.block_of or block in self.name_of:
            return
        self.block_of[name] = block
        self.name_of[block] = name
        if routed:
            self._log(self._stored, name)

    def drop(self, block: int) -> None:
        """`block` is being reused or its KV is no longer trusted: its name goes."""
        name = self.name_of.pop(block, None)
        if name is not None:
            del self.block_of[name]
            if len(name) == len(self.salt):  # a full-table name (window names are longer)
                self._log(self._removed, name)

    def match(self, names: list[bytes], limit: int) -> list[int]:
        """Blocks holding the longest run of `names[:limit]` from the first."""
        blocks = []
        block_of = self.block_of
        for name in names[:limit]:
            block = block_of.get(name)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def take(self, blocks: list[int]) -> None:
        """A sequence holds `blocks` (found by name) too: evictable ones are no longer."""
        holders, evictable = self.holders, self.evictable
        for block in blocks:
            if not holders[block]:
                del evictable[block]
            holders[block] += 1

    def let_go(self, blocks, keep_cache: bool, free) -> None:
        """A sequence no longer holds `blocks` (in the order given): a block nobody holds becomes
        evictable if named, else goes to `free`. `keep_cache` False: it loses its name first."""
        holders, named, evictable = self.holders, self.name_of, self.evictable
        for block in blocks:
            holders[block] -= 1
            if holders[block]:
                continue
            if not keep_cache:
                self.drop(block)
            if block in named:
                evictable[block] = None
            else:
                free.append(block)

    def reset(self) -> list[int]:
        """Every name dropped (vLLM's reset_prefix_cache); blocks held by running sequences stay
        theirs, unnamed. Returns the blocks that were evictable (now plain free blocks)."""
        freed = list(self.evictable)
        self.block_of.clear()
        self.name_of.clear()
        self.evictable.clear()
        self._stored, self._removed, self._whole = [], [], True
        return freed

    # -- the routers' view ---------------------------------------------------------------------
    def _log(self, log: list[int], name: bytes) -> None:
        if self._whole:
            return  # the next summary lists every name anyway
        if len(self._stored) + len(self._removed) >= self._log_limit:
            self._stored, self._removed, self._whole = [], [], True
            return
        log.append(routing_key(name))

    def take_summary(self) -> PrefixSummary:
        """What changed since the last summary (or everything, `whole`), and the counters."""
        self._summaries += 1
        whole = self._whole or self._summaries % WHOLE_EVERY == 0
        stored = [routing_key(name) for name in self.block_of if len(name) == len(self.salt)] if whole \
            else self._stored
        summary = PrefixSummary(self.salt, self.block_size, whole, stored, [] if whole else self._removed,
                                self.queries, self.hits)
        self._stored, self._removed, self._whole = [], [], False
        return summary
