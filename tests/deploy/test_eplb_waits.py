"""What `megainfer bench eplb` lays to each phase of a re-placement (deploy/bench_eplb.py): the
waits between a request's decode tokens, each counted for its part inside the phase."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest

pytest.importorskip("ray")  # deploy.bench_eplb deploys on Ray

from deploy.bench_eplb import SteadyLoad, SwitchStall  # noqa: E402
from megainfer.messages import RebalanceReport  # noqa: E402


def load(*arrivals: list[float]) -> SimpleNamespace:
    """What `SwitchStall.of` reads of a SteadyLoad: each request's delivery times (the first, its
    prompt's token, left out of the waits) and the real `longest_wait` over them."""
    steady = SimpleNamespace(arrivals=list(arrivals), concurrency=len(arrivals))
    steady.longest_wait = functools.partial(SteadyLoad.longest_wait, steady)
    return steady


def test_a_wait_counts_for_its_part_inside_the_span():
    steady = load([0.0, 1.0, 1.1, 1.6, 1.7], [0.0, 1.05, 1.15, 1.25])
    assert steady.longest_wait(1.0, 2.0) == pytest.approx(0.5)  # 1.1 -> 1.6, whole
    assert steady.longest_wait(1.4, 2.0) == pytest.approx(0.2)  # 1.1 -> 1.6 from 1.4 on
    assert steady.longest_wait(0.0, 1.3) == pytest.approx(0.2)  # 1.1 -> 1.6 up to 1.3 (the prompt's token left out)
    assert steady.longest_wait(1.62, 1.65) == pytest.approx(0.03)  # a span inside one wait: the span
    assert load([0.0, 1.0]).longest_wait(0.0, 5.0) == 0.0  # no decode token yet: no wait
    assert load().longest_wait(0.0, 5.0) == 0.0


def test_a_wait_begun_in_the_staging_is_not_laid_to_the_switch():
    """Session 23's CI failure, as it may have happened: one 0.26 s wait (4.3 steps) that began
    in the staging and ended just after it, while the switch held no token back. Laid wholly to
    the switch, as the bench did, it read +3.3 steps; its part in the switch is one step."""
    step = 0.06
    # One token a step up to 9.80 s (from 1.46 s), then a 0.26 s wait, then a token a step again.
    steady = load([0.5] + [9.80 - step * i for i in range(140)][::-1] + [10.06 + step * i for i in range(5)])
    window = SimpleNamespace(seconds=1.5, decode_tokens=1.5 / step)  # one request: a token a step
    report = RebalanceReport(1, "decode", 0, 2.0, 1.0)
    report.switch_s = 0.5  # staging done at 10.0, every node past the agreed step at 10.5
    stall = SwitchStall.of(steady, (1.0, 2.5), window, 9.0, report, 10.5)
    assert stall.step_s == pytest.approx(step)
    assert stall.longest_before_s == pytest.approx(step)
    assert stall.longest_staging_s == pytest.approx(0.20)  # 9.80 -> 10.0 of the wait
    assert stall.longest_switch_s == pytest.approx(step)  # 10.0 -> 10.06, and one step a token after
    assert stall.switch_added_steps == pytest.approx(0.0, abs=1e-9)
    assert stall.staging_added_steps == pytest.approx(0.14 / step)
