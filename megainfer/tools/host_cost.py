"""`megainfer bench host PLAN`: the host's CPU time per M2N round at the plan's scale.

MegaScale-Infer's gain rests on a (layer, micro-batch)'s exchange fitting inside its compute,
t_a on the attention side and t_e on the expert side. This measures what the host spends per
round through the real code, with the model compute stubbed:

- attention rank: one round is the runner's combine of micro-batch j's N answers and its
  next dispatch of j to the plan's N expert nodes (the runner's `ExpertExchange.combine` and
  `_send_dispatch`: the checks, the gather of the answers, the post; the answers' sum into the
  residual is left out, device work on a GPU), m rounds in flight as in a step, the N expert
  nodes echoing from one other process;
- expert node: one (layer, micro-batch) of `ExpertWorker.run_step` (receive from every
  attention rank, gather, unpack, the experts replaced by zeros, answer every rank), the
  plan's M attention ranks in one other process sending micro-batch j's next message as soon
  as its answers are in (the ping-pong's steady state).

The peers are the compiled core's loopback loops (`transport._m2n_core.echo` and `drive`):
fast stand-ins, so that what the measured side is charged is its own work, not a slow peer's
(the Python path of the first measurement, whose peers were Python loops, spun while they
answered); both paths are measured against the same peers.

CPU time is `time.process_time` of the measured process: every thread of it, so work moved to
a progress thread is not hidden. Message sizes: a 4 KiB variant (one token per peer, in a
model whose record is 4 KiB: isolates the per-message cost) and the plan's own (each rank's
share of a micro-batch's decodes, the share of them routed to one expert node, in the plan's
model). Reported beside the plan's predicted t_a and t_e, for both paths in the same run:
`core` (rounds in the compiled core) and `python` (the pure-Python reference, per message).
"""

from __future__ import annotations

import dataclasses
import math
import multiprocessing as mp
import time
import traceback
from dataclasses import dataclass

import torch

from megainfer.expert_replicas import ExpertReplicas
from megainfer.tools.bench.report import format_table
from megainfer.config import ModelConfig
from megainfer.disagg.expert_link import record_bytes
from megainfer.engine_config import EngineConfig
from megainfer.model_resolution import resolve_model
from megainfer.plan import Plan
from transport import Endpoint, EndpointSpec
from transport.endpoint import connect_concurrently

SECRET = b"megainfer-bench-host-secret-0123"
SMALL_RECORD = 4096  # bytes: the per-message-cost variant's one-token message
DTYPE = torch.bfloat16
TIMEOUT_S = 60.0


@dataclass(frozen=True)
class HostScale:
    """What the plan sets for one attention rank and one expert node."""

    expert_nodes: int  # N: peers of one attention rank
    attention_ranks: int  # M: peers of one expert node (attention nodes x their tp)
    micro_batches: int
    layers: int
    hidden: int
    top_k: int
    experts: int
    experts_per_node: int
    expert_room: int  # weight rows per expert node and layer: its experts and the plan's spares (Plan.expert_room)
    tokens_per_peer: int  # the plan's message: one rank's tokens of a micro-batch routed to one expert node
    t_a_ms: float  # the plan's predicted attention time of one (layer, micro-batch); 0: the plan predicts none
    t_e_ms: float

    @property
    def rounds_per_step(self) -> int:
        return self.layers * self.micro_batches


def routed_share(experts: int, per_node: int, top_k: int) -> float:
    """The chance a token's top-k experts include one of a node's `per_node` (uniform routing)."""
    return 1.0 - math.comb(experts - per_node, top_k) / math.comb(experts, top_k)


def hidden_for_record(record: int, top_k: int) -> int:
    """The bf16 hidden size whose dispatch record (hidden state, k int32 ids, k float32 weights)
    takes `record` bytes: 2,016 at top-8 for 4 KiB."""
    hidden = (record - 2 * 4 * top_k) // DTYPE.itemsize
    return hidden - hidden % 2  # hidden * 2 bytes stays a multiple of 4 (the record's alignment)


