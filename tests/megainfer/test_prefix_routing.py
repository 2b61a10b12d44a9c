"""Routing that knows where a prefix lives: the routers' per-node index of cached blocks agrees
with the nodes' own lookups, the policies act on it, and a simulated fleet behind a shared-prefix
workload shows prefix-aware routing hitting more than round robin."""

from __future__ import annotations

from megainfer.tools.bench.workload import generate, with_shared_prefixes
from megainfer.engine_config import EngineConfig
from megainfer.messages import NodeLoad
from megainfer.presets import PRESETS
from megainfer.routing.policies import PrefixAffinity, make_router
from megainfer.routing.prefix_index import PrefixIndex
from megainfer.sampling_params import SamplingParams
from megainfer.scheduling.kv_cache import BlockManager
from megainfer.scheduling.node_state import snapshot
from megainfer.scheduling.prefix_hash import model_salt
from megainfer.scheduling.scheduler import ChunkedPrefill, Scheduler
from megainfer.scheduling.sequence import Sequence
from megainfer.tools.simulator.cluster import ClusterSimulator
from planner.catalog import Catalog
from planner.step_cost_model import ColocatedStepModel

SALT = model_salt("m", "float32", 4)


def node_with(prompts: list[list[int]]) -> BlockManager:
    """A node's block manager that computed and released `prompts`."""
    bm = BlockManager(64, 4, prefix_salt=SALT)
    for i, prompt in enumerate(prompts):
        seq = Sequence(f"r{i}", prompt, SamplingParams())
        bm.claim_prefix(seq)
        bm.allocate(seq, seq.num_uncomputed_tokens)
        seq.num_computed_tokens = len(prompt)
        bm.free(seq)
    return bm


def test_the_index_counts_what_each_node_would_find_in_its_own_cache():
    shared = list(range(100, 120))
    a, b = node_with([shared + [1, 2, 3]]), node_with([shared[:9] + [7] * 10])
    index = PrefixIndex()
    index.observe(0, a.prefix.take_summary())
    index.observe(1, b.prefix.take_summary())
    index.observe(2, None)  # a node without prefix caching
    prompt = shared + [9, 9]
    assert index.cached_tokens(prompt, 3) == [20, 8, 0]
    for node, bm in ((0, a), (1, b)):  # what the node's own lookup would take
        lookup = Sequence("q", prompt, SamplingParams())
        assert index.cached_tokens(prompt, 3)[node] == bm.claim_prefix(lookup)
        bm.unclaim_prefix(lookup)
    assert index.cached_tokens("text is tokenized on its node", 3) == [0, 0, 0]
    assert index.cached_tokens(prompt, 3, cache_salt="other") == [0, 0, 0]
    # Deltas: a's blocks evicted by new work show up as removed in its next summary.
    for i in range(31):  # 62 blocks from 59 never-named free ones: 3 of a's 5 named blocks evicted
        seq = Sequence(f"n{i}", [5000 + i] * 4 + [1], SamplingParams())
        a.allocate(seq, 5)
    index.observe(0, a.prefix.take_summary())
    assert index.cached_tokens(prompt, 3)[0] < 20
    index.forget(1)
    assert index.cached_tokens(prompt, 3)[1:] == [0, 0]


def test_prefix_affinity_follows_the_cache_until_a_node_is_too_busy():
    router = PrefixAffinity(load_cap=1.5, slack=2)
    idle = [NodeLoad(capacity_tokens=1000) for _ in range(3)]
    assert router.choose(idle, 100, 16, [0, 64, 32]) == 1
    assert router.choose(idle, 100, 16, None) == 0  # nothing cached anywhere: the freest, lowest index
    busy = [NodeLoad(capacity_tokens=1000, running=r) for r in (1, 12, 2)]
    assert router.choose(busy, 100, 16, [0, 64, 32]) == 2  # node 1 is over 1.5 x the mean + 2: passed over


def test_the_predictive_router_charges_only_the_uncached_prompt():
    router = make_router("predictive", step_prior=(0.02, 1e-4, 0.0, 0.0, 0.0), clock=lambda: 0.0)
    for node in range(2):  # two idle nodes, each chunking prompts by 512 tokens a step
        idle = Scheduler(BlockManager(6250, 16), ChunkedPrefill(), max_num_seqs=64, max_num_batched_tokens=512,
                         max_model_len=8192)
        router.observe(node, snapshot(idle, 0.0), 0.0)
    loads = [NodeLoad(capacity_tokens=100_000) for _ in range(2)]
    assert router.choose(loads, 4000, 16, [0, 3968]) == 1
    assert router.choose(loads, 4000, 16, [3968, 0]) == 0


def test_a_simulated_fleet_behind_shared_prefixes_hits_more_with_prefix_aware_routers():
    """The direction `megainfer simulate-routing --shared-prefixes` shows at 12 replicas
    (docs/routing.md), at a scale the default run affords."""
    model = PRESETS["qwen3-30b-a3b"]
    step_model = ColocatedStepModel(model, Catalog.load()["H100"], 1)
    requests = with_shared_prefixes(generate("sharegpt", num_requests=150, rate=3.0, max_model_len=16384, seed=2),
                                    num_prefixes=24, prefix_len=4096, max_model_len=16384, seed=2)
    # A KV cache of ~100k tokens per replica: a few replicas' worth of prefixes, not all 24.
    config = EngineConfig(max_num_batched_tokens=512, num_kv_blocks=6400)
    rates, ttft = {}, {}
    for name in ("round_robin", "predictive", "prefix_affinity"):
        sim = ClusterSimulator(model, step_model, config, 4, make_router(name), snapshot_s=0.25)
        summary = sim.run(requests, 3.0).summary()
        rates[name], ttft[name] = summary["prefix_hit_rate"], summary["ttft_mean_s"]
    # Measured: 26.3% round robin, 48.6% predictive, 52.8% prefix_affinity; mean TTFT 0.62, 0.45, 0.49 s.
    assert rates["predictive"] > 1.4 * rates["round_robin"], rates
    assert rates["prefix_affinity"] > 1.4 * rates["round_robin"], rates
    assert ttft["predictive"] < ttft["round_robin"] and ttft["prefix_affinity"] < ttft["round_robin"], ttft
