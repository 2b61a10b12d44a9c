"""What each attention node caches, as a router sees it: per node, the routing keys of its cached
full blocks (scheduling/prefix_hash.py), kept from the `PrefixSummary` each of its snapshots
carries (the changes since the last one, or everything). Dynamo's KV router and llm-d's
prefix-aware scheduler keep the same kind of index from their workers' KV events.

`PrefixIndex.cached_tokens(prompt)` is, per node, how many of a prompt's tokens that node would
serve from its cache: the leading full blocks it holds, as the node's own lookup counts them
(never the last token). A prompt's keys are hashed once per call whatever the number of nodes.
The index lags the nodes by one snapshot (about `LOAD_REFRESH_S`), so a router may over- or
under-count a block that came or went since: it steers a choice, never a request's KV.
"""

from __future__ import annotations

from collections.abc import Sequence as Tokens

from megainfer.messages import PrefixSummary
from megainfer.scheduling.prefix_hash import prompt_routing_keys


class NodePrefixes:
    """One node's cached blocks, by routing key."""

    def __init__(self) -> None:
        self.keys: set[int] = set()
        self.salt: bytes | None = None  # the node's naming (None: no summary yet, or caching off)
        self.block_size = 0

    def apply(self, summary: PrefixSummary | None) -> None:
        if summary is None:  # the node does not cache prefixes
            self.keys, self.salt = set(), None
            return
        self.salt, self.block_size = summary.salt, summary.block_size
        if summary.whole:
            self.keys = set(summary.stored)
            return
        self.keys.difference_update(summary.removed)
        self.keys.update(summary.stored)

    def cached_blocks(self, keys: list[int]) -> int:
        """How many of `keys` (a prompt's, in order) this node holds from the first on."""
        held = self.keys
        for n, key in enumerate(keys):
            if key not in held:
                return n
        return len(keys)


class PrefixIndex:
    """Every node's `NodePrefixes`, numbered as the router numbers nodes."""

    def __init__(self) -> None:
        self.nodes: list[NodePrefixes] = []

    def observe(self, node: int, summary: PrefixSummary | None) -> None:
        while len(self.nodes) <= node:
            self.nodes.append(NodePrefixes())
        self.nodes[node].apply(summary)

    def forget(self, node: int) -> None:
        """Nodes `node` and up are gone."""
        del self.nodes[node:]

    def cached_tokens(self, prompt: Tokens[int] | str, num_nodes: int, cache_salt: str | None = None) -> list[int]:
        """Per node (0 .. num_nodes - 1), the prompt tokens it would serve from its cache. A text
        prompt (tokenized only on its node) counts 0 everywhere."""
        return self.count(self.prompt_keys(prompt, cache_salt), num_nodes)

    def prompt_keys(self, prompt: Tokens[int] | str, cache_salt: str | None = None) -> dict[tuple[bytes, int], list[int]]:
        """The prompt's routing keys under each naming (salt, block size) a node that caches
        anything uses (one per deployment): the hashing, apart from the counting, so a caller
        can do it outside its lock."""
        keys: dict[tuple[bytes, int], list[int]] = {}
        if isinstance(prompt, str) or len(prompt) < 2:
            return keys
        for node in list(self.nodes):
            naming = (node.salt, node.block_size)
            if node.salt is not None and node.keys and naming not in keys:
                keys[naming] = prompt_routing_keys(node.salt, cache_salt, prompt, node.block_size)
        return keys

    def count(self, keys: dict[tuple[bytes, int], list[int]], num_nodes: int) -> list[int]:
        """Per node, the tokens of a prompt with `keys` (`prompt_keys`) it would serve from its cache."""
        cached = [0] * num_nodes
        for i, node in enumerate(self.nodes[:num_nodes]):
            naming_keys = keys.get((node.salt, node.block_size))
            if naming_keys is not None:
                cached[i] = node.cached_blocks(naming_keys) * node.block_size
        return cached
