"""The attention rank's step boundary at a plan's scale, for `megainfer bench host`.

Between two steps an attention rank schedules, prepares every micro-batch's inputs, samples,
updates its sequences, detokenizes and packs the deltas for the serving process; none of it is
device work, and in a synchronous step it all adds to the step the expert nodes wait through.
This runs that host code for real (`Engine.step`: the scheduler, `StepLayout` with the plan's
micro-batches, `MicroBatchState.prepare`, the sampler's host side, `update_from_output`,
detokenization with the demo model's tokenizer, the delta batch the node hands the driver)
with `n` running decode sequences at the plan's context length, the layers skipped
(`BoundaryRunner`). Its device work shrinks to nothing: logits come from a fixed tensor of the
demo vocabulary's width, the embeddings from the demo model (256 wide), no KV cache is
allocated. Expert counts have the plan's model's shape, as the engine's bookkeeping reads them.

CPU time is `time.process_time`: every thread of this process. Phases are timed around the
engine's own calls (`BoundaryPhases`). The deltas' hand-over is timed as far as it is our code:
the engine's columns (`Engine.step_columns`) wrapped as the outbox's poll answer and, on the
driver, the frontend's ownership check and the fan-out to every request's stream and its reader's
wake (`foreign_places`, `StreamRegistry.deliver_batch`, a `FanIn` per stream as the gRPC service
reads them); the byte copy of the columns by Ray's serializer (C code, about 0.3 ms per 1,884
deltas on this machine) is not in it, since no module here may import a pickler or Ray.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from megainfer.config import KV_BLOCK_TOKENS, ModelConfig
from megainfer.engine.engine import Engine
from megainfer.engine.queued_engine import QueuedEngine
from megainfer.engine.expert_load_window import ExpertLoadWindow
from megainfer.engine_config import EngineConfig
from megainfer.model.moe_model import MoEModel
from megainfer.model_resolution import DEMO_MODEL, resolve_model
from megainfer.runner.model_runner import (CohortHiddenStates, MicroBatchState, StepResult, sample_rows,
                                    samples_by_micro_batch)
from megainfer.runner.inputs_ahead import InputsAhead
from megainfer.runner.sampler import Sampler
from megainfer.runner.step_hooks import StepHooks
from megainfer.sampling_params import SamplingParams
from megainfer.scheduling.block_table_rows import BlockTableRows
from megainfer.scheduling.step_layout import LayoutAhead, StepLayout


BLOCK_SIZE = KV_BLOCK_TOKENS  # the engine's default KV block


@dataclass
class BoundaryPhases:
    """CPU seconds per phase, summed over the measured steps."""

    prepare: float = 0.0  # StepLayout and every micro-batch's inputs
    sample: float = 0.0  # the sampler's host side, its argmax stand-in taken out; tokens placed as sampled (async)
    argmax: float = 0.0  # the argmax over the logits (demo vocabulary, 2,048 wide): device work on a GPU
    beside: float = 0.0  # run beside the layers: the step before settled, the next one scheduled (async)
    bookkeeping: float = 0.0  # the rest of the step: schedule and update (synchronous), deltas, checks
    deltas_out: float = 0.0  # the outbox's answer to the driver's poll
    wait: float = 0.0  # what the expert nodes wait through before this step (`BoundaryRunner`)
    pieces: list[float] = field(default_factory=list)  # the pieces of `beside`, one after each layer on a GPU
    steps: int = 0
    extra: dict = field(default_factory=dict)

    def per_step_ms(self) -> dict[str, float]:
        n = max(self.steps, 1)
        return {"prepare": self.prepare / n * 1e3, "sample": self.sample / n * 1e3, "beside": self.beside / n * 1e3,
                "bookkeeping": self.bookkeeping / n * 1e3, "deltas_out": self.deltas_out / n * 1e3}

    def pieces_ms(self) -> list[float]:
        return [s * 1e3 for s in self.pieces]

    def argmax_ms(self) -> float:
        return self.argmax / max(self.steps, 1) * 1e3

    def wait_ms(self) -> float:
        return self.wait / max(self.steps, 1) * 1e3


class BoundaryRunner:
    """`PipelinedModelRunner._run` without the layers: the same layout, inputs, cohort keeping,
    hooks (`StepHooks`: the step before settled once every micro-batch's inputs are built, the
    next one scheduled where the last layer would run) and sampling (micro-batch by micro-batch
    where `samples_by_micro_batch`), timed per phase; no KV cache, no link.

    The expert nodes' wait before a step is measured from where the step before had its last
    answer (before sampling its last micro-batch) to where this step's micro-batch 0 has its
    inputs (its dispatch follows its layer-0 attention, device work), the argmax's share taken
    out; plus what the step before's sampling of its other micro-batches took beyond the
    m x t_e the expert nodes spend answering its last layer."""

    steps_when_idle = False
    takes_step_hooks = True
    deployment_busy = False
    step_id = -1

    def __init__(self, model_config: ModelConfig, config: EngineConfig, weights, max_model_len: int, *,
                 micro_batches: int, num_blocks: int, plan_model: ModelConfig, t_e_s: float) -> None:
        self.model_config, self.config = model_config, config
        self.device = torch.device("cpu")
        self.m = micro_batches
        self.model = MoEModel(model_config, torch.float32, self.device, max_model_len, with_experts=False)
        self.model.load_weights(weights)
        self.num_blocks = num_blocks
        self.kernels = None
        self.sampler = Sampler(config.seed, self.device, model_config.eos_token_ids)
        self.cohort_hidden = CohortHiddenStates()
        self.block_tables = BlockTableRows(config.max_num_seqs, -(-max_model_len // config.block_size),
                                           windowed=bool(model_config.kv_window))
        self.layouts = LayoutAhead()
        self.inputs_ahead = InputsAhead()
        self.phases = BoundaryPhases()
        self.t_e_s = t_e_s
        self._logits = torch.randn(config.max_num_seqs, model_config.vocab_size,
                                   generator=torch.Generator().manual_seed(0))
        self._counts = np.zeros((plan_model.num_layers, plan_model.num_experts), dtype=np.int64)
        self._last_answer: float | None = None  # process time of the step before's last answer
        self._wait_after = 0.0  # what of the step before's last layer and sampling the experts wait for

    @torch.inference_mode()
    def execute(self, out, hooks: StepHooks | None = None) -> StepResult:
        hooks = hooks or StepHooks()
        t0 = time.process_time()
        layout = self.layouts.of(out, self.m)
        seqs = out.all_seqs
        self.cohort_hidden.forget_departed(seqs, layout)
        self.block_tables.retain(seqs)
        states = []
        for batch in layout.micro_batches:  # in the runner's order; 1.. after micro-batch 0's dispatch
            ahead = not states and self.inputs_ahead.take(self.model, out, layout, self.device)
            states.append(ahead or MicroBatchState.prepare(self.model, seqs, layout, batch, self.cohort_hidden,
                                                           self.config.block_size, self.device, self.block_tables))
            if len(states) == 1 and self._last_answer is not None:
                self.phases.wait += time.process_time() - self._last_answer + self._wait_after
        t1 = time.process_time()
        # As the runner, a piece after each layer's dispatches (here one after another, each timed:
        # what it holds the runner's thread): the step before settled, the next scheduled and laid out.
        done = False
        while not done:
            start = time.process_time()
            done = hooks.run_piece()
            if done:
                self.layouts.keep(hooks.ahead, self.m)
            self.phases.pieces.append(time.process_time() - start)
        t2 = time.process_time()
        for state in states:
            self.cohort_hidden.keep(seqs, layout, state)
        # As the runner once the last layer's dispatches are sent: the next step's micro-batch 0
        # prepared but for its tokens, while the expert nodes answer.
        self.inputs_ahead.prepare(self.layouts.peek(), self.config.block_size, self.device, self.block_tables)
        t3 = time.process_time()
        # The sampler's argmax, timed alone just before it runs, so both read the logits from the
        # same cache (18 MB at 2,290 rows: a cold read costs the argmax half as much again).
        self._logits[:len(layout.sampled_sequences)].argmax(dim=-1)
        t4 = time.process_time()
        argmax = t4 - t3
        if samples_by_micro_batch(seqs, layout):
            result, before_last = self._sample_by_micro_batch(layout, hooks)
        else:
            self._last_answer, before_last = time.process_time(), 0.0
            result = self._sample_whole(layout, states, seqs)
        result.expert_counts = self._counts
        t5 = time.process_time()
        # The argmax is device work: the last micro-batch's share out of the wait, the others'
        # out of what the last layer's host work takes beyond the expert nodes' answering it.
        last = len(layout.micro_batches[-1].decode_sequences) / max(len(layout.sampled_sequences), 1)
        host_before_last = max(0.0, before_last - argmax * (1 - last))
        self._wait_after = max(0.0, host_before_last - self.m * self.t_e_s) - argmax * last
        self.phases.prepare += (t1 - t0) + (t3 - t2)
        self.phases.beside += t2 - t1
        # The stand-in argmax reads every row at once and the sampler's per micro-batch, so the
        # sampler's can run faster than its stand-in: its host side is then below what this can
        # tell apart from zero, and counted as zero rather than below it.
        self.phases.sample += max(0.0, (t5 - t4) - argmax)
        self.phases.argmax += argmax
        return result

    def _sample_whole(self, layout: StepLayout, states: list[MicroBatchState], seqs: list) -> StepResult:
        """As the runner's `sample_step`: every sampled row at once, after the last answers."""
        return sample_rows(lambda hidden: self._logits[:hidden.shape[0]],
                           lambda j, in_cohort: states[j].cohort if in_cohort else states[j].hidden,
                           self.sampler, seqs, layout)

    def _sample_by_micro_batch(self, layout: StepLayout, hooks: StepHooks) -> tuple[StepResult, float]:
        """As the runner: each micro-batch's greedy rows as its last answers arrive, its tokens
        placed for the step ahead and that step's micro-batch 0 completed once they are all
        there. Returns the result and the host time spent before the last micro-batch's answers."""
        tokens, row = [], 0
        start = time.process_time()
        before_last = 0.0
        for j, batch in enumerate(layout.micro_batches):
            if j == len(layout.micro_batches) - 1:
                self._last_answer = time.process_time()
                before_last = self._last_answer - start
            rows = len(batch.decode_sequences)
            if rows:
                sampled = self.sampler.greedy(self._logits[row:row + rows])
                tokens.extend(self.inputs_ahead.sampled(sampled, batch.decode_sequences, hooks, self.model))
                row += rows
        return StepResult(layout.place_samples(tokens), []), before_last


