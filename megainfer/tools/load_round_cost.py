"""The load round's host time at a plan's scale, for `megainfer bench host`: once per step an
expert node reads its pair counters and posts its (layer, row) entries to every attention rank,
and an attention rank collects every expert node's round and adds them up
(megainfer/disagg/expert_load_round.py). Measured through the real calls over shm endpoints in
this process: the N expert nodes' posts one after another, then the attention rank's collect;
wall time of each call, median over the steps.
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch

from megainfer.disagg.expert_load_round import LoadRound, ServedPairs, post_load
from megainfer.disagg.staging_sizes import load_round_bytes
from transport import Endpoint, EndpointSpec
from transport.endpoint import connect_concurrently

SECRET = b"megainfer-bench-load-round-01234"


def measure_load_round(layers: int, experts: int, expert_nodes: int, room: int, steps: int = 60) -> dict:
    """Microseconds per step: `expert_step_us` (an expert node's counter read and post, its one
    attention peer here) and `attention_collect_us` (an attention rank's collect of
    `expert_nodes` rounds of `layers` x `room` entries, added up)."""
    names = ["attention0"] + [f"experts{k}" for k in range(expert_nodes)]
    endpoints = {name: Endpoint(EndpointSpec(name=name, rank=rank, secret=SECRET, listen="127.0.0.1:0",
                                             slot_bytes=load_round_bytes(layers, room), num_slots=1, backend="shm",
                                             timeout_s=60.0))
                 for rank, name in enumerate(names)}
    try:
        connect_concurrently([(endpoints[name], {peer: endpoints[peer].address
                                                 for peer in (names[1:] if name == names[0] else names[:1])})
                              for name in names], 60.0)
        # Node k's rows hold experts k x room ..., as a contiguous placement with spare rows would.
        held = [[[(k * room + row) % experts for row in range(room)] for _ in range(layers)]
                for k in range(expert_nodes)]
        served = [ServedPairs(layers, room, experts, torch.device("cpu")) for _ in range(expert_nodes)]
        collect = LoadRound(tuple(names[1:]), layers, experts)
        expert_us, attention_us = [], []
        for step in range(steps):
            for k, counters in enumerate(served):
                counters.counters.add_(step + k)  # the layers' pairs of this step
                t0 = time.perf_counter()
                report = counters.step_counts(held[k], version=0)
                post_load(endpoints[names[k + 1]], (names[0],), report, step=step, prefill=False)
                expert_us.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            load = collect.collect(endpoints[names[0]], step)
            attention_us.append(time.perf_counter() - t0)
            if int(load.counts.sum()) != sum(layers * room * (step + k) for k in range(expert_nodes)):
                raise RuntimeError("the load round's counts do not add up to what the nodes counted")
    finally:
        for endpoint in endpoints.values():
            endpoint.close()
    skip = min(10, steps // 2)  # warm-up
    return {"expert_nodes": expert_nodes, "entries_per_node": layers * room,
            "expert_step_us": statistics.median(expert_us[skip * expert_nodes:]) * 1e6,
            "attention_collect_us": statistics.median(attention_us[skip:]) * 1e6,
            "attention_collect_us_p90": float(np.percentile(attention_us[skip:], 90)) * 1e6}
