"""The `step_overhead` table: the framework's fixed cost per step.

The real colocated engine (model loaded once) runs decode-only steps at each batch size:
`seqs` requests with the same prompt length and ignore_eos are added and prefilled, a few
decode steps warm up, then `engine.step()` is timed by the wall clock over several more.
From each step's time the operators' share is subtracted, priced by the tables just
measured:

    sum over layers of (dense(b) + attention_decode(b, mean context) + moe(b·top_k/A, A))
        + lm_head(b) + sampling(b)

where A is the number of experts the step routed tokens to in that layer (the engine's
expert counts). The median residual per batch size, clipped at 0, is the table's entry:
scheduling, batch preparation, embedding, output processing and framework dispatch.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

from megainfer.config import ModelConfig
from megainfer.engine.engine import Engine
from megainfer.sampling_params import SamplingParams
from planner.operator_profile import OperatorTable

PROMPT_TOKENS = 16
WARMUP_STEPS = 2


def operator_seconds(tables: dict[str, OperatorTable], model: ModelConfig, seqs: int, context: float,
                     active_experts: list[int]) -> float:
    """The operators' share of one decode step of `seqs` sequences at `context` tokens, with
    `active_experts[layer]` experts receiving tokens in each layer."""
    k = model.top_k
    points = [("dense", (seqs,)), ("attention_decode", (seqs, context)), ("lm_head", (seqs,)),
              ("sampling", (seqs,)), *(("moe", (seqs * k / a, a)) for a in active_experts)]
    for operator, point in points:
        if not tables[operator].covers(*point):
            raise ValueError(f"step_overhead needs {operator} at {point}, outside its measured grid")
    per_layer = tables["dense"](seqs) + tables["attention_decode"](seqs, context)
    return (model.num_layers * per_layer + sum(tables["moe"](seqs * k / a, a) for a in active_experts)
            + tables["lm_head"](seqs) + tables["sampling"](seqs))


def measure_step_overhead(engine: Engine, batch_sizes: tuple[int, ...], steps: int,
                          tables: dict[str, OperatorTable], advance: Callable[[], None] = lambda: None) -> list[float]:
    """Seconds of framework cost per step at each batch size (see the module docstring)."""
    overheads = []
    for seqs in batch_sizes:
        residuals = [step - share for step, share in _decode_steps(engine, seqs, steps, tables)]
        overheads.append(max(0.0, statistics.median(residuals)))
        advance()
    return overheads


def _decode_steps(engine: Engine, seqs: int, steps: int, tables: dict[str, OperatorTable]):
    """(wall seconds of engine.step(), the operators' share of it) for `steps` decode steps."""
    model = engine.model_config
    params = SamplingParams(max_tokens=1 + WARMUP_STEPS + steps, ignore_eos=True)
    prompt = [(7 * i + 1) % model.vocab_size for i in range(PROMPT_TOKENS)]
    batch = [engine.add_request(f"overhead-{seqs}-{i}", prompt, params) for i in range(seqs)]
    try:
        for _ in range(seqs * PROMPT_TOKENS):  # prefill (and the first token): a step or a few
            if all(s.num_output_tokens for s in batch):
                break
            engine.step()
        if not all(s.num_output_tokens and not s.is_finished for s in batch):
            raise RuntimeError(f"step_overhead: the {seqs} requests did not reach decoding (a step failed; "
                               "see the log)")
        for _ in range(WARMUP_STEPS):
            engine.step()
        measured = []
        for _ in range(steps):
            context = sum(s.num_tokens for s in batch) / seqs
            began = time.perf_counter()
            engine.step()
            seconds = time.perf_counter() - began
            active = [len(experts) for experts in engine.stats().last_step_expert_load.activated]
            measured.append((seconds, operator_seconds(tables, model, seqs, context, active)))
        return measured
    finally:
        for s in batch:
            engine.abort(s.request_id)