def scale_of(plan: Plan) -> HostScale:
    model, _ = resolve_model(plan.model)
    per_node = len(plan.expert_assignment(model)[0])
    # Decode: every running sequence is one token of one micro-batch; a rank sends its 1/tp share.
    tokens = plan.scheduler.max_num_seqs / plan.pipeline.micro_batches / plan.attention.tp
    share = routed_share(model.num_experts, per_node, model.top_k)
    predicted = plan.predicted
    return HostScale(plan.experts.nodes, plan.attention.nodes * plan.attention.tp, plan.pipeline.micro_batches,
                     model.num_layers, model.hidden_size, model.top_k, model.num_experts, per_node,
                     plan.expert_room(model), max(1, math.ceil(tokens * share)), predicted.t_a_ms if predicted else 0.0,
                     predicted.t_e_ms if predicted else 0.0)


def _stub_model(scale: HostScale, hidden: int) -> ModelConfig:
    """One layer of the plan's routing shape at `hidden`, everything else tiny (compute is stubbed)."""
    return ModelConfig(model_type="qwen3_moe", vocab_size=256, hidden_size=hidden, num_layers=1, num_heads=4,
                       num_kv_heads=4, head_dim=16, num_experts=scale.experts, top_k=scale.top_k,
                       expert_intermediate_size=16, norm_topk_prob=True, rope_theta=1e6, rms_norm_eps=1e-6,
                       max_position_embeddings=4096, name="bench-host")


def _endpoint(name: str, rank: int, slot_bytes: int, slots: int, core: str, backend: str) -> Endpoint:
    return Endpoint(EndpointSpec(name=name, rank=rank, secret=SECRET, listen="127.0.0.1:0", slot_bytes=slot_bytes,
                                 num_slots=slots, backend=backend, timeout_s=TIMEOUT_S, core=core))


# -- the peers, in one other process: the core's loopback loops (fast stand-ins, so what the
# measured side is charged is its own work, not a slow peer's; the same peers for both paths).
def _wired_peers(names: list[str], first_rank: int, slot_bytes: int, slots: int, measured: str, backend: str,
                 conn) -> tuple[list, list, list[int]]:
    """The peer endpoints, connected to the measured one (its address comes through `conn`):
    their channels to it as the core's loops take them (inbound, outbound, and the control
    sockets that say the measured side left; over tcp the channels' own reads say it)."""
    endpoints = [_endpoint(n, first_rank + i, slot_bytes, slots, "on", backend) for i, n in enumerate(names)]
    conn.send([ep.address for ep in endpoints])
    address = conn.recv()
    connect_concurrently([(ep, {measured: address}) for ep in endpoints], TIMEOUT_S)
    controls = [ep.inbound[measured].control.fileno() for ep in endpoints] if backend == "shm" else []
    return [ep.inbound[measured].core for ep in endpoints], [ep.outbound[measured].core for ep in endpoints], controls


def _echo_experts(names: list[str], slot_bytes: int, slots: int, answer_row_bytes: int, backend: str, conn) -> None:
    """N expert nodes that answer each dispatch with token_count zero rows, until the rank leaves."""
    from transport.core import native

    try:
        inbound, outbound, controls = _wired_peers(names, 100, slot_bytes, slots, "attention0", backend, conn)
        native.echo(inbound, outbound, answer_row_bytes, controls)
    except BaseException:
        conn.send(traceback.format_exc())


def _attention_senders(names: list[str], slot_bytes: int, slots: int, record_size: int, tokens: int, backend: str,
                       conn) -> None:
    """M attention ranks in the ping-pong's steady state (transport._m2n_core.drive), until the node leaves."""
    from transport.core import native

    try:
        inbound, outbound, controls = _wired_peers(names, 0, slot_bytes, slots, "experts0", backend, conn)
        native.drive(inbound, outbound, tokens * record_size, tokens, slots, controls)
    except BaseException:
        conn.send(traceback.format_exc())


def _start(target, args) -> tuple[mp.Process, object, list[str]]:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    process = ctx.Process(target=target, args=(*args, child), daemon=True)
    process.start()
    if not parent.poll(TIMEOUT_S):
        raise RuntimeError("the peers' process did not start")
    addresses = parent.recv()
    if isinstance(addresses, str):
        raise RuntimeError(f"the peers' process failed:\n{addresses}")
    return process, parent, addresses


