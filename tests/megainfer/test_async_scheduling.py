"""Asynchronous scheduling through the engine (`EngineConfig.async_scheduling`, a runner that
takes `StepHooks`): requests aborted while their step is scheduled ahead, failures with a step
pending, and the idle end. The runner is the step-boundary bench's (`BoundaryRunner`: the real
layout, inputs and sampling, the layers skipped), which calls the hooks where the attention
node's runner does."""

from __future__ import annotations

import zlib

import pytest
import torch

from megainfer.engine.engine import Engine
from megainfer.engine.queued_engine import QueuedEngine
from megainfer.engine_config import EngineConfig
from megainfer.messages import FinishReason
from megainfer.model_resolution import DEMO_MODEL, resolve_model
from megainfer.runner.model_runner import StepResult
from megainfer.sampling_params import SamplingParams
from megainfer.scheduling.step_layout import StepLayout
from megainfer.scheduling.token_recorder import PLACEHOLDER
from megainfer.tools.step_boundary import BoundaryRunner


class SequenceTokens(BoundaryRunner):
    """The bench's runner with a model stand-in that answers each sequence by its own tokens
    (a function of the request and how many tokens it has), as a model answers by its inputs:
    not by the row it sits in, which scheduling ahead may shift."""

    def execute(self, out, hooks=None):
        self._seqs = out.all_seqs
        return super().execute(out, hooks)

    placed_as_sampled = 0  # tokens the engine took micro-batch by micro-batch, over the run

    def _token(self, i: int) -> int:
        seq = self._seqs[i]
        known = len(seq.token_ids) - (seq.token_ids[-1] == PLACEHOLDER)
        return 3 + zlib.crc32(f"{seq.request_id}/{known}".encode()) % 2000  # the same in every process

    def _sample_whole(self, layout, states, seqs) -> StepResult:
        return StepResult(layout.place_samples([self._token(i) for i in layout.sampled_sequences]), [])

    def _sample_by_micro_batch(self, layout: StepLayout, hooks) -> tuple[StepResult, float]:
        """As the runner: each micro-batch's tokens placed for the step ahead as they are made."""
        self._last_answer = 0.0
        tokens = []
        for batch in layout.micro_batches:
            sampled = [self._token(i) for i in batch.decode_sequences]
            tokens += sampled
            before = hooks.placed
            self.inputs_ahead.sampled(sampled, batch.decode_sequences, hooks, self.model)
            self.placed_as_sampled += hooks.placed - before
        return StepResult(layout.place_samples(tokens), []), 0.0


def make_core(async_scheduling: bool) -> QueuedEngine:
    plan_model, _ = resolve_model(DEMO_MODEL)  # the expert counts at the engine's own shape
    config = EngineConfig(max_num_seqs=16, max_num_batched_tokens=256, num_kv_blocks=128, block_size=8,
                          max_model_len=512, async_scheduling=async_scheduling)

    def runner(mc, cfg, weights, max_len):
        return SequenceTokens(mc, cfg, weights, max_len, micro_batches=2, num_blocks=128, plan_model=plan_model,
                              t_e_s=0.0)

    return QueuedEngine(Engine(DEMO_MODEL, config, runner_factory=runner))


def serve(core: QueuedEngine, requests: dict, abort_at: dict[str, int] | None = None) -> dict:
    """Each request's deltas (emitted mid-step or returned), aborting `abort_at[rid]` at that step."""
    got = {rid: [] for rid in requests}
    for rid, (prompt, params) in requests.items():
        core.add_request(rid, prompt, params)

    def take(columns):
        for d in columns.deltas:
            got[d.request_id].append(d)

    for step in range(200):
        if not core.has_work():
            break
        for rid, when in (abort_at or {}).items():
            if when == step:
                core.abort(rid)
        take(core.step_columns(emit=take))
    assert not core.has_work()
    return got


def requests_of(n: int = 6) -> dict:
    g = torch.Generator().manual_seed(0)
    # Greedy: every decode step samples micro-batch by micro-batch (the stand-in above).
    kinds = [SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True),
             SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True),
             SamplingParams(max_tokens=11, temperature=0.0, stop=["e", "t"], ignore_eos=True)]
    return {f"r{i}": (torch.randint(3, 2000, (20 + 3 * i,), generator=g).tolist(), kinds[i % 3]) for i in range(n)}


@pytest.mark.parametrize("piece", [512, 2])
def test_scheduling_ahead_streams_what_scheduling_after_does(piece, monkeypatch):
    """The same tokens and text, with the decode steps' tokens placed micro-batch by micro-batch
    as they are sampled (the step ahead reading them before the step's last micro-batch), and
    the step before settled in pieces of `piece` sequences (`Engine.SETTLE_PIECE`)."""
    monkeypatch.setattr("megainfer.engine.engine.SETTLE_PIECE", piece)
    sync = serve(make_core(False), requests_of())
    core = make_core(True)
    ahead = serve(core, requests_of())
    assert core.engine.runner.placed_as_sampled > 0
    for rid in sync:
        assert [d.new_token_ids for d in ahead[rid]] == [d.new_token_ids for d in sync[rid]], rid
        assert "".join(d.new_text for d in ahead[rid]) == "".join(d.new_text for d in sync[rid]), rid
        assert ahead[rid][-1].finish_reason == sync[rid][-1].finish_reason


