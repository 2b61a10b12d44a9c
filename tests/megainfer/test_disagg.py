"""The disaggregated runtime without Ray: attention engines and expert workers in threads,
connected by real M2N endpoints, produce exactly the colocated engine's greedy tokens."""

from __future__ import annotations

import gc
import itertools
import sys
import threading
import time
import weakref
from types import SimpleNamespace
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deploy.link import SwitchableLink
from megainfer.expert_replicas import ExpertReplicas
from megainfer import Engine, SamplingParams
from megainfer.disagg import attention_exchange, device_slots, expert_exchange, expert_worker, pipelined_runner
from megainfer.disagg.device_staging import ComputeTimer, DeviceStaging, HostCopy
from megainfer.disagg.expert_exchange import rank_shares, shared_positions_on
from megainfer.disagg.expert_link import (RecordViews, dispatch_bytes, pack_dispatch, pack_records, rank_share,
                                          record_bytes, unpack_dispatch)
from megainfer.disagg.expert_worker import ExpertWorker
from megainfer.disagg.pipelined_runner import PipelinedModelRunner
from megainfer.engine_config import EngineConfig
from megainfer.model.weights import SafetensorsCheckpoint
from megainfer.runner.inputs_ahead import InputsAhead
from megainfer.scheduling.step_layout import split_micro_batches
from tests.helpers import connect_all, generate_all
from tests.soft_rdma import soft_device
from transport import Endpoint

SECRET = b"d" * 32
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


def run_local_deployment(path, n_attention, n_expert, m, prompts, backend="shm", device="cpu", worker_options=None,
                         replicas=None, switch=None, nodes=None, steps=None, params=GREEDY, runner_options=None,
                         **engine_options):
    """Wire a deployment in threads; return each prompt's greedy tokens. `worker_options`,
    `runner_options`: more ExpertWorker and PipelinedModelRunner arguments. `replicas`: where
    the experts' slots live (default: contiguous runs, one slot each); `switch`: (step,
    ExpertReplicas), a re-placement every rank switches to at that step (staged on the expert
    workers first). `nodes`: a list the workers and the engines are appended to, for a test to
    look at afterwards. `steps`: how many lockstep steps every node
    runs (default: enough for 40 per prompt); `params`: the requests' sampling (default GREEDY)."""
    engine_config = EngineConfig(**{"num_kv_blocks": 64, "block_size": 8, "max_num_batched_tokens": 64, "device": device,
                                    **engine_options})
    probe = Engine(str(path), engine_config)
    model_config = probe.model_config
    per = model_config.num_experts // n_expert
    assignment = [list(range(k * per, (k + 1) * per)) for k in range(n_expert)]
    if replicas is None:
        replicas = ExpertReplicas.of_assignment(assignment, model_config.num_layers)
    attn_names = [f"attn{i}" for i in range(n_attention)]
    expert_names = [f"expert{k}" for k in range(n_expert)]
    tokens = engine_config.max_num_batched_tokens
    h, top_k = model_config.hidden_size, model_config.top_k
    links = {}
    for i, name in enumerate(attn_names):
        links[name] = SwitchableLink(name, i, SECRET, "127.0.0.1", tokens * h * 4, m, backend, 30)
    for k, name in enumerate(expert_names):
        links[name] = SwitchableLink(name, 100 + k, SECRET, "127.0.0.1",
                                     dispatch_bytes(tokens, h, top_k, torch.float32), m, backend, 30)
    for link in links.values():
        link.open()
    endpoints = {name: link.endpoint for name, link in links.items()}
    connect_all(endpoints, {**{a: expert_names for a in attn_names}, **{e: attn_names for e in expert_names}})
    workers = [ExpertWorker(model_config, assignment[k], "float32", device, SafetensorsCheckpoint(path),
                            attention_nodes=attn_names, micro_batches=m, link=links[name], replicas=replicas, node=k,
                            name=name, **(worker_options or {}))
               for k, name in enumerate(expert_names)]
    engines = []
    for name in attn_names:
        def factory(mc, cfg, weights, max_len, name=name):
            return PipelinedModelRunner(mc, cfg, weights, max_len, link=links[name], expert_nodes=expert_names,
                                        replicas=replicas, micro_batches=m, movable_experts=switch is not None,
                                        name=name, **(runner_options or {}))
        engines.append(Engine(str(path), engine_config, runner_factory=factory))
    if nodes is not None:
        nodes.extend(workers + engines)
    if switch is not None:
        step, new = switch
        for k, worker in enumerate(workers):
            worker.switch.stage(worker.layers, new, k, worker.weights)
            worker.switch.switch_at(step, new.version)
        for engine in engines:
            engine.runner.slot_maps.switch_at(step, new)
    # Spread prompts over attention nodes round robin; every node steps until all are done.
    for i, p in enumerate(prompts):
        engines[i % n_attention].add_request(f"r{i}", p, params)
    results = {f"r{i}": [] for i in range(len(prompts))}
    done = threading.Event()
    errors = []
    steps = steps or max(len(prompts) * 40, 200)

    def attention_loop(engine):
        try:
            for _ in range(steps):
                for d in engine.step():
                    results[d.request_id].extend(d.new_token_ids)
                if all(not e.has_unfinished_requests() for e in engines) and done.is_set():
                    break
        except BaseException as exc:
            errors.append(exc)

    def expert_loop(worker):
        try:
            for _ in range(steps):
                worker.run_step()
        except BaseException as exc:
            errors.append(exc)

    # Every node runs the same number of steps: the lockstep the protocol requires.
    threads = [threading.Thread(target=attention_loop, args=(e,)) for e in engines]
    threads += [threading.Thread(target=expert_loop, args=(w,)) for w in workers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    for ep in endpoints.values():
        ep.close()
    assert not errors, errors
    return [results[f"r{i}"] for i in range(len(prompts))], [e.stats() for e in engines]


def colocated(path, prompts, device="cpu", params=GREEDY):
    config = EngineConfig(num_kv_blocks=64, block_size=8, max_num_batched_tokens=64, device=device)
    return generate_all(Engine(str(path), config), prompts, params)


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("m", [1, 2, 3])
def test_two_by_two_deployment_matches_colocated(hf_ref, m, async_scheduling, monkeypatch):
    """Asynchronous scheduling too: each step scheduled while the one before ran, its tokens
    written into the placeholders the look-ahead held, settled inside the next step, and its
    micro-batch 0 prepared during the step before's last layer, its tokens placed micro-batch by
    micro-batch as they are sampled and read once all placed (`InputsAhead.fill`, before the
    step's end), or else as the next step starts."""
    taken, filled = [], []
    take = InputsAhead.take
    monkeypatch.setattr("megainfer.engine.engine.SETTLE_PIECE", 1)  # the settle spread over the layers
    from megainfer.runner.step_hooks import StepHooks
    run_piece, spread = StepHooks.run_piece, []  # per call: a piece ran and more were left

    def recorded_piece(self, **kwargs):
        before, finished = self._done, run_piece(self, **kwargs)
        spread.append(not before and not finished)
        return finished

    monkeypatch.setattr(StepHooks, "run_piece", recorded_piece)

    def recorded_take(self, *args):
        filled.append(self._ready is not None)
        taken.append(take(self, *args))
        return taken[-1]

    monkeypatch.setattr(InputsAhead, "take", recorded_take)
    prompts = hf_ref.prompts
    expected = colocated(hf_ref.path, prompts)
    got, stats = run_local_deployment(hf_ref.path, 2, 2, m, prompts, async_scheduling=async_scheduling)
    assert got == expected
    assert all(s.kv_cache_usage == 0.0 for s in stats)
    prepared_ahead = sum(state is not None for state in taken)
    assert prepared_ahead > 0 if async_scheduling else prepared_ahead == 0
    assert any(filled) if async_scheduling else not any(filled)
    assert any(spread) == async_scheduling  # the work beside the layers spread over several of them


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 2])
def test_two_by_two_deployment_on_cuda_matches_colocated(mixtral_ref, m):
    """The CUDA path: dispatches staged through pinned memory on a copy stream, answers in
    through pinned memory, expert answers out on the expert's copy stream."""
    prompts = mixtral_ref.prompts
    got, _ = run_local_deployment(mixtral_ref.path, 2, 2, m, prompts, device="cuda")
    assert got == colocated(mixtral_ref.path, prompts, device="cuda")


