"""`megainfer bench pipeline PLAN.yaml --micro-batches 1,2,3`: decode throughput of the
deployment for each micro-batch count, measured on the real path (Ray control plane,
M2N data plane), one deployment after another in one Ray session; and how well the nodes
overlapped, from their own timelines (busy fractions, the pipeline's efficiency, and with
`--plot` the Gantt chart)."""

from __future__ import annotations

import dataclasses
import os
import platform
import random
import time

import ray

from deploy.deployment import Deployment
from deploy.placement import connect_ray
from deploy.timeline_calls import read_timelines, trace
from megainfer.tools.bench.pipeline_overlap import PipelineOverlap, overlap, plot_measured_gantt
from megainfer.tools.bench.report import format_table, write_json
from megainfer.errors import DataPlaneError, PlanError
from megainfer.messages import FinishReason
from megainfer.plan import PipelineSpec, Plan
from megainfer.sampling_params import SamplingParams
from megainfer.server.backend import RequestStream


def measure(plan: Plan, requests: int, prompt_len: int, output_len: int, seed: int = 0) -> tuple[dict, list]:
    """The run's figures, and the nodes' timelines (on this process's clock)."""
    deployment = Deployment(plan, show_progress=False).start()
    try:
        actors = deployment.group.actors
        trace(actors, True)
        rng = random.Random(seed)
        vocab = deployment.model.vocab_size
        params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
        start = time.perf_counter()
        streams = [deployment.submit(f"bench-{i}", [rng.randrange(vocab) for _ in range(prompt_len)], params)
                   for i in range(requests)]
        arrivals = token_arrivals(streams)
        elapsed = time.perf_counter() - start
        decode_start = max(times[0] for times in arrivals)  # every prompt has its first token
        decode_end = max(times[-1] for times in arrivals)
        decode_tokens = sum(1 for times in arrivals for t in times if t > decode_start)
        stats = deployment.stats()
        timing = {h.name: h.timing for h in deployment.health()}
        timelines = read_timelines(actors)
        result = overlap(timelines)
        return {"micro_batches": plan.pipeline.micro_batches, "requests": requests, "output_tokens": requests * output_len,
                "seconds": elapsed, "tokens_per_s": requests * output_len / elapsed,
                "decode_seconds": decode_end - decode_start, "decode_tokens": decode_tokens,
                "decode_tokens_per_s": decode_tokens / max(decode_end - decode_start, 1e-9),
                "steps": sum(s.engine.num_steps for s in stats), "timing": timing,
                "overlap": _overlap_json(result)}, [timelines, result]
    finally:
        deployment.close()


def token_arrivals(streams: list[RequestStream], stall_s: float = 120.0) -> list[list[float]]:
    """When each stream's tokens arrived (one time per token). The driver shares the nodes'
    cores, so it does not poll: it sleeps on one open stream until a delta lands there (a
    step's deltas land together), then sweeps every open stream once."""
    arrivals: list[list[float]] = [[] for _ in streams]
    open_streams = dict.fromkeys(range(len(streams)))  # insertion-ordered: the first is waited on
    last_progress = time.monotonic()

    def take(i: int, delta) -> None:
        arrivals[i] += [time.perf_counter()] * len(delta.new_token_ids)
        if delta.finished:
            if delta.finish_reason is FinishReason.ERROR:
                raise DataPlaneError(f"request {streams[i].request_id} failed: {delta.error}")
            del open_streams[i]

    while open_streams:
        first = next(iter(open_streams))
        delta = streams[first].get(0.05)
        if delta is None:
            if time.monotonic() - last_progress > stall_s:
                raise DataPlaneError(f"{len(open_streams)} request(s) stalled: nothing for {stall_s:g} s")
            continue
        last_progress = time.monotonic()
        take(first, delta)
        for i in list(open_streams):
            while i in open_streams and (delta := streams[i].get(0.0)) is not None:
                take(i, delta)
    return arrivals