def boundary_engine(running: int, context: int, micro_batches: int, plan_model: ModelConfig,
                    async_scheduling: bool = True, t_e_s: float = 0.0, prefix_caching: bool = True) -> QueuedEngine:
    """A demo-model engine on a `BoundaryRunner`, in the `QueuedEngine` an attention node steps,
    with `running` sequences decoding at `context` tokens each on average (their prompts
    prefilled in a few large steps); scheduling as the plan's attention nodes do
    (`async_scheduling`), the expert nodes taking `t_e_s` per (layer, micro-batch)."""
    model, _ = resolve_model(DEMO_MODEL)
    block_size = BLOCK_SIZE
    blocks = running * (-(-(context + 64) // block_size)) + 16
    # A token budget that prefills every prompt in a few steps (the decode steps ignore it).
    config = EngineConfig(max_num_seqs=running, max_num_batched_tokens=max(8192, running * context // 4),
                          block_size=block_size, async_scheduling=async_scheduling,
                          num_kv_blocks=blocks, max_model_len=min(model.max_position_embeddings, context + 1024),
                          enable_prefix_caching=prefix_caching)

    def runner(mc, cfg, weights, max_len):
        return BoundaryRunner(mc, cfg, weights, max_len, micro_batches=micro_batches, num_blocks=blocks,
                              plan_model=plan_model, t_e_s=t_e_s)

    core = QueuedEngine(Engine(DEMO_MODEL, config, runner_factory=runner))
    engine = core.engine
    # The engine's per-expert totals and window at the plan's model's shape (what its bookkeeping walks).
    engine.step_records.expert_tokens = np.zeros((plan_model.num_layers, plan_model.num_experts), dtype=np.int64)
    engine.step_records.expert_window = ExpertLoadWindow(plan_model.num_layers, plan_model.num_experts,
                                                         config.expert_load_window)
    g = torch.Generator().manual_seed(1)
    params = SamplingParams(max_tokens=1 << 20, temperature=0.0, ignore_eos=True)
    for i, length in enumerate(context_lengths(running, context, block_size)):
        core.add_request(f"r{i}", torch.randint(3, model.vocab_size, (length,), generator=g).tolist(), params)
    core.drain()
    while engine.scheduler.num_waiting or any(s.num_output_tokens == 0 for s in engine.scheduler.running):
        core.step_columns()
    return core


def context_lengths(running: int, context: int, block_size: int) -> list[int]:
    """`running` contexts spread evenly over one block around `context`, as running sequences'
    lengths are spread in steady serving: each decode step, one `block_size`-th of them fills its
    last block and takes a new one (and names the full one for prefix caching). At one length
    they would all do so in the same step, and a prefill in a few large steps leaves them in a
    few groups that do so in consecutive steps: at 2,290 sequences, four steps of sixteen at 3
    ms each above the rest, which the median of seven measured steps then reads as every step."""
    return [context - block_size // 2 + i % block_size for i in range(running)]


def measure_boundary(running: int, context: int, micro_batches: int, plan_model: ModelConfig,
                     steps: int = 7, async_scheduling: bool = True, t_e_s: float = 0.0,
                     prefix_caching: bool = True) -> BoundaryPhases:
    """CPU time of the whole boundary at `running` sequences, by phase: the median decode step
    of `steps` (by total; the machines are shared, and one step's share of a neighbour's burst
    is noise, not cost)."""
    core = boundary_engine(running, context, micro_batches, plan_model, async_scheduling, t_e_s, prefix_caching)
    measured = []
    # One torch thread: the argmax stand-in (device work on a GPU) otherwise spreads over the
    # cores and its share of a step swings with the neighbours; the host code is one thread anyway.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(steps):
            measured.append(_measure_step(core, running))
    finally:
        torch.set_num_threads(threads)
    waits = sorted(ph.wait for ph in measured)
    measured.sort(key=lambda ph: sum(ph.per_step_ms().values()))
    median = measured[len(measured) // 2]
    # The wait's own median: one step's wait may hold a garbage collection the median step's
    # total does not show.
    median.wait = waits[len(waits) // 2]
    return median


def _measure_step(core: QueuedEngine, running: int) -> BoundaryPhases:
    """One decode step, by phase."""
    from megainfer.messages import DeltaBatch

    phases = core.engine.runner.phases = BoundaryPhases()
    emitted = []
    t0 = time.process_time()
    # What the node's step loop runs; the deltas come out in columns, those of a step settled
    # inside this one as they are made (to the outbox: here, a list).
    deltas = core.step_columns(emit=emitted.append)
    t1 = time.process_time()
    for columns in [*emitted, deltas]:
        DeltaBatch("node", len(columns), columns)  # the outbox's answer to the driver's poll
    t2 = time.process_time()
    # The argmax ran twice (timed apart, then in the sampler).
    phases.bookkeeping = (t1 - t0) - phases.prepare - phases.sample - phases.beside - 2 * phases.argmax
    phases.deltas_out = t2 - t1
    phases.steps = 1
    made = len(deltas) + sum(map(len, emitted))
    if made != running:
        raise RuntimeError(f"a decode step of {running} sequences gave {made} deltas")
    return phases


def measure_driver(deltas: list, attention_nodes: int, repeats: int = 5) -> float:
    """CPU ms per step of the serving process's delta handling for `attention_nodes` nodes, each
    handing over `deltas` (one step's) as its poll answer: the frontend's check that each request
    is held where its delta came from, then every delta to its request's stream and that stream's
    reader woken (`Frontend._deliver_batch`'s path). The readers' own work (popping, writing the
    response) is theirs, per request, and not in it."""
    import dataclasses

    from megainfer.messages import DeltaColumns
    from megainfer.server.backend import StreamRegistry, foreign_places
    from megainfer.server.fan_in import FanIn

    replies = [DeltaColumns.of([dataclasses.replace(d, request_id=f"{n}/{d.request_id}") for d in deltas])
               for n in range(attention_nodes)]
    owner = {rid: n for n, columns in enumerate(replies) for rid in columns.request_ids}
    registry = StreamRegistry(max_open=len(deltas) * attention_nodes)
    readers = [FanIn([registry.open(rid)]) for rid in owner]
    spent = []
    for _ in range(repeats):
        t0 = time.process_time()
        for node, columns in enumerate(replies):
            if foreign_places(columns.request_ids, owner, node):
                raise RuntimeError("a delta from a node that does not hold its request")
            registry.deliver_batch(columns)
        spent.append(time.process_time() - t0)
        for reader in readers:
            if reader.get(0.0) is None:
                raise RuntimeError("a stream's reader was not woken")
    return sorted(spent)[len(spent) // 2] * 1e3  # the median step: a neighbour's burst is noise


def last_step_deltas(running: int, context: int, micro_batches: int, plan_model: ModelConfig) -> list:
    """One decode step's deltas at `running` sequences."""
    return boundary_engine(running, context, micro_batches, plan_model, async_scheduling=False).step_columns().deltas