def test_device_slots_across_hosts_written_by_rdma_match_colocated(hf_ref, soft_verbs, monkeypatch):
    """Every node on a host of its own, its link rdma in the compiled transport core (on the
    software verbs provider: no adapter here): each pair's dispatches and answers are written
    by the adapter into the receiver's device-slot region, their headers carrying no bytes,
    and read there in place; the tokens are the colocated engine's."""
    soft_device(monkeypatch, soft_verbs)
    hosts = itertools.count()
    monkeypatch.setattr(device_slots, "host_identity", lambda: f"host{next(hosts)}/boot")
    posted = []  # (the module that posted, its targets) of every round the runner and the workers posted
    for method in ("post_round", "post_rows"):
        def record(self, *a, _original=getattr(Endpoint, method), **k):
            caller = Path(sys._getframe(2).f_code.co_filename).name  # past SwitchableLink's method
            posted.append((caller, k.get("targets")))
            return _original(self, *a, **k)
        monkeypatch.setattr(Endpoint, method, record)
    prompts = hf_ref.prompts
    expected = colocated(hf_ref.path, prompts)
    engine_tokens = 64  # run_local_deployment's max_num_batched_tokens
    nodes = []
    model = Engine(str(hf_ref.path), EngineConfig(num_kv_blocks=8, block_size=8)).model_config
    h, top_k = model.hidden_size, model.top_k
    got, _ = run_local_deployment(
        hf_ref.path, 2, 2, 2, prompts, backend="rdma", nodes=nodes,
        runner_options={"device_slot_bytes": engine_tokens * h * 4},
        worker_options={"device_slot_bytes": dispatch_bytes(engine_tokens, h, top_k, torch.float32)})
    assert got == expected
    for node in nodes:
        slots = node.slots if isinstance(node, ExpertWorker) else node.runner.slots
        assert slots.direct.all() and not slots.local.any()  # every pair by rdma: no host on both ends
    data = [targets for caller, targets in posted if caller in ("attention_exchange.py", "expert_exchange.py")]
    assert len(data) > 20 and all(t is not None and (t >= 0).all() for t in data)  # each into the peers' regions


