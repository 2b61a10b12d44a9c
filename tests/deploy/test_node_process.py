"""How a node actor's process settles (deploy/node_process.py): every thread pinned to its
slot's core, nothing pinned on an oversubscribed host or without core slots, every thread
back to nice 0; and the core slots `runtime_of` hands a CPU plan's ranks (none on GPUs).

Pinning and priority change the calling process, so each case runs in a child process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from deploy.runtime_config import runtime_of
from megainfer.plan import Plan
from tests.helpers import ROOT

ALLOWED = sorted(os.sched_getaffinity(0))

# Runs in the child before each case: a second thread, alive until the case has reported, and
# `report`, which prints the case's findings as JSON.
PRELUDE = """
import json, os, threading
from types import SimpleNamespace
from deploy.node_process import pin_process, restore_priority, settle

started, stop, ids = threading.Event(), threading.Event(), []
def _park():
    ids.append(threading.get_native_id())
    started.set()
    stop.wait()
worker = threading.Thread(target=_park)
worker.start()
started.wait()
main_id, worker_id = threading.get_native_id(), ids[0]

def report(**found):
    print(json.dumps(found))
    stop.set()
    worker.join()
"""


def in_child(case: str) -> dict:
    code = textwrap.dedent(PRELUDE) + textwrap.dedent(case)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def affinity_case(call: str) -> str:
    return f"""
    core = {call}
    report(core=core, main=sorted(os.sched_getaffinity(main_id)), worker=sorted(os.sched_getaffinity(worker_id)))
    """


@pytest.mark.parametrize("slot", range(min(2, len(ALLOWED))))
def test_pin_process_pins_every_thread_to_its_slots_core(slot):
    found = in_child(affinity_case(f'pin_process({slot}, 1, "t")'))
    core = ALLOWED[slot]
    assert found == {"core": core, "main": [core], "worker": [core]}


def test_more_ranks_than_cores_pins_nothing():
    found = in_child(affinity_case(f'pin_process(0, {len(ALLOWED) + 1}, "t")'))
    assert found == {"core": None, "main": ALLOWED, "worker": ALLOWED}


def test_settle_without_core_slots_pins_nothing():
    found = in_child(affinity_case('settle(SimpleNamespace(cpu_slots=(), cpu_ranks=0), 0, "t")'))
    assert found == {"core": None, "main": ALLOWED, "worker": ALLOWED}


@pytest.mark.skipif(len(ALLOWED) < 2, reason="needs two cores this process may use")
def test_settle_pins_to_the_slot_of_its_rank():
    found = in_child(affinity_case('settle(SimpleNamespace(cpu_slots=(1, 0), cpu_ranks=2), 1, "t")'))
    assert found == {"core": ALLOWED[0], "main": [ALLOWED[0]], "worker": [ALLOWED[0]]}


@pytest.mark.skipif(os.geteuid() != 0, reason="lowering a nice value needs root (or CAP_SYS_NICE)")
def test_restore_priority_sets_every_thread_back_to_nice_0():
    found = in_child("""
    os.nice(5)  # this thread only (Linux keeps a nice value per thread) ...
    os.setpriority(os.PRIO_PROCESS, worker_id, 5)
    late_started, late_ids = threading.Event(), []
    late = threading.Thread(target=lambda: (late_ids.append(threading.get_native_id()), late_started.set(),
                                            stop.wait()))
    late.start()  # ... and the threads it starts from now on
    late_started.wait()
    tids = (main_id, worker_id, late_ids[0])
    before = [os.getpriority(os.PRIO_PROCESS, tid) for tid in tids]
    ok = restore_priority("t")
    report(ok=ok, before=before, after=[os.getpriority(os.PRIO_PROCESS, tid) for tid in tids])
    late.join()
    """)
    assert found == {"ok": True, "before": [5, 5, 5], "after": [0, 0, 0]}


@pytest.mark.skipif(os.geteuid() != 0, reason="lowering a nice value needs root (or CAP_SYS_NICE)")
def test_a_thread_that_ended_meanwhile_does_not_stop_restore_priority():
    found = in_child("""
    import deploy.node_process as node_process
    listed = node_process._threads()
    node_process._threads = lambda: [2**31 - 1, *listed]  # no such thread: it ended meanwhile
    for tid in (main_id, worker_id):
        os.setpriority(os.PRIO_PROCESS, tid, 5)
    ok = restore_priority("t")
    report(ok=ok, after=[os.getpriority(os.PRIO_PROCESS, tid) for tid in (main_id, worker_id)])
    """)
    assert found == {"ok": True, "after": [0, 0]}


def test_a_cpu_plan_gives_each_rank_its_core_slot():
    runtime = runtime_of(Plan.load(ROOT / "deploy" / "plans" / "tiny-cpu.yaml"))
    (attention,), (expert,) = runtime.attention, runtime.experts
    assert (attention.cpu_slots, attention.cpu_ranks) == ((0,), 2)
    assert (expert.cpu_slots, expert.cpu_ranks) == ((1,), 2)


def test_a_gpu_plan_pins_nothing_and_its_rehearsal_counts_every_rank():
    plan = Plan.load(ROOT / "deploy" / "plans" / "mixtral-8x22b-h800.yaml")  # attention tp 4 x 2, experts 8
    runtime = runtime_of(plan)
    assert runtime.device == "cuda"
    for node in (*runtime.attention, *runtime.experts):
        assert (node.cpu_slots, node.cpu_ranks) == ((), 0)
    rehearsal = runtime_of(plan, "cpu")
    assert [a.cpu_slots for a in rehearsal.attention] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert [e.cpu_slots for e in rehearsal.experts] == [(8 + k,) for k in range(8)]
    assert {n.cpu_ranks for n in (*rehearsal.attention, *rehearsal.experts)} == {16}
