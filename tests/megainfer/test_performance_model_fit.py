"""The committed H100 efficiency curves reproduce the layered-prefill paper's measurements
(issue 20's bar), and the fit's machinery (parameter mapping, entry writing) does what it says."""

from __future__ import annotations

import argparse
import math

import numpy as np
import pytest

from megainfer.cli import simulate
from megainfer.engine_config import EngineConfig
from megainfer.errors import ConfigError
from megainfer.presets import PRESETS
from megainfer.tools.simulator import curve_fit as cf
from megainfer.tools.simulator import paper_measurements as paper
from megainfer.tools.simulator.curves_entry import entry_text, write_entry
from megainfer.tools.simulator.experiment import SimulationSpec
from megainfer.tools.simulator.sim import Simulator
from megainfer.tools.bench.workload import SimRequest
from planner.catalog import Catalog
from planner.efficiency_curves import DEFAULT_CURVES, EfficiencyCurves
from planner.step_cost_model import ColocatedStepModel

QWEN = PRESETS["qwen3-30b-a3b"]


def simulate_command_defaults() -> argparse.Namespace:
    """`megainfer simulate`'s own defaults (seed, expert skew, group tokens, ...), as its parser sets them."""
    parser = argparse.ArgumentParser()
    simulate.register(parser.add_subparsers())
    return parser.parse_args(["simulate"])


def _simulate(policy: str, chunk: int, rate: float) -> dict:
    """What `megainfer simulate --model qwen3-30b-a3b --gpu H100 --tp 2 --workload arxiv --rate RATE
    --requests 300 --policy POLICY --chunk-size CHUNK` prints, with every other option at the
    command's default."""
    defaults = simulate_command_defaults()
    spec = SimulationSpec(model=QWEN, step_model=ColocatedStepModel(QWEN, Catalog.load()["H100"], 2),
                          workload="arxiv", rate=rate, num_requests=300, policies=(policy,), chunk_size=chunk,
                          expert_skew=defaults.expert_skew, seed=defaults.seed)
    return spec.run(spec.requests())[policy]


@pytest.fixture(scope="module")
def runs() -> dict[str, dict]:
    return {"chunked": _simulate("chunked", 512, 1.3), "layered": _simulate("layered", 512, 1.3)}


def test_chunked_512_at_1_3_req_s_is_within_25_percent_of_both_runs(runs):
    r = runs["chunked"]
    for measured in (paper.CHUNKED_512, paper.CHUNKED_512_RERUN):
        assert r["ttft_mean_s"] == pytest.approx(measured.ttft_mean_s, rel=0.25)
        assert r["tbt_mean_s"] == pytest.approx(measured.tbt_mean_s, rel=0.25)
    assert 2.24 <= r["ttft_mean_s"] <= 3.35 and 26.3e-3 <= r["tbt_mean_s"] <= 36.3e-3


def test_layered_at_1_3_req_s_is_within_25_percent(runs):
    r = runs["layered"]
    assert 0.93 <= r["ttft_mean_s"] <= 1.55
    assert 16.1e-3 <= r["tbt_mean_s"] <= 26.9e-3


def test_layered_beats_chunked_where_the_paper_measured_it(runs):
    chunked, layered = runs["chunked"], runs["layered"]
    for key in ("ttft_mean_s", "tbt_mean_s", "ttft_p99_s", "expert_bytes"):
        assert layered[key] < chunked[key], key


@pytest.mark.parametrize("measured", [paper.CHUNKED_1024, paper.CHUNKED_2048], ids=lambda m: m.label)
def test_larger_chunks_have_the_measured_mean_tbt(measured):
    r = _simulate("chunked", measured.chunk_size, measured.rate)
    assert r["tbt_mean_s"] == pytest.approx(measured.tbt_mean_s, rel=0.25)