def _replicated(path, version: int = 0) -> ExpertReplicas:
    """Two nodes with room for one more than half the experts: expert 0 and the first of the
    second half (h) on both (shares 0.7 / 0.3 and 0.25 / 0.75), the rest once; node 1 lists its
    experts out of order."""
    from megainfer.expert_replicas import LayerReplicas
    from megainfer.model_resolution import resolve_model

    cfg, _ = resolve_model(str(path))
    h = cfg.num_experts // 2
    second = tuple(reversed(range(h, 2 * h)))
    layer = LayerReplicas((tuple(range(h)) + (h,), second + (0,)),
                          ((0.7,) + (1.0,) * (h - 1) + (0.25,), tuple(0.75 if e == h else 1.0 for e in second) + (0.3,)),
                          h + 1)
    return ExpertReplicas(version, (layer,) * cfg.num_layers)


@pytest.mark.parametrize("m", [1, 2])
def test_experts_with_replicas_give_the_colocated_tokens(hf_ref, m):
    """Hot experts held twice, each pair sent to one replica by its row: tokens unchanged."""
    prompts = hf_ref.prompts
    got, _ = run_local_deployment(hf_ref.path, 2, 2, m, prompts, replicas=_replicated(hf_ref.path))
    assert got == colocated(hf_ref.path, prompts)


def test_a_live_re_placement_at_an_agreed_step_keeps_the_tokens(hf_ref):
    """Contiguous experts with a spare slot each, then at step 6 (mid-generation: prompts before,
    decodes after) the replicated placement, staged on the expert workers beforehand, on every
    rank at once: tokens equal to the colocated engine's, the workers serve version 1 after."""
    from megainfer.expert_replicas import from_assignment

    new = _replicated(hf_ref.path, version=1)
    half = new.layers[0].slots_per_node - 1
    start = ExpertReplicas.uniform(from_assignment([list(range(half)), list(range(half, 2 * half))], half + 1),
                                   len(new.layers))
    prompts = hf_ref.prompts
    nodes = []
    got, stats = run_local_deployment(hf_ref.path, 2, 2, 2, prompts, replicas=start, switch=(6, new), nodes=nodes)
    assert got == colocated(hf_ref.path, prompts)
    assert all(s.kv_cache_usage == 0.0 for s in stats)
    workers, engines = nodes[:2], nodes[2:]
    assert [w.switch.version for w in workers] == [1, 1]
    assert all(e.runner.slot_maps.current.version == 1 for e in engines)
    assert workers[1].layers[0].expert_ids[-1] == 0  # node 1 now holds a replica of expert 0


def test_the_expert_nodes_count_what_every_attention_nodes_router_sent_them_step_by_step(mixtral_ref, monkeypatch):
    """The load round, across a live re-placement to replicated experts: every step, each
    attention leader holds the expert nodes' counts, equal to the two attention nodes' gating
    counts added up; each node's pairs add up to them per layer; the step is prefill exactly
    when some attention node's carried prompt tokens; the windows hold them for the rebalancer."""
    from megainfer.expert_replicas import from_assignment

    steps: dict[int, list] = {}
    execute = pipelined_runner.PipelinedModelRunner.execute

    def recording(runner, out, hooks=None):
        result = execute(runner, out, hooks)
        steps.setdefault(id(runner), []).append((result.expert_counts.copy(), result.expert_node_load,
                                                 out.carries_prompt_tokens))
        return result

    monkeypatch.setattr(pipelined_runner.PipelinedModelRunner, "execute", recording)
    new = _replicated(mixtral_ref.path, version=1)
    half = new.layers[0].slots_per_node - 1
    start = ExpertReplicas.uniform(from_assignment([list(range(half)), list(range(half, 2 * half))], half + 1),
                                   len(new.layers))
    nodes = []
    _, stats = run_local_deployment(mixtral_ref.path, 2, 2, 2, mixtral_ref.prompts[:3], replicas=start,
                                    switch=(6, new), nodes=nodes, steps=40)
    first, second = steps.values()
    assert len(first) == len(second) == 40
    routed = 0
    for (gating_a, load_a, prompt_a), (gating_b, load_b, prompt_b) in zip(first, second):
        np.testing.assert_array_equal(load_a.counts, gating_a + gating_b)
        np.testing.assert_array_equal(load_b.counts, load_a.counts)
        np.testing.assert_array_equal(load_a.node_pairs.sum(axis=1), load_a.counts.sum(axis=1))
        assert load_a.prefill == load_b.prefill == (prompt_a or prompt_b)
        routed += int(load_a.counts.sum())
    assert routed and any(load.prefill for _, load, _ in first) and not all(load.prefill for _, load, _ in first)
    assert [w.switch.version for w in nodes[:2]] == [1, 1]
    window = stats[0].expert_window  # as the rebalancer reads it: the 40 steps fit its 64
    np.testing.assert_array_equal(window.of("all"), sum(load.counts for _, load, _ in first))
    np.testing.assert_array_equal(window.node_pairs, sum(load.node_pairs for _, load, _ in first))
    assert sum(int(np.sum(w.served.per_layer())) for w in nodes[:2]) == routed


