"""The names of full KV blocks for automatic prefix caching: a hash chained over the tokens of
every block before them (vLLM v1's scheme), so two sequences share a block's name only if they
share every token up to its end.

A block's name is `sha256(parent name + its tokens as int32)`; the first block's parent is the
salt: the model and everything else that changes the KV (`model_salt`), and a request's
`cache_salt` where it gives one (vLLM's field: requests with different salts share nothing). The
digest is kept whole where a name decides which KV a request reads (the engine's cache: a
collision there would serve another prompt's KV), and cut to 64 bits where it only steers a
router (`routing_key`).

Plain Python: the scheduler, the routers and the simulator hash alike, so a router's count of a
prompt's cached blocks on a node is the node's own count.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence as Tokens

from megainfer.engine_config import EngineConfig

ROUTING_KEY_BYTES = 8


def model_salt(model_name: str, dtype: str, block_size: int) -> bytes:
    """The first block's parent for an engine serving `model_name` in `dtype` (what changes the
    KV besides the tokens; LoRA and multimodal inputs are not served)."""
    return hashlib.sha256(f"megainfer-prefix-cache|{model_name}|{dtype}|{block_size}".encode()).digest()


def engine_salt(config: EngineConfig, model_name: str) -> bytes | None:
    """The salt naming the cached blocks of an engine with `config` serving `model_name` (None:
    its prefix caching is off)."""
    if not config.enable_prefix_caching:
        return None
    return model_salt(model_name, config.concrete_dtype, config.block_size)


def request_salt(salt: bytes, cache_salt: str | None) -> bytes:
    """The parent of a request's first block: the engine's salt, salted again by the request's
    `cache_salt` when it has one."""
    if not cache_salt:
        return salt
    return hashlib.sha256(salt + b"|cache_salt|" + cache_salt.encode()).digest()


def extend_block_hashes(hashes: list[bytes], root: bytes, token_ids: Tokens[int], block_size: int,
                        num_blocks: int) -> list[bytes]:
    """`hashes` (the names of a sequence's first blocks) extended to its first `num_blocks` full
    blocks; `root` is the first block's parent. Each block's tokens are converted once."""
    have = len(hashes)
    if have >= num_blocks:
        return hashes
    parent = hashes[-1] if hashes else root
    raw = array("i", token_ids[have * block_size:num_blocks * block_size]).tobytes()
    width = 4 * block_size
    sha256 = hashlib.sha256
    for k in range(num_blocks - have):
        parent = sha256(parent + raw[k * width:(k + 1) * width]).digest()
        hashes.append(parent)
    return hashes


def routing_key(block_hash: bytes) -> int:
    """A block name's 64 bits that routers keep (a collision costs a worse choice, never wrong KV)."""
    return int.from_bytes(block_hash[:ROUTING_KEY_BYTES], "little")


def prompt_routing_keys(salt: bytes, cache_salt: str | None, token_ids: Tokens[int], block_size: int) -> list[int]:
    """The routing keys of the full blocks of a prompt that a node could serve from its cache
    (never its last token: the engine computes at least one token to sample from)."""
    blocks = (len(token_ids) - 1) // block_size if token_ids else 0
    return [routing_key(h) for h in extend_block_hashes([], request_salt(salt, cache_salt), token_ids,
                                                        block_size, blocks)]