def _overlap_json(result: PipelineOverlap) -> dict:
    return {"decode_window_s": result.wall_s, "decode_steps": result.steps, "bottleneck": result.bottleneck.name,
            "efficiency": result.efficiency,
            "nodes": {n.name: {"role": str(n.role), "busy_s": n.busy_s, "busy_fraction": n.busy_fraction,
                               "compute_s": n.compute_s, "computes": n.computes,
                               "mean_compute_ms": n.mean_compute_ms} for n in result.nodes}}


def run(plan_path: str, micro_batches: list[int], requests: int | None, prompt_len: int, output_len: int,
        json_path: str | None, plot_path: str | None = None) -> int:
    plan = Plan.load(plan_path)
    requests = requests or plan.pipeline.global_batch
    if requests > plan.attention.nodes * plan.scheduler.max_num_seqs:
        raise PlanError(f"--requests {requests} exceeds what the attention nodes run at once "
                        f"({plan.attention.nodes} x scheduler.max_num_seqs {plan.scheduler.max_num_seqs})")
    started = connect_ray(None, plan)  # one Ray session for every micro-batch count
    try:
        rows, traces = [], []
        for m in micro_batches:
            variant = dataclasses.replace(plan, pipeline=PipelineSpec(micro_batches=m,
                                                                      global_batch=max(m, plan.pipeline.global_batch)))
            print(f"m={m}: deploying and running {requests} requests x {output_len} tokens ...", flush=True)
            row, traced = measure(variant, requests, prompt_len, output_len)
            rows.append(row)
            traces.append(traced)
    finally:
        if started:
            ray.shutdown()
    base = rows[0]["tokens_per_s"]
    decode_base = rows[0]["decode_tokens_per_s"]
    print(format_table(["micro-batches", "seconds", "tok/s (all)", "decode tok/s", f"decode vs m={rows[0]['micro_batches']}",
                        "efficiency"],
                       [[r["micro_batches"], r["seconds"], r["tokens_per_s"], r["decode_tokens_per_s"],
                         f"{r['decode_tokens_per_s'] / decode_base:.2f}x", f"{r['overlap']['efficiency']:.0%}"]
                        for r in rows]))
    print("tok/s (all): every output token over the whole run, prefill and queueing included; decode tok/s: the "
          "tokens after the last prompt's first token, over that window")
    print()
    print(format_table(["micro-batches", "node", "busy s", "busy", "compute s", "per (layer, mb) ms"],
                       [[r["micro_batches"], name + (" *" if name == r["overlap"]["bottleneck"] else ""),
                         n["busy_s"], f"{n['busy_fraction']:.0%}", n["compute_s"], n["mean_compute_ms"]]
                        for r in rows for name, n in r["overlap"]["nodes"].items()]))
    print("from the nodes' own timelines, over the decode window (the decode-only steps): busy = stepping and not "
          "waiting for a peer; efficiency = the bottleneck's (*) busy time / the window")
    if plot_path:
        plot_measured_gantt([(f"m = {r['micro_batches']}", timelines, result) for r, (timelines, result) in zip(rows, traces)],
                   plot_path, title=f"{plan_path} ({plan.model}): {requests} requests, decode")
        print(f"wrote {plot_path}")
    if json_path:
        write_json(json_path, {"benchmark": "pipeline", "plan": plan_path, "model": plan.model,
                               "attention_nodes": plan.attention.nodes, "expert_nodes": plan.experts.nodes,
                               "prompt_len": prompt_len, "output_len": output_len, "machine": platform.machine(),
                               "cpus": os.cpu_count(), "results": rows,
                               "ratios": {str(r["micro_batches"]): r["tokens_per_s"] / base for r in rows},
                               "decode_ratios": {str(r["micro_batches"]): r["decode_tokens_per_s"] / decode_base
                                                 for r in rows}})
    return 0