@pytest.mark.parametrize("m", [1, 2])
def test_layered_prefill_in_attention_nodes_matches_colocated(hf_ref, m):
    prompts = hf_ref.prompts
    expected = colocated(hf_ref.path, prompts)
    got, stats = run_local_deployment(hf_ref.path, 2, 2, m, prompts, prefill_policy="layered", group_tokens=8)
    assert got == expected
    assert all(s.kv_cache_usage == 0.0 for s in stats)


def test_micro_batch_split_balances_tokens_and_keeps_order():
    groups = split_micro_batches([1, 1, 1, 30, 10], 2)
    assert sorted(i for g in groups for i in g) == [0, 1, 2, 3, 4]
    assert all(g == sorted(g) for g in groups)
    assert split_micro_batches([5], 3)[1:] == [[], []]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 40), max_size=60), st.integers(1, 5))
def test_micro_batch_split_is_the_least_loaded_rule_with_its_fast_round_robin(num_tokens, m):
    """The leading one-token entries go round-robin at C speed; that is what the rule (each to
    the least loaded micro-batch, the first of equals) gives them, for any tail after them."""
    decodes_first = sorted(num_tokens, key=lambda n: n > 1)  # as a step orders them
    assert split_micro_batches(decodes_first, m) == _least_loaded(decodes_first, m)
    assert split_micro_batches(num_tokens, m) == _least_loaded(num_tokens, m)


def _least_loaded(num_tokens, m):
    groups, load = [[] for _ in range(m)], [0] * m
    for i, n in enumerate(num_tokens):
        j = load.index(min(load))
        groups[j].append(i)
        load[j] += n
    return groups


def test_dispatch_payload_round_trip():
    x = torch.randn(5, 16)
    ids = torch.randint(0, 8, (5, 2))
    w = torch.rand(5, 2)
    buf = pack_dispatch(x, ids, w)
    assert buf.numel() == dispatch_bytes(5, 16, 2, torch.float32)
    x2, ids2, w2 = unpack_dispatch(buf, 5, 16, 2, torch.float32)
    assert torch.equal(x, x2) and torch.equal(ids.int(), ids2) and torch.equal(w, w2)
    with pytest.raises(ValueError, match="does not hold 4 tokens"):
        unpack_dispatch(buf, 4, 16, 2, torch.float32)


def routed_tokens(n=9, hidden=16, top_k=2, dtype=torch.float32):
    g = torch.Generator().manual_seed(3)
    return (torch.randn(n, hidden, generator=g).to(dtype), torch.randint(0, 8, (n, top_k), generator=g),
            torch.rand(n, top_k, generator=g))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_records_hold_one_token_each_in_the_documented_layout(dtype):
    x, ids, w = routed_tokens(dtype=dtype)
    records = pack_records(x, ids, w)
    size = record_bytes(16, 2, dtype)
    assert records.shape == (9, size) and size == 16 * dtype.itemsize + 2 * 2 * 4
    row = records[4]  # x bytes | int32 ids | float32 weights
    assert torch.equal(row[:16 * dtype.itemsize].view(dtype), x[4])
    assert torch.equal(row[16 * dtype.itemsize:size - 8].view(torch.int32), ids[4].int())
    assert torch.equal(row[size - 8:].view(torch.float32), w[4])
    with pytest.raises(ValueError, match="multiple of 4"):
        record_bytes(3, 2, torch.bfloat16)


def test_a_nodes_tokens_are_one_contiguous_byte_range():
    """Records of every node in node order: node k's message is bytes [o_k, o_k+1) x record."""
    x, ids, w = routed_tokens()
    offsets = [0, 4, 4, 9]  # node 1 gets nothing
    flat = pack_dispatch(x, ids, w)
    size = record_bytes(16, 2, torch.float32)
    for k in range(3):
        begin, end = offsets[k], offsets[k + 1]
        got = unpack_dispatch(flat[begin * size:end * size], end - begin, 16, 2, torch.float32)
        assert torch.equal(got[0], x[begin:end]) and torch.equal(got[1], ids[begin:end].int())
        assert torch.equal(got[2], w[begin:end])