def _timed(fn, warmup: int, calls: int) -> tuple[float, float]:
    """(CPU seconds of this process, wall seconds) of `calls` calls fn(i), after `warmup` calls."""
    for i in range(warmup):
        fn(i)
    cpu, wall = time.process_time(), time.perf_counter()
    for i in range(calls):
        fn(i)
    return time.process_time() - cpu, time.perf_counter() - wall


def _stop(link: Endpoint, process: mp.Process) -> None:
    """The measured endpoint closed (the peers' cue to stop), then their process gone."""
    link.close()
    process.join(10)
    if process.is_alive():
        process.kill()


# -- the measured sides ------------------------------------------------------------------------------------
PATHS = {"core": "on", "python": "off"}  # the measured endpoint's EndpointSpec.core


def _path(core: str) -> str:
    return next(path for path, setting in PATHS.items() if setting == core)

@dataclass
class RoundCost:
    side: str  # "attention" or "expert"
    path: str  # "core" (the compiled core's rounds) or "python" (the pure-Python reference, per message)
    peers: int
    message_bytes: int
    cpu_us: float  # CPU time of the measured process per round (every thread)
    wall_us: float

    def per_step_ms(self, scale: HostScale) -> float:
        return self.cpu_us * scale.rounds_per_step / 1e3