def test_one_long_prompt_takes_the_measured_prefill_time():
    """8,192 tokens alone: over 500 ms at chunk 512 with the MoE over half of it, about 200 ms
    at chunks of 4,096 and 8,192 (within the same 25%)."""
    problem = cf.FitProblem("H100")
    sim = problem.simulate(EfficiencyCurves.load("H100"))
    assert sim.prefill_s[paper.PROMPT_CHUNK_512.label] > 0.5
    assert sim.moe_share[paper.PROMPT_CHUNK_512.label] > 0.5
    for p in (paper.PROMPT_CHUNK_4096, paper.PROMPT_CHUNK_8192):
        assert sim.prefill_s[p.label] == pytest.approx(0.2, rel=0.25)


def test_the_single_prompt_is_priced_step_by_step():
    """The fit's single-prompt figure is the simulator's TTFT of the prompt alone: 16 steps of 512."""
    step_model = ColocatedStepModel(QWEN, Catalog.load()["H100"], 2)
    result = Simulator(QWEN, step_model, EngineConfig(max_num_batched_tokens=512)).run([SimRequest(0.0, 8192, 1)])
    assert result.steps == 16 and result.ttft_s[0] == pytest.approx(result.busy_s)


# -- the fit's machinery ------------------------------------------------------------------------
def test_parameters_map_to_curves_and_back_within_their_bounds():
    base = EfficiencyCurves.load("H100")
    x = cf.to_vector(base)
    assert np.allclose(cf.to_vector(cf.from_vector(base, x)), x)
    moved = cf.from_vector(base, x + 0.5)
    for p, value in zip(cf.FITTED, np.exp(x + 0.5)):
        assert p.get(moved) == pytest.approx(min(value, p.upper))
    peaks = cf.from_vector(base, np.full(len(cf.FITTED), 5.0))  # e^5 clipped to each upper bound
    assert peaks.moe.flops.peak == 1.0 and peaks.step_overhead_s == 0.05
    assert peaks.attention.bandwidth == base.attention.bandwidth  # unfitted fields untouched
    for (lo, hi), p in zip(cf.log_bounds(), cf.FITTED):
        assert math.exp(lo) == pytest.approx(p.lower) and math.exp(hi) == pytest.approx(p.upper)
        if p.name.endswith(".peak"):
            assert 0 < p.lower and p.upper == 1.0


def test_writing_an_entry_replaces_only_that_entry_and_keeps_comments(tmp_path):
    path = tmp_path / "curves.yaml"
    path.write_text(DEFAULT_CURVES.read_text() + "\nL40S:\n  # a comment\n  launch_s: 3.0e-6\n")
    before = path.read_text()
    curves = EfficiencyCurves.load("H100").with_values(step_overhead_s=0.0123)
    write_entry(path, "H100", entry_text("H100", curves, {p.name for p in cf.FITTED}))
    write_entry(path, "H100", entry_text("H100", curves, {p.name for p in cf.FITTED}))  # twice: replaced, not appended
    text = path.read_text()
    assert text.count("\nH100:") == 1 and "L40S:\n  # a comment\n  launch_s: 3.0e-6" in text
    assert text.startswith(before.split("\nH100:")[0].split("\nL40S:")[0])  # the header comments survive
    loaded = EfficiencyCurves.load("H100", path)
    assert loaded.step_overhead_s == pytest.approx(0.0123)
    assert loaded.moe.flops.peak == pytest.approx(curves.moe.flops.peak, rel=1e-3)
    assert EfficiencyCurves.load("L40S", path).launch_s == pytest.approx(3e-6)


def test_the_fit_refuses_a_gpu_without_measurements():
    with pytest.raises(ConfigError, match="--gpu 'L40S'"):
        cf.FitProblem("L40S")


def test_the_fit_simulates_what_the_command_runs():
    defaults = simulate_command_defaults()
    spec = cf.FitProblem("H100").spec(EfficiencyCurves.load("H100"), paper.CHUNKED_512)
    assert (spec.seed, spec.expert_skew, spec.group_tokens, spec.num_layer_groups, spec.max_num_seqs,
            spec.tbt_slo_s, spec.ttft_slo_s) == (
        defaults.seed, defaults.expert_skew, defaults.group_tokens, defaults.num_layer_groups, defaults.max_num_seqs,
        defaults.tbt_slo_ms / 1e3, defaults.ttft_slo_s)
    assert spec.expert_skew > 0  # the fitted routing skew, not uniform