def test_a_tensor_parallel_ranks_share_is_tensor_splits_and_contiguous():
    for count in range(12):
        for tp in (1, 2, 3, 4):
            shares = [rank_share(count, tp, r) for r in range(tp)]
            assert [end - begin for begin, end in shares] == [len(t) for t in torch.arange(count).tensor_split(tp)]
            assert shares[0][0] == 0 and shares[-1][1] == count
            assert all(shares[r][1] == shares[r + 1][0] for r in range(tp - 1))
    x, ids, w = routed_tokens(n=7)
    records = pack_records(x, ids, w)
    begin, end = rank_share(7, 3, 1)  # rank 1 of 3 carries tokens 3 and 4
    got = unpack_dispatch(records[begin:end].view(-1), end - begin, 16, 2, torch.float32)
    assert (begin, end) == (3, 5) and torch.equal(got[0], x[3:5]) and torch.equal(got[2], w[3:5])


def shared_positions(begins: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """The positions [begin, end) of every node, end to end (what a rank's answers come back as)."""
    counts = ends - begins
    starts = np.cumsum(counts) - counts
    return np.arange(int(counts.sum())) + np.repeat(begins - starts, counts)


def test_every_nodes_share_at_once_is_each_nodes_rank_share():
    """The runner's vectorised shares (one numpy pass over the node offsets) against the
    per-node reference, and the positions the answers come back in."""
    rng = np.random.default_rng(0)
    for _ in range(50):
        counts = rng.integers(0, 9, size=rng.integers(1, 6))
        bounds = np.concatenate([[0], np.cumsum(counts)])
        for tp in (1, 2, 3, 4):
            for r in range(tp):
                begins, ends = rank_shares(bounds, tp, r)
                want = [rank_share(int(c), tp, r) for c in counts]
                assert begins.tolist() == [b + lo for b, (lo, _) in zip(bounds[:-1].tolist(), want)]
                assert ends.tolist() == [b + hi for b, (_, hi) in zip(bounds[:-1].tolist(), want)]
                expect = [p for b, e in zip(begins.tolist(), ends.tolist()) for p in range(b, e)]
                assert shared_positions(begins, ends).tolist() == expect
                on_device = shared_positions_on(torch.from_numpy(bounds).to(torch.int32), tp, r, len(expect))
                assert on_device.tolist() == expect


def test_cpu_staging_elides_every_copy():
    staging = DeviceStaging("cpu", slots=2)
    records, offsets = torch.arange(12, dtype=torch.uint8).view(3, 4), torch.tensor([0, 1, 3])
    copy = staging.to_host([records, offsets], slot=1)
    assert copy.landed() and copy.event is None
    host_records, host_offsets = copy.wait()
    assert host_records.data_ptr() == records.data_ptr() and host_offsets.data_ptr() == offsets.data_ptr()
    land = staging.landing(5, slot=0)  # a round lands in a reused host buffer, uploaded as it is
    assert land.numel() == 5 and staging.upload(land, slot=0) is land
    assert staging.landing(3, slot=0).data_ptr() == land.data_ptr()  # no allocation while it fits
    assert staging.landing(5000, slot=0).numel() == 5000 and staging.landing(0, slot=1).numel() == 0
    timer = ComputeTimer("cpu")
    timer.start()
    timer.stop()
    assert timer.collect() >= 0.0 and timer.collect() == 0.0


def test_cpu_landing_slices_are_made_once_per_length_and_forgotten_when_the_buffer_grows():
    staging = DeviceStaging("cpu", slots=2)
    first = staging.landing(64, slot=0)
    assert staging.landing(64, slot=0) is first  # the same tensor: views of it can be kept
    assert staging.landing(64, slot=1) is not first and staging.landing(32, slot=0) is not first
    grown = staging.landing(1 << 16, slot=0)  # a new buffer: slices of the old one are not handed out again
    again = staging.landing(64, slot=0)
    assert again is not first and again.data_ptr() == grown.data_ptr()


def test_kept_record_views_are_the_unpacked_records_of_each_round_that_lands_in_a_kept_slice():
    staging, views = DeviceStaging("cpu", slots=1), RecordViews(16, 2, torch.float32, keep=True)
    size = record_bytes(16, 2, torch.float32)
    for n in (5, 3, 5, 9, 5):  # lengths that come back reuse their slice and its views
        x, ids, w = routed_tokens(n)
        landed = staging.landing(n * size, slot=0)
        landed.copy_(pack_dispatch(x, ids, w))
        got = views.of(landed, n, slot=0)
        assert all(torch.equal(a, b) for a, b in zip(got, (x, ids.int(), w)))
        assert all(a.data_ptr() == b.data_ptr() for a, b in zip(got, unpack_dispatch(landed, n, 16, 2, torch.float32)))
    assert views.of(landed, 5, slot=0) is views.of(landed, 5, slot=0)  # made once
    # A round of its own (device slots, a follower's share) or on CUDA: nothing kept.
    assert views.of(landed, 5) is not views.of(landed, 5)
    fresh = RecordViews(16, 2, torch.float32, keep=False)
    assert fresh.of(landed, 5, slot=0) is not fresh.of(landed, 5, slot=0)
    with pytest.raises(ValueError, match="does not hold 4 tokens"):
        views.of(landed, 4, slot=0)


def test_kept_record_views_let_a_grown_landing_buffer_go():
    staging, views = DeviceStaging("cpu", slots=1), RecordViews(16, 2, torch.float32, keep=True)
    size = record_bytes(16, 2, torch.float32)
    small = staging.landing(3 * size, slot=0)
    views.of(small, 3, slot=0)
    old = weakref.ref(small.untyped_storage())
    del small
    big = staging.landing(4096 * size, slot=0)  # the slot's buffer grows: a new one
    views.of(big, 4096, slot=0)
    gc.collect()
    assert old() is None  # no kept view holds the old buffer


SLEEP_CYCLES = 100_000_000  # ~50 ms of GPU time: work still running when the host looks


@pytest.mark.gpu
def test_cuda_staging_copies_what_the_compute_stream_produced_without_waiting_for_it():
    staging = DeviceStaging("cuda", slots=2)
    x = torch.zeros(1000, device="cuda")
    torch.cuda._sleep(SLEEP_CYCLES)
    x.fill_(5.0)
    offsets = torch.arange(4, device="cuda")
    copy = staging.to_host([x, offsets], slot=0)
    assert not copy.landed()  # the host went on while the device works
    host_x, host_offsets = copy.wait()
    assert host_x.is_pinned() and torch.equal(host_x, torch.full((1000,), 5.0))
    assert host_offsets.tolist() == [0, 1, 2, 3]
    land = staging.landing(30, slot=1)  # where a round's payloads are gathered
    assert land.is_pinned()
    land.copy_(torch.arange(30, dtype=torch.uint8))
    on_device = staging.upload(land, slot=1)
    again = staging.landing(30, slot=1)  # waits for the upload to have read the buffer
    again.fill_(0)
    assert on_device.is_cuda and torch.equal(on_device.cpu(), torch.arange(30, dtype=torch.uint8))
    grown = staging.to_host([torch.ones(1 << 20, device="cuda")], slot=0).wait()[0]
    assert torch.equal(grown, torch.ones(1 << 20)) and staging.outbound[0].data.numel() >= 4 << 20


@pytest.mark.gpu
def test_cuda_staging_keeps_the_first_tensor_in_the_device_send_buffer_where_asked_and_it_fits(caplog):
    """The device send buffer a round leaves from where the adapter reads GPU memory (device
    slots across hosts): the records stay on the GPU, the offsets still come to the host, one
    event covers both; a message past the buffer goes through pinned memory, said once."""
    staging = DeviceStaging("cuda", slots=2, reserve=4096)
    registered = []
    made = staging.device_send_buffers(SimpleNamespace(register=registered.append))
    assert registered == made and len(made) == 2 and all(b.is_cuda and b.numel() == 4096 for b in made)
    assert staging.device_send_buffers(None) is made and len(staging.send_buffers()) == 2  # made once; not pinned
    records = torch.arange(1000, dtype=torch.float32, device="cuda")
    torch.cuda._sleep(SLEEP_CYCLES)
    offsets = torch.arange(4, device="cuda")
    copy = staging.to_host([records, offsets], slot=1, device_first=True)
    kept, host_offsets = copy.wait()
    assert kept.is_cuda and kept.data_ptr() == staging.device_outbound[1].data_ptr()
    assert torch.equal(kept, records) and host_offsets.is_pinned() and host_offsets.tolist() == [0, 1, 2, 3]
    big = torch.ones(2048, device="cuda")  # 8 KiB: past the 4 KiB buffer
    for _ in range(2):
        assert staging.to_host([big], slot=0, device_first=True).wait()[0].is_pinned()
    assert sum("outgrew the 4096-byte device send buffer" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.gpu
def test_compute_timer_measures_device_time_not_launches():
    timer = ComputeTimer("cuda")
    torch.cuda.synchronize()  # CUDA is initialised: the launch below is a launch only
    t0 = time.perf_counter()
    timer.start()
    torch.cuda._sleep(SLEEP_CYCLES)
    timer.stop()
    launched = time.perf_counter() - t0
    measured = timer.collect()
    assert measured > 10 * launched and measured > 0.005
    assert timer.collect() == 0.0


HOT_PATH_FILES = {Path(m.__file__).name for m in (pipelined_runner, expert_exchange, expert_worker, attention_exchange)}


def test_the_hot_path_reads_nothing_back_from_the_device(mixtral_ref, monkeypatch):
    """The runner and the expert worker read tensors to the host only where a staged copy landed
    (device_staging.HostCopy), never a compute tensor directly, except once per step: the
    expert counts, after sampling."""
    staged: dict[int, torch.Tensor] = {}  # host tensors the staging handed out, by id (held: ids stay unique)
    to_host = DeviceStaging.to_host

    dispatches = [0]

    def staged_to_host(self, tensors, slot, device_first=False):
        if Path(sys._getframe(1).f_code.co_filename).name == Path(expert_exchange.__file__).name:
            dispatches[0] += 1
        copy = to_host(self, tensors, slot, device_first)
        staged.update((id(t), t) for t in copy.parts)
        return copy

    direct: dict[str, int] = {}
    reads_of_staged = [0]
    host_copies: dict[int, torch.Tensor] = {}  # what a counted .cpu() returned: its .numpy() is no second read
    for method in ("tolist", "item", "cpu", "numpy"):
        original = getattr(torch.Tensor, method)

        def counted(tensor, *args, _original=original, _method=method, **kwargs):
            caller = sys._getframe(1).f_code
            if Path(caller.co_filename).name in HOT_PATH_FILES:
                if id(tensor) in staged:
                    reads_of_staged[0] += 1
                elif not (_method == "numpy" and id(tensor) in host_copies):
                    direct[caller.co_name] = direct.get(caller.co_name, 0) + 1
            result = _original(tensor, *args, **kwargs)
            if _method == "cpu":
                host_copies[id(result)] = result
            return result

        monkeypatch.setattr(torch.Tensor, method, counted)
    monkeypatch.setattr(DeviceStaging, "to_host", staged_to_host)
    steps = [0]
    run = PipelinedModelRunner._run

    def counted_run(self, out, hooks=None):
        steps[0] += 1
        return run(self, out, hooks)

    monkeypatch.setattr(PipelinedModelRunner, "_run", counted_run)
    prompts = mixtral_ref.prompts[:3]
    got, _ = run_local_deployment(mixtral_ref.path, 1, 2, 2, prompts)
    monkeypatch.undo()
    assert got == colocated(mixtral_ref.path, prompts)
    assert direct == {"_run": steps[0]}, direct  # the expert counts, once per step
    assert reads_of_staged[0] == dispatches[0] > 0  # each dispatch's node offsets, once landed


class SlowCopy:
    """Stands in for a CUDA copy and its event on the CPU: the host parts hold garbage until
    the copy lands, after `looks` queries or at synchronize(), as DMA into pinned memory would."""

    def __init__(self, sources: list[torch.Tensor], looks: int, log: list) -> None:
        self.sources = [t.clone() for t in sources]  # what the compute stream had produced
        self.parts = [torch.full_like(t, -1) if t.dtype != torch.uint8 else torch.full_like(t, 0xAB)
                      for t in sources]
        self.looks, self.log = looks, log

    def query(self) -> bool:
        self.looks -= 1
        if self.looks <= 0:
            self._land()
        return self.looks <= 0

    def synchronize(self) -> None:
        if self.looks > 0:
            self.log.append("waited for a copy in flight")
        self.looks = 0
        self._land()

    def _land(self) -> None:
        for part, source in zip(self.parts, self.sources):
            part.copy_(source)


@pytest.mark.parametrize("looks", [1, 4, 1000])
def test_dispatches_and_answers_wait_for_their_copies_and_keep_their_order(mixtral_ref, monkeypatch, looks):
    """The control flow of the CUDA path on the CPU: each dispatch's and each answer's copy
    lands only after `looks` queries (1000: never before it is due), so dispatches and answers
    leave from their outboxes while the next messages are awaited, or are forced out when
    nothing else can come. A message sent before its copy landed would carry garbage; the
    tokens equal the colocated engine's."""
    log: list[str] = []
    callers = set()

    def slow_to_host(self, tensors, slot, device_first=False):
        callers.add(Path(sys._getframe(1).f_code.co_filename).name)
        copy = SlowCopy(list(tensors), looks, log)
        return HostCopy(copy.parts, copy)

    monkeypatch.setattr(DeviceStaging, "to_host", slow_to_host)
    prompts = mixtral_ref.prompts[:3]
    got, _ = run_local_deployment(mixtral_ref.path, 2, 2, 2, prompts)
    monkeypatch.undo()
    assert got == colocated(mixtral_ref.path, prompts)
    assert bool(log) == (looks > 1)  # a message was forced out only when copies were slow
    assert callers == {Path(expert_exchange.__file__).name, Path(attention_exchange.__file__).name}


def test_step_sync_carries_the_layered_cohort_to_follower_ranks():
    """A tensor-parallel node's followers rebuild the leader's step, layered pass included,
    and name each cohort member the same way step after step."""
    from megainfer.disagg import step_sync
    from megainfer.scheduling.scheduler_output import LayeredPass, SchedulerOutput
    from megainfer.scheduling.sequence import Sequence
    from megainfer.scheduling.step_layout import StepLayout

    dec = Sequence("d", [1, 2, 3], GREEDY, token_ids=[1, 2, 3, 9], num_computed_tokens=3, block_table=[4])
    a = Sequence("a", list(range(10, 30)), GREEDY, num_computed_tokens=8, block_table=[5, 6, 7])
    b = Sequence("b", [7] * 5, GREEDY, block_table=[8])
    out = SchedulerOutput(seqs=[dec], num_scheduled_tokens=[1], num_single_token=1,
                          layered=LayeredPass([b, a], [5, 12], (1, 3), 1, 2))
    got = step_sync.decode(step_sync.encode(out))
    assert got.num_scheduled_tokens == [1] and got.num_single_token == 1
    assert got.seqs[0].token_ids[3:] == [9] and got.seqs[0].block_table == [4]
    lp = got.layered
    assert (lp.layers, lp.group, lp.num_groups, lp.num_tokens, lp.last) == ((1, 3), 1, 2, [5, 12], True)
    assert [v.block_table for v in lp.seqs] == [[8], [5, 6, 7]]
    assert lp.seqs[1].token_ids[8:20] == list(range(18, 30)) and lp.seqs[1].num_computed_tokens == 8
    again = step_sync.decode(step_sync.encode(out))
    assert [v.request_id for v in again.layered.seqs] == [v.request_id for v in lp.seqs]
    assert len({v.request_id for v in lp.seqs}) == 2
    assert step_sync.decode(step_sync.encode(SchedulerOutput())).layered is None
    for m in (1, 2, 3):  # every rank lays the step out alike, down to the rows that sample
        assert StepLayout.of(got, m) == StepLayout.of(out, m)


def test_each_nodes_tokens_come_in_token_order_whatever_order_gating_wrote():
    """Tensor-parallel ranks split each node's segment by position; their gating kernels may
    fill a segment in any order, so the runner sorts each segment by token."""
    from megainfer.disagg.attention_dispatch import tokens_in_node_order

    offsets = torch.tensor([0, 3, 3, 5], dtype=torch.int32)  # node 1 gets nothing; 2 spare entries
    written = torch.tensor([4, 0, 2, 3, 1, 7, 7], dtype=torch.int32)  # as one run's atomics left it
    again = torch.tensor([2, 4, 0, 1, 3, 0, 0], dtype=torch.int32)  # another run (or rank)
    assert tokens_in_node_order(written, offsets, 8).tolist()[:5] == [0, 2, 4, 1, 3]
    assert tokens_in_node_order(again, offsets, 8).tolist()[:5] == [0, 2, 4, 1, 3]


def test_the_runtime_names_the_header_columns_where_the_transport_lays_them_out():
    """megainfer/disagg reads the arrivals' header columns under its own names (it imports no
    transport); the binding (deploy/link.py) refuses to load where they disagree."""
    import numpy as np

    from deploy import link
    from megainfer.disagg import expert_link
    from transport import rounds

    for column in link.HEADER_COLUMNS:
        assert getattr(expert_link, column) == getattr(rounds, column), column
    for got, want in zip(expert_link.row_ranges([3, 0, 5], 12), rounds.row_ranges([3, 0, 5], 12)):
        assert np.array_equal(got, want)


def test_dbrx_deployment_matches_colocated_with_and_without_replicas(dbrx_ref):
    """DBRX cut into halves (fused Wqkv on the attention side, slices of the fused w1/v1/w2 on
    each expert node): 2 x 2, two micro-batches, the colocated engine's tokens; also with hot
    experts held twice."""
    prompts = dbrx_ref.prompts
    expected = colocated(dbrx_ref.path, prompts)
    assert expected == [t[:GREEDY.max_tokens] for t in dbrx_ref.tokens]  # transformers' greedy tokens
    assert run_local_deployment(dbrx_ref.path, 2, 2, 2, prompts)[0] == expected
    assert run_local_deployment(dbrx_ref.path, 2, 2, 2, prompts, replicas=_replicated(dbrx_ref.path))[0] == expected


@pytest.mark.parametrize("async_scheduling", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_gpt_oss_deployment_matches_colocated(gpt_oss_ref, async_scheduling):
    """gpt-oss cut into halves, 1 attention node x 2 expert nodes, two micro-batches: sinks and
    windows (their blocks released as sequences pass them, also with steps scheduled ahead) on
    the attention side, biased clamped experts on the expert nodes; transformers' tokens."""
    prompts = gpt_oss_ref.prompts
    expected = colocated(gpt_oss_ref.path, prompts)
    assert expected == [t[:GREEDY.max_tokens] for t in gpt_oss_ref.tokens]
    got, stats = run_local_deployment(gpt_oss_ref.path, 1, 2, 2, prompts, async_scheduling=async_scheduling)
    assert got == expected
    assert stats[0].kv_cache_usage == 0.0


def test_deepseek_deployment_matches_colocated(deepseek_ref):
    """DeepSeek cut into halves, 1 attention node x 2 expert nodes, two micro-batches: MLA, the
    shared experts and the dense first layers on the attention side (no round for a dense
    layer), the routed experts of the MoE layers on the expert nodes; transformers' tokens."""
    prompts = deepseek_ref.prompts
    expected = colocated(deepseek_ref.path, prompts)
    assert expected == [t[:GREEDY.max_tokens] for t in deepseek_ref.tokens]
    got, stats = run_local_deployment(deepseek_ref.path, 1, 2, 2, prompts)
    assert got == expected
    assert stats[0].kv_cache_usage == 0.0
