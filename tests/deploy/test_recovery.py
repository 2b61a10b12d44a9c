"""Recovery of a deployment after a fault, at the level of the frontend and the node group:
requests that arrive during a recovery wait for it instead of failing; a tensor-parallel side
is restarted whole and serves again; every node reports its resources (blocks, slots, memory)
and an idle deployment holds none. One Ray session for the module."""

from __future__ import annotations

import time

import pytest

ray = pytest.importorskip("ray")

from deploy.chaos import Chaos, FaultKind, plan_episodes  # noqa: E402
from deploy.deployment import Deployment  # noqa: E402
from deploy.frontend import DownNodes  # noqa: E402
from megainfer import SamplingParams  # noqa: E402
from megainfer.errors import DataPlaneError, PlanError  # noqa: E402
from megainfer.messages import FinishReason, NodeLoad, NodeRole  # noqa: E402
from megainfer.plan import Plan  # noqa: E402

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


pytestmark = pytest.mark.usefixtures("ray_session")  # one Ray session for the module (conftest.py)


def make_plan(tp_e: int = 1, recovery_wait_s: float = 60.0) -> Plan:
    return Plan.from_dict({
        "model": "tiny-mixtral", "dtype": "float32",
        "attention": {"gpu": "cpu", "tp": 1, "nodes": 1},
        "experts": {"gpu": "cpu", "tp": tp_e, "nodes": 1},
        "pipeline": {"micro_batches": 1, "global_batch": 16},
        "scheduler": {"max_num_seqs": 8, "max_num_batched_tokens": 64},
        "serve": {"recovery_wait_s": recovery_wait_s},
    })


def finish(stream, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        delta = stream.get(1.0)
        if delta is not None and delta.finished:
            return delta
    raise AssertionError("the request did not end")


def wait_serving(deployment, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(h.serving for h in deployment.health()):
            return
        time.sleep(0.2)
    raise AssertionError(f"not serving after {timeout_s} s: {deployment.health()}")


def idle_resources(deployment, timeout_s: float = 20.0):
    """Every rank's resources once nothing is held (or the last reading, for the assertion)."""
    deadline = time.monotonic() + timeout_s
    while True:
        resources = deployment.resources()
        if all(r.kv_blocks_used == 0 and r.slots_held == 0 and r.slots_unreleased == 0 for r in resources) \
                or time.monotonic() > deadline:
            return resources
        time.sleep(0.2)


@pytest.fixture(scope="module")
def deployment(ray_session):
    """One attention node and one expert node, shared by the tests that recover it."""
    deployment = Deployment(make_plan(), show_progress=False).start()
    yield deployment
    deployment.close()


def test_a_request_arriving_during_recovery_waits_for_it_and_nothing_is_left_held(deployment):
    ray.kill(deployment.experts[0], no_restart=False)
    # Arrives while the expert node restarts and the group re-wires: it waits, then runs.
    wait_start = time.monotonic()
    while all(h.serving for h in deployment.health()) and time.monotonic() - wait_start < 20:
        time.sleep(0.05)  # the deployment has noticed
    assert not all(h.serving for h in deployment.health())
    delta = finish(deployment.submit("during-recovery", [1, 2, 3], GREEDY))
    assert delta.finish_reason is not FinishReason.ERROR, delta.error
    wait_serving(deployment)
    resources = idle_resources(deployment)
    roles = {r.role for r in resources}
    assert roles == {NodeRole.ATTENTION, NodeRole.EXPERT}
    assert all(r.pid > 0 and r.rss_bytes > 0 for r in resources)
    attention = [r for r in resources if r.role is NodeRole.ATTENTION]
    assert attention[0].kv_blocks_total > 0 and attention[0].kv_blocks_used == 0
    assert sum(r.slots_held + r.slots_unreleased for r in resources) == 0


def test_without_a_recovery_wait_a_request_during_recovery_fails_at_once_with_unavailable(deployment):
    wait_serving(deployment)
    deployment.frontend.recovery_wait_s = 0.0  # as plan serve.recovery_wait_s: 0 sets it
    try:
        # Re-wiring from its return on, until the supervisor (every 0.5 s) wires it again: waited
        # for, and the request sent at once, so neither a slow actor nor a quick re-wiring races it.
        ray.get(deployment.group.attention[0].interrupt.remote())
        start = time.monotonic()
        with pytest.raises(DataPlaneError, match="re-wiring"):
            deployment.submit("refused", [1, 2, 3], GREEDY)
        assert time.monotonic() - start < 5
        wait_serving(deployment)
    finally:
        deployment.frontend.recovery_wait_s = 60.0


def test_a_killed_tensor_parallel_follower_restarts_its_side_and_the_deployment_serves_again():
    deployment = Deployment(make_plan(tp_e=2), show_progress=False).start()
    try:
        before = {r.name: r.pid for r in deployment.resources()}
        chaos = Chaos(deployment, restart_clients=lambda: None)
        record = chaos.once(FaultKind.KILL_TP_FOLLOWER)
        assert record.target == "expert0.1" and record.ok, record.to_json()
        after = {r.name: r.pid for r in deployment.resources()}
        # The whole expert side came back in new processes; the attention node kept its own.
        assert after["expert0"] != before["expert0"] and after["expert0.1"] != before["expert0.1"]
        assert after["attention0"] == before["attention0"]
        delta = finish(deployment.submit("after", [4, 5, 6], GREEDY))
        assert delta.finish_reason is not FinishReason.ERROR, delta.error
    finally:
        deployment.close()


def test_chaos_episodes_cover_every_kind_with_a_pair_in_a_row_and_one_during_recovery():
    import random

    kinds = list(FaultKind)
    episodes = plan_episodes(kinds, random.Random(3), 8)
    seen = {k for e in episodes for k in e.kinds}
    assert seen == set(kinds)
    assert any(len(e.kinds) == 2 and e.gap_s is None for e in episodes)
    during = [e for e in episodes if e.gap_s is not None]
    assert len(during) == 1 and 1.0 <= during[0].gap_s <= 3.0
    assert plan_episodes(kinds, random.Random(3), 1)[0].kinds[0] in kinds


def test_a_plan_with_a_bad_recovery_wait_is_refused_naming_the_key():
    with pytest.raises(PlanError, match="serve.recovery_wait_s"):
        make_plan(recovery_wait_s=-1)


def test_a_request_the_router_sends_to_a_down_node_goes_to_the_freest_node_that_serves():
    loads = [NodeLoad(1000, used_tokens=100), NodeLoad(1000, used_tokens=900), NodeLoad(1000, used_tokens=500)]
    down = DownNodes()
    assert down.steer(0, loads) is None  # every node up: the router's choice stands
    down.mark(0)
    assert down.steer(0, loads) == 2  # node 0 refused a request lately: the freest other node
    assert down.steer(1, loads) is None  # a choice that is up stands
    for node in (1, 2):
        down.mark(node)
    assert down.steer(0, loads) is None  # none up: the request waits for its node
