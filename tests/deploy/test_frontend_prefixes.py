"""The frontend's view of where prefixes live: each attention node's snapshot summary kept per
node, and every router handed, with each request, the tokens of its prompt each node caches
(without Ray: the frontend's own bookkeeping, fed snapshots as its tracker would)."""

from __future__ import annotations

from deploy.frontend import Frontend, observe_prefixes
from megainfer.messages import NodeLoad
from megainfer.routing.policies import Router
from megainfer.sampling_params import SamplingParams
from megainfer.scheduling.kv_cache import BlockManager
from megainfer.scheduling.node_state import snapshot
from megainfer.scheduling.prefix_hash import model_salt
from megainfer.scheduling.scheduler import ChunkedPrefill, Scheduler
from megainfer.scheduling.sequence import Sequence


class Recording(Router):
    name = "recording"

    def __init__(self) -> None:
        self.seen: list[list[int] | None] = []

    def choose(self, loads, prompt_tokens, max_tokens, cached=None):
        self.seen.append(cached)
        return 0


def node(cached_prompts: list[list[int]]) -> Scheduler:
    """An attention node's scheduler whose cache holds `cached_prompts`' blocks."""
    scheduler = Scheduler(BlockManager(64, 16, prefix_salt=model_salt("m", "float32", 16)), ChunkedPrefill(),
                          max_num_seqs=8, max_num_batched_tokens=512, max_model_len=1024)
    for i, prompt in enumerate(cached_prompts):
        seq = Sequence(f"r{i}", prompt, SamplingParams())
        scheduler.block_manager.allocate(seq, len(prompt))
        seq.num_computed_tokens = len(prompt)
        scheduler.block_manager.free(seq)
    return scheduler


def test_routers_get_each_nodes_cached_tokens_with_every_request():
    system = list(range(500, 564))  # four blocks of 16
    nodes = [node([]), node([system + [1, 2, 3]])]
    router = Recording()
    frontend = Frontend(router, max_open_per_group=8)
    frontend._loads = [NodeLoad(capacity_tokens=1024) for _ in nodes]
    states = [(0.0, [snapshot(n, 0.0) for n in nodes])]  # one node group of two attention nodes
    observe_prefixes(frontend._prefixes, states)
    frontend.route(system + [9, 9], SamplingParams(max_tokens=4))
    frontend.route("text is tokenized on its node", SamplingParams(max_tokens=4))
    frontend.route(system + [9], SamplingParams(max_tokens=4, cache_salt="tenant"))
    assert router.seen == [[0, 64], [0, 0], [0, 0]]
    # A node that did not answer keeps what the index knew of it; the next summaries are deltas.
    observe_prefixes(frontend._prefixes, [(0.1, [None, snapshot(nodes[1], 0.1)])])
    frontend.route(system + [7], SamplingParams(max_tokens=4))
    assert router.seen[-1] == [0, 64]
    nodes[1].block_manager.reset_prefix_cache()
    observe_prefixes(frontend._prefixes, [(0.2, [snapshot(n, 0.2) for n in nodes])])
    frontend.route(system + [7], SamplingParams(max_tokens=4))
    assert router.seen[-1] == [0, 0]
