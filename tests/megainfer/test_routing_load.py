"""The load `bench routing` sends (megainfer/tools/bench/routing_load.py): the simulator's length
distributions as random token ids."""

from __future__ import annotations

import pytest

from megainfer.tools.bench.routing_load import ServeBenchSpec, workload
from megainfer.errors import ConfigError


def test_random_range_ratio_mixes_lengths():
    reqs = workload(ServeBenchSpec(server="", num_prompts=400, input_len=200, output_len=20, random_range_ratio=0.5,
                                   request_rate=5.0))
    ins = [r.input_len for r in reqs]
    assert min(ins) >= 100 and max(ins) <= 300 and len(set(ins)) > 50
    assert all(10 <= r.output_len <= 30 for r in reqs)
    assert all(b.arrival_s >= a.arrival_s for a, b in zip(reqs, reqs[1:])) and reqs[-1].arrival_s > 0
    with pytest.raises(ConfigError, match="random-range-ratio"):
        workload(ServeBenchSpec(server="", random_range_ratio=1.5))


def test_mixed_dataset_makes_a_share_of_prompts_long():
    reqs = workload(ServeBenchSpec(server="", dataset="mixed", num_prompts=1000, input_len=48, long_input_len=1024,
                                   long_fraction=0.3, random_range_ratio=0.25, output_len=16, request_rate=5.0))
    long = [r.input_len for r in reqs if r.input_len > 60]
    short = [r.input_len for r in reqs if r.input_len <= 60]
    assert 0.25 < len(long) / len(reqs) < 0.35
    assert min(long) >= 768 and max(long) <= 1280 and min(short) >= 36
    with pytest.raises(ConfigError, match="long-fraction"):
        workload(ServeBenchSpec(server="", dataset="mixed", long_fraction=0.0))