@pytest.mark.parametrize("when", [1, 2, 4])
def test_a_request_aborted_while_its_next_step_is_scheduled_leaves_it_and_its_blocks(when):
    core = make_core(True)
    requests = requests_of()
    got = serve(core, requests, abort_at={"r0": when, "r4": when + 1})
    expected = serve(make_core(False), {rid: r for rid, r in requests.items() if rid not in ("r0", "r4")})
    for rid, deltas in expected.items():
        assert [d.new_token_ids for d in got[rid]] == [d.new_token_ids for d in deltas], rid
    assert not any(d.finished for d in got["r0"] + got["r4"])  # the frontend ends an aborted stream itself
    engine = core.engine
    assert engine.scheduler.block_manager.num_free_blocks == engine.scheduler.block_manager.num_blocks
    assert engine._ahead is None and engine._pending is None


def test_failing_every_request_settles_the_pending_step_first():
    core = make_core(True)
    for rid, (prompt, params) in requests_of(3).items():
        core.add_request(rid, prompt, params)
    emitted = []
    for _ in range(4):  # prompts, then decode steps scheduled ahead
        emitted += core.step_columns(emit=lambda c: emitted.extend(c.deltas)).deltas
    assert core.engine._pending is not None
    last = core.fail_all("the node lost its data plane")
    pending_tokens = [d for d in last if not d.finished]
    failures = [d for d in last if d.finished]
    assert pending_tokens and all(d.new_token_ids for d in pending_tokens)
    assert {d.request_id for d in failures} == {"r0", "r1", "r2"} - {d.request_id for d in emitted if d.finished}
    assert all(d.finish_reason is FinishReason.ERROR for d in failures)
    assert last.index(pending_tokens[-1]) < last.index(failures[0])
    blocks = core.engine.scheduler.block_manager
    assert blocks.num_free_blocks == blocks.num_blocks


def test_steps_scheduled_ahead_are_timed_once_each_for_the_router():
    """Each step's measured time runs from the step before's end to its own (what the router's
    step model learns from): scheduled ahead, the steps' times add up to the wall time, not to
    twice it."""
    import time

    core = make_core(True)
    started = time.perf_counter()
    serve(core, requests_of())
    elapsed = time.perf_counter() - started
    steps = core.engine.node_state().steps
    assert len(steps) >= 8
    assert sum(s.seconds for s in steps) <= elapsed
    assert all(s.seconds > 0 for s in steps)


def test_micro_batch_0_ahead_is_completed_once_every_row_has_its_token():
    """`InputsAhead.sampled`: each micro-batch's tokens placed as sampled; the kept micro-batch 0
    of the step ahead read and embedded at the first micro-batch after which none of its rows
    holds a placeholder, and `take` then hands that state over as it is."""
    from types import SimpleNamespace

    from megainfer.runner.inputs_ahead import InputsAhead, KeptInputs
    from megainfer.runner.step_hooks import StepHooks

    seqs = [SimpleNamespace(token_ids=[4, 5, PLACEHOLDER]) for _ in range(3)]  # the step's, as advanced ahead

    def place(rows, tokens):
        for i, token in zip(rows, tokens):
            seqs[i].token_ids[-1] = token
        return True

    embedded = []
    model = SimpleNamespace(embed=lambda ids: embedded.append(ids.tolist()) or ids.float())
    ahead, out = InputsAhead(), object()
    paged = SimpleNamespace(seq_lens_host=[3, 3])
    # The step ahead's micro-batch 0 holds sequences 2 and 0 of the step before.
    ahead._kept = KeptInputs(out, "batch 0", (None, torch.tensor([2, 2]), paged), [seqs[2], seqs[0]])
    hooks = StepHooks(place=place)
    assert ahead.sampled([7], [0], hooks, model) == [7] and not embedded  # sequence 2 still unsampled
    ahead.sampled([8], [1], hooks, model)
    assert not embedded
    ahead.sampled([9], [2], hooks, model)
    assert embedded == [[9, 7]] and hooks.placed == 3
    state = ahead.take(model, out, None, torch.device("cpu"))
    assert state.layout == "batch 0" and state.decode_inputs[0].tolist() == [9, 7] and embedded == [[9, 7]]
    assert ahead.take(model, out, None, torch.device("cpu")) is None  # taken once


def test_the_work_beside_the_layers_comes_one_piece_a_call():
    """`StepHooks.run_piece`: the settle's pieces one by one, then the look-ahead's; True from the
    call that finishes, and from no other; `everything` runs all that is left; what the engine
    finishes after a runner is the settle and a look-ahead already begun, not one never begun."""
    from megainfer.runner.step_hooks import StepHooks

    done = []

    def settle():
        for k in range(3):
            if k:
                yield True
            done.append(f"settle {k}")

    def lookahead():
        done.append("advance")
        yield True
        done.append("schedule")
        return "next step"

    hooks = StepHooks(lookahead, settle)
    assert [hooks.run_piece() for _ in range(6)] == [False, False, False, False, True, False]
    assert done == ["settle 0", "settle 1", "settle 2", "advance", "schedule"] and hooks.ahead == "next step"
    done.clear()
    hooks = StepHooks(lookahead, settle)
    assert hooks.run_piece() is False and hooks.run_piece(everything=True) is True
    assert done == ["settle 0", "settle 1", "settle 2", "advance", "schedule"]
    assert StepHooks().run_piece() is True and StepHooks().run_lookahead() is None  # nothing to do
    done.clear()
    hooks = StepHooks(lookahead, settle)
    hooks.run_piece()
    hooks.finish_begun()  # the settle finished; the look-ahead never began, so it is not begun now
    assert done == ["settle 0", "settle 1", "settle 2"] and hooks.ahead is None
    done.clear()
    hooks = StepHooks(lookahead, settle)
    for _ in range(4):
        hooks.run_piece()
    hooks.finish_begun()  # the look-ahead began: its sequences advanced, so the step is scheduled too
    assert done == ["settle 0", "settle 1", "settle 2", "advance", "schedule"] and hooks.ahead == "next step"