def measure_attention(scale: HostScale, hidden: int, tokens_per_peer: int, rounds: int, core: str,
                      backend: str = "shm") -> RoundCost:
    from megainfer.disagg.expert_exchange import PendingDispatch
    from megainfer.disagg.pipelined_runner import PipelinedModelRunner
    from megainfer.model.weights import RandomWeights

    n, m = scale.expert_nodes, scale.micro_batches
    model = _stub_model(scale, hidden)
    rec = record_bytes(hidden, scale.top_k, DTYPE)
    answer_row = hidden * DTYPE.itemsize
    names = [f"experts{k}" for k in range(n)]
    process, conn, addresses = _start(_echo_experts, (names, tokens_per_peer * rec, m, answer_row, backend))
    link = _endpoint("attention0", 0, tokens_per_peer * answer_row, m, core, backend)
    try:
        conn.send(link.address)
        link.connect(dict(zip(names, addresses)))
        per = scale.experts // n
        runner = PipelinedModelRunner(model, EngineConfig(dtype="bfloat16", num_kv_blocks=4, block_size=16),
                                      RandomWeights(), 64, link=link, expert_nodes=names,
                                      replicas=ExpertReplicas.of_assignment(
                                          [list(range(k * per, (k + 1) * per)) for k in range(n)], model.num_layers),
                                      micro_batches=m)
        rows = n * tokens_per_peer
        records = torch.zeros(rows, rec, dtype=torch.uint8)
        offsets = torch.arange(0, rows + 1, tokens_per_peer, dtype=torch.int64)
        token_ids = torch.arange(rows)
        exchange = runner.exchange
        exchange.start_step()  # as at a step's start: the rounds below are one step's

        def dispatch(j: int) -> None:
            exchange.post(PendingDispatch(0, j, exchange.staging.to_host([records, offsets], slot=j), token_ids))

        def one_round(j: int) -> None:
            """The ping-pong's order: micro-batch j's answers combined, then its next dispatch
            (m - 1 other rounds in flight meanwhile, as in a step)."""
            # No residual: the answers' sum into it is device work on a GPU (here it would be CPU
            # compute, not host cost); what the host does with the messages stays.
            exchange.combine(0, j, None)
            dispatch(j)

        with torch.inference_mode():
            for j in range(m):
                dispatch(j)
            cpu, wall = _timed(lambda i: one_round(i % m), max(10, rounds // 10), rounds)
            for j in range(m):  # the last answers, so the peers end between rounds
                exchange.combine(0, j, None)
    finally:
        _stop(link, process)
    return RoundCost("attention", _path(core), n, tokens_per_peer * rec, cpu * 1e6 / rounds, wall * 1e6 / rounds)


def measure_expert(scale: HostScale, hidden: int, tokens_per_peer: int, steps: int, core: str,
                   backend: str = "shm") -> RoundCost:
    from megainfer.disagg.expert_worker import ExpertWorker
    from megainfer.model.weights import RandomWeights

    senders, m = scale.attention_ranks, scale.micro_batches
    model = _stub_model(scale, hidden)
    rec = record_bytes(hidden, scale.top_k, DTYPE)
    names = [f"attention{a}" for a in range(senders)]
    process, conn, addresses = _start(_attention_senders, (names, tokens_per_peer * hidden * DTYPE.itemsize, m, rec,
                                                           tokens_per_peer, backend))
    link = _endpoint("experts0", 100, tokens_per_peer * rec, m, core, backend)
    try:
        conn.send(link.address)
        link.connect(dict(zip(names, addresses)))
        worker = ExpertWorker(model, list(range(scale.experts_per_node)), "bfloat16", "cpu", RandomWeights(),
                              attention_nodes=names, micro_batches=m, link=link,
                              # the core's stand-in senders collect no load round (one round a step)
                              load_reports=False)
        worker.layers = [lambda x, ids, weights: torch.zeros_like(x)]  # the experts' GEMMs stubbed
        cpu, wall = _timed(lambda i: worker.run_step(), max(3, steps // 10), steps)
    finally:
        _stop(link, process)
    rounds = steps * m
    return RoundCost("expert", _path(core), senders, tokens_per_peer * rec, cpu * 1e6 / rounds, wall * 1e6 / rounds)


def median_of(measure, repeats: int) -> RoundCost:
    """The median run of `repeats` (by CPU time): the machines are shared, and a peer process
    descheduled for a while shows as the measured side's spin."""
    runs = sorted((measure() for _ in range(repeats)), key=lambda cost: cost.cpu_us)
    return runs[len(runs) // 2]


def run(plan_path: str, rounds: int, json_path: str | None, repeats: int = 3,
        boundary_running: tuple[int, ...] = (), backend: str = "shm") -> int:
    import json

    from transport import core

    if core.native is None:
        raise SystemExit(f"bench host: {core.BUILD_ERROR}")
    plan = Plan.load(plan_path)
    scale = scale_of(plan)
    torch.set_num_threads(1)
    rows, results = [], {}
    variants = (("4KiB", hidden_for_record(SMALL_RECORD, scale.top_k), 1), ("plan", scale.hidden, scale.tokens_per_peer))
    for label, hidden, tokens in variants:
        key = "" if label == "4KiB" else "_plan_size"
        for side, measure, count in (("attention", measure_attention, rounds),
                                     ("expert", measure_expert, max(1, rounds // scale.micro_batches))):
            costs = {path: median_of(lambda: measure(scale, hidden, tokens, count, setting, backend), repeats)
                     for path, setting in PATHS.items()}
            budget = scale.t_a_ms if side == "attention" else scale.t_e_ms
            for cost in costs.values():
                ratio = f"{cost.cpu_us / (budget * 1e3):.2f}" if budget else "-"
                rows.append([cost.side, cost.path, label, cost.peers, cost.message_bytes, f"{cost.cpu_us:,.1f}",
                             f"{cost.wall_us:,.1f}", f"{cost.per_step_ms(scale):,.1f}", ratio,
                             f"{costs['python'].cpu_us / cost.cpu_us:.1f}x"])
            results[f"{side}_round_cpu_us{key}"] = {path: dataclasses.asdict(cost) for path, cost in costs.items()}
    print(f"{plan_path}: {scale.rounds_per_step} rounds per step ({scale.layers} layers x m = {scale.micro_batches}); "
          f"an attention rank exchanges with N = {scale.expert_nodes} expert nodes, an expert node with M = "
          f"{scale.attention_ranks} attention ranks; the plan's message {scale.tokens_per_peer} tokens "
          f"({routed_share(scale.experts, scale.experts_per_node, scale.top_k):.0%} of a rank's micro-batch reach "
          f"one node); predicted t_a {scale.t_a_ms:.3f} ms, t_e {scale.t_e_ms:.3f} ms"
          + ("" if scale.t_a_ms else " (the plan predicts none)"))
    print(format_table(["side", "path", "message", "peers", "bytes", "CPU us/round", "wall us/round", "CPU ms/step",
                        "x t_a or t_e", "python / path"], rows))
    print(f"median of {repeats} runs of {rounds} rounds each, over {backend} (loopback). path core: rounds in the "
          "compiled M2N core (one call posts to every peer, one collects from every peer); python: the pure-Python "
          "reference backends, one call per message. CPU time: every thread of the measured process (the core's "
          "tcp progress thread included). Peers: the core's loopback loops in one other process, the same for both "
          "paths.")
    results["load_round_us"] = load_round_line(plan, scale)
    results |= step_boundary_rows(plan, scale, boundary_running)
    if json_path:
        with open(json_path, "w") as f:
            from megainfer.tools.m2n_report import machine

            host = machine()
            json.dump({"benchmark": "host", "plan": plan_path, "backend": backend,
                       "machine": f"{host['cpu']}, {host['cores']} cores",
                       "scale": dataclasses.asdict(scale), **results}, f, indent=2)
    return 0


BOUNDARY_CONTEXT = 730  # tokens of context per running sequence (the plans' sequence length)


def load_round_line(plan: Plan, scale: HostScale) -> dict:
    """The load round at the plan's scale (megainfer/tools/load_round_cost.py), printed as one line."""
    from megainfer.tools.load_round_cost import measure_load_round

    load = measure_load_round(scale.layers, scale.experts, scale.expert_nodes, scale.expert_room)
    tbt = plan.predicted.tbt_ms if plan.predicted else 0.0
    print(f"load round, once per step after the last answers: an expert node's counter read and post "
          f"{load['expert_step_us']:,.1f} us; an attention rank's collect of {scale.expert_nodes} nodes' rounds "
          f"({load['entries_per_node']} entries each), added up, {load['attention_collect_us']:,.1f} us"
          + (f" ({load['attention_collect_us'] / (tbt * 1e3):.2%} of the predicted {tbt:.1f} ms step)" if tbt else ""))
    return load


def step_boundary_rows(plan: Plan, scale: HostScale, extra_running: tuple[int, ...] = ()) -> dict:
    """The attention rank's step boundary at 512, 1,024, the plan's max_num_seqs and
    `extra_running` running sequences, by phase, and the serving process's delta handling for the plan's attention
    nodes (megainfer/tools/step_boundary.py); printed as a table, returned for the JSON."""
    from megainfer.tools.launch_count import decode_launches
    from megainfer.tools.step_boundary import (BLOCK_SIZE, context_lengths, last_step_deltas, measure_boundary,
                                               measure_driver)

    model, _ = resolve_model(plan.model)
    sizes = sorted({512, 1024, plan.scheduler.max_num_seqs, *extra_running})
    rows, by_size = [], {}
    for running in sizes:
        measured = measure_boundary(running, BOUNDARY_CONTEXT, scale.micro_batches, model,
                                    async_scheduling=plan.async_scheduling, t_e_s=scale.t_e_ms / 1e3)
        phases = measured.per_step_ms()
        total = sum(phases.values())
        by_size[running] = {**phases, "total": total, "wait": measured.wait_ms(), "argmax_stand_in": measured.argmax_ms(),
                            "beside_pieces": measured.pieces_ms()}
        rows.append([f"{running:,}", *(f"{phases[k]:.1f}" for k in ("prepare", "sample", "beside", "bookkeeping",
                                                                    "deltas_out")),
                     f"{total:.1f}", f"{measured.wait_ms():.1f}", f"{total / running * 1e3:.1f}",
                     f"{measured.argmax_ms():.1f}"])
    most = plan.scheduler.max_num_seqs
    driver_by_running = {n: measure_driver(last_step_deltas(n, BOUNDARY_CONTEXT, scale.micro_batches, model),
                                           plan.attention.nodes) for n in sorted({most, max(sizes)})}
    driver_ms = driver_by_running[most]
    driver = "; ".join(f"{ms:.1f} CPU ms per step to check and fan out {n:,} deltas from each of the plan's "
                       f"{plan.attention.nodes} attention nodes" for n, ms in driver_by_running.items())
    driver += " (to their streams, waking each reader; Ray's byte copy of the columns not included)"
    scheduling = "asynchronous" if plan.async_scheduling else "synchronous"
    lengths = context_lengths(BLOCK_SIZE, BOUNDARY_CONTEXT, BLOCK_SIZE)  # one of each: the range
    print(f"\nstep boundary of one attention rank (decode steps, contexts of {min(lengths)} to {max(lengths)} "
          f"tokens, one in {BLOCK_SIZE} of them taking a new KV block each step, m = "
          f"{scale.micro_batches}, {scheduling} scheduling as the plan sets it, layers skipped; CPU ms per step):")
    print(format_table(["running", "prepare", "sample", "beside layers", "bookkeeping", "deltas out", "total",
                        "experts wait", "us/sequence", "argmax (not in total)"], rows))
    print(f"prepare: StepLayout and every micro-batch's inputs; sample: the sampler's host side (its argmax over the "
          f"demo model's 2,048-token vocabulary, device work on a GPU, timed apart and left out; with asynchronous "
          f"scheduling, each micro-batch's tokens placed for the next step as it is sampled, and the next step's "
          f"micro-batch 0 completed once they are all there); beside layers: "
          f"with asynchronous scheduling, the step before settled (stops, detokenization, deltas) and the next one "
          f"scheduled and laid out, once every micro-batch's inputs are built; bookkeeping: the "
          f"rest (schedule and update_from_output when synchronous, checks, statistics); deltas out: the outbox's "
          f"poll answer. Experts wait: from a step's last answer to the next step's micro-batch 0 inputs (its "
          f"dispatch follows its attention), plus what sampling the other micro-batches takes beyond the expert "
          f"nodes' m x t_e ({scale.t_e_ms:.3f} ms) for the last layer.\n"
          f"driver: {driver}")
    tbt = plan.predicted.tbt_ms if plan.predicted else 0.0
    if burst := beside_stall(by_size[most]["beside_pieces"], scale, tbt) if plan.async_scheduling else {}:
        print(burst["line"])
    launches = decode_launches(model)
    print(f"launches per (layer, micro-batch) of a decode step, counted by the torch dispatcher on the CPU path "
          f"({launches.model}, the family's tiny preset: the op sequence, not the sizes): attention half "
          f"{launches.attention.launches} (+{launches.attention.views} views), expert half {launches.expert.launches} "
          f"(+{launches.expert.views} views); on CUDA the attention, KV write and gating are one Triton kernel each")
    boundary = by_size[most]["total"]
    return {"step_boundary_cpu_ms": boundary, "boundary_wait_ms": by_size[most]["wait"], "driver_delta_cpu_ms": driver_ms,
            "step_boundary_by_running": by_size, "driver_delta_cpu_ms_by_running": driver_by_running,
            "beside_largest_piece_ms": burst.get("largest_ms"), "beside_stall_ms": burst.get("stall_ms"),
            "launches_per_layer_micro_batch": dataclasses.asdict(launches)}


def beside_stall(pieces_ms: list[float], scale: HostScale, step_ms: float) -> dict:
    """What the work beside the layers would cost a GPU pipeline. The runner runs it on its own
    thread in pieces, one after each layer's dispatches (megainfer/runner/step_hooks.py), and
    nothing of the next layer can be launched meanwhile. The layer's answers are back after
    about its device time (m x max(t_a, t_e)); a piece longer than that holds the attention GPU
    and the expert nodes for the difference, at least. A CPU plan shows no such stall, since
    its layers run on the same cores. Empty where the plan predicts no t_a."""
    layer_ms = scale.micro_batches * max(scale.t_a_ms, scale.t_e_ms)
    if not layer_ms or not pieces_ms:
        return {}
    stall = sum(max(0.0, piece - layer_ms) for piece in pieces_ms)
    share = f" ({stall / step_ms:.1%} of the predicted {step_ms:.1f} ms step)" if step_ms else ""
    line = (f"beside the layers at max_num_seqs: {sum(pieces_ms):.1f} ms in {len(pieces_ms)} pieces, one after each "
            f"layer's dispatches, the largest {max(pieces_ms):.1f} ms, against one layer's {layer_ms:.2f} ms of device "
            f"time (m x max(t_a, t_e)); on a GPU the pipeline would stand at least {stall:.1f} ms of each step{share} "
            f"(not measured on a GPU)")
    return {"largest_ms": max(pieces_ms), "stall_ms": stall, "pieces_ms": pieces_ms, "line": line}
