"""The disaggregated runtime without Ray: attention engines and expert workers in threads,
connected by real M2N endpoints, produce exactly the colocated engine's greedy tokens."""

from __future__ import annotations

import threading

import pytest
import torch

from deploy.link import SwitchableLink
from megainfer import Engine, SamplingParams
from megainfer.config import EngineConfig
from megainfer.disagg.expert_link import dispatch_bytes, pack_dispatch, unpack_dispatch
from megainfer.disagg.expert_worker import ExpertWorker
from megainfer.disagg.pipelined_runner import PipelinedModelRunner
from megainfer.model.weights import SafetensorsCheckpoint
from megainfer.step_layout import split_micro_batches
from tests.helpers import connect_all

SECRET = b"d" * 32
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


def run_local_deployment(path, n_attention, n_expert, m, prompts, backend="shm", **engine_options):
    """Wire a deployment in threads; return each prompt's greedy tokens."""
    engine_config = EngineConfig(num_kv_blocks=64, block_size=8, max_num_batched_tokens=64, **engine_options)
    probe = Engine(str(path), engine_config)
    model_config = probe.model_config
    per = model_config.num_experts // n_expert
    assignment = [list(range(k * per, (k + 1) * per)) for k in range(n_expert)]
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
    workers = [ExpertWorker(model_config, assignment[k], "float32", "cpu", SafetensorsCheckpoint(path),
                            attention_nodes=attn_names, micro_batches=m, link=links[name])
               for k, name in enumerate(expert_names)]
    engines = []
    for name in attn_names:
        def factory(mc, cfg, weights, max_len, name=name):
            return PipelinedModelRunner(mc, cfg, weights, max_len, link=links[name],
                                        expert_nodes=expert_names, expert_assignment=assignment, micro_batches=m)
        engines.append(Engine(str(path), engine_config, runner_factory=factory))
    # Spread prompts over attention nodes round robin; every node steps until all are done.
    for i, p in enumerate(prompts):
        engines[i % n_attention].add_request(f"r{i}", p, GREEDY)
    results = {f"r{i}": [] for i in range(len(prompts))}
    done = threading.Event()
    errors = []
    steps = max(len(prompts) * 40, 200)

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


def colocated(path, prompts):
    llm_engine = Engine(str(path), EngineConfig(num_kv_blocks=64, block_size=8, max_num_batched_tokens=64))
    for i, p in enumerate(prompts):
        llm_engine.add_request(f"r{i}", p, GREEDY)
    out = {f"r{i}": [] for i in range(len(prompts))}
    while llm_engine.has_unfinished_requests():
        for d in llm_engine.step():
            out[d.request_id].extend(d.new_token_ids)
    return [out[f"r{i}"] for i in range(len(prompts))]


@pytest.mark.parametrize("m", [1, 2, 3])
def test_two_by_two_deployment_matches_colocated(hf_ref, m):
    prompts = hf_ref.prompts
    expected = colocated(hf_ref.path, prompts)
    got, stats = run_local_deployment(hf_ref.path, 2, 2, m, prompts)
    assert got == expected
    assert all(s.kv_cache_usage == 0.0 for s in stats)


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


def test_step_sync_carries_the_layered_cohort_to_follower_ranks():
    """A tensor-parallel node's followers rebuild the leader's step, layered pass included,
    and name each cohort member the same way step after step."""
    from megainfer.disagg import step_sync
    from megainfer.scheduler import LayeredPass, SchedulerOutput
    from megainfer.sequence import Sequence
    from megainfer.step_layout import StepLayout

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
