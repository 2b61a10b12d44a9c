"""`megainfer bench pipeline PLAN.yaml --micro-batches 1,2,3`: decode throughput of the
deployment for each micro-batch count, measured on the real path (Ray control plane,
M2N data plane), one deployment after another in one Ray session."""

from __future__ import annotations

import dataclasses
import os
import platform
import random
import time

import ray

from deploy.deployment import Deployment
from deploy.placement import connect_ray
from megainfer.bench.report import format_table, write_json
from megainfer.errors import DataPlaneError, PlanError
from megainfer.messages import FinishReason
from megainfer.plan import PipelineSpec, Plan
from megainfer.sampling_params import SamplingParams
from megainfer.server.backend import RequestStream


def measure(plan: Plan, requests: int, prompt_len: int, output_len: int, seed: int = 0) -> dict:
    deployment = Deployment(plan, show_progress=False).start()
    try:
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
        return {"micro_batches": plan.pipeline.micro_batches, "requests": requests, "output_tokens": requests * output_len,
                "seconds": elapsed, "tokens_per_s": requests * output_len / elapsed,
                "decode_seconds": decode_end - decode_start, "decode_tokens": decode_tokens,
                "decode_tokens_per_s": decode_tokens / max(decode_end - decode_start, 1e-9),
                "steps": sum(s.engine.num_steps for s in stats), "timing": timing}
    finally:
        deployment.close()


def token_arrivals(streams: list[RequestStream], stall_s: float = 120.0) -> list[list[float]]:
    """When each stream's tokens arrived (one time per token), reading every stream as it goes so
    no arrival waits behind another stream's."""
    arrivals: list[list[float]] = [[] for _ in streams]
    open_streams = set(range(len(streams)))
    last_progress = time.monotonic()
    while open_streams:
        progressed = False
        for i in list(open_streams):
            while (delta := streams[i].get(0.0)) is not None:
                progressed = True
                now = time.perf_counter()
                arrivals[i] += [now] * len(delta.new_token_ids)
                if delta.finished:
                    if delta.finish_reason is FinishReason.ERROR:
                        raise DataPlaneError(f"request {streams[i].request_id} failed: {delta.error}")
                    open_streams.discard(i)
                    break
        if progressed:
            last_progress = time.monotonic()
        elif time.monotonic() - last_progress > stall_s:
            raise DataPlaneError(f"{len(open_streams)} request(s) stalled: nothing for {stall_s:g} s")
        else:
            time.sleep(0.002)
    return arrivals


def run(plan_path: str, micro_batches: list[int], requests: int | None, prompt_len: int, output_len: int,
        json_path: str | None) -> int:
    plan = Plan.load(plan_path)
    requests = requests or plan.pipeline.global_batch
    if requests > plan.attention.nodes * plan.scheduler.max_num_seqs:
        raise PlanError(f"--requests {requests} exceeds what the attention nodes run at once "
                        f"({plan.attention.nodes} x scheduler.max_num_seqs {plan.scheduler.max_num_seqs})")
    started = connect_ray(None, plan)  # one Ray session for every micro-batch count
    try:
        rows = []
        for m in micro_batches:
            variant = dataclasses.replace(plan, pipeline=PipelineSpec(micro_batches=m,
                                                                      global_batch=max(m, plan.pipeline.global_batch)))
            print(f"m={m}: deploying and running {requests} requests x {output_len} tokens ...", flush=True)
            rows.append(measure(variant, requests, prompt_len, output_len))
    finally:
        if started:
            ray.shutdown()
    base = rows[0]["tokens_per_s"]
    decode_base = rows[0]["decode_tokens_per_s"]
    print(format_table(["micro-batches", "seconds", "tok/s (all)", "decode tok/s", f"decode vs m={rows[0]['micro_batches']}"],
                       [[r["micro_batches"], r["seconds"], r["tokens_per_s"], r["decode_tokens_per_s"],
                         f"{r['decode_tokens_per_s'] / decode_base:.2f}x"] for r in rows]))
    print("tok/s (all): every output token over the whole run, prefill and queueing included; decode tok/s: the "
          "tokens after the last prompt's first token, over that window")
    if json_path:
        write_json(json_path, {"benchmark": "pipeline", "plan": plan_path, "model": plan.model,
                               "attention_nodes": plan.attention.nodes, "expert_nodes": plan.experts.nodes,
                               "prompt_len": prompt_len, "output_len": output_len, "machine": platform.machine(),
                               "cpus": os.cpu_count(), "results": rows,
                               "ratios": {str(r["micro_batches"]): r["tokens_per_s"] / base for r in rows},
                               "decode_ratios": {str(r["micro_batches"]): r["decode_tokens_per_s"] / decode_base
                                                 for r in rows}})
    return 0
