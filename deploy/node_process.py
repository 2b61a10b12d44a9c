"""How a node actor's process runs: the priority of its threads, and on a CPU plan the core
they are pinned to.

Priority. Ray's raylet starts worker processes at nice 15 (`worker_niceness`), so that the
raylet and GCS stay responsive on a busy host. A node's step loop is the serving hot path:
at nice 15 any nice-0 process on its core (the driver's frontend, Ray's daemons) takes
nearly all of the core from it (CFS weights 1024 against 36), and the pipeline stalls behind
it. A node's threads are set back to nice 0 where the OS allows it (root or CAP_SYS_NICE);
`connect_ray` also asks a Ray it starts for nice-0 workers. Linux keeps a nice value per
thread, so every thread of the process is set (threads started later inherit it).

Cores. On a CPU plan every rank computes with one thread (`num_threads` 1), and the
ping-pong keeps an attention rank and an expert rank busy at the same time. Left to the OS
scheduler, a rank migrates between cores, losing its caches (an expert node's packed
weights, an attention node's KV blocks), and two ranks may share a core while another idles.
So each rank pins every thread of its process (the step loop, the transport's, Ray's) to
the core its slot names, counted among the cores the process may use. With more ranks than
cores nothing is pinned: the OS balances an oversubscribed host better than a fixed map.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)


def _threads() -> list[int]:
    try:
        return [int(tid) for tid in os.listdir("/proc/self/task")]
    except OSError:
        return [0]


def restore_priority(name: str) -> bool:
    """Every thread of this process to nice 0 (from Ray's 15); False where not permitted."""
    if not hasattr(os, "setpriority"):
        return False
    for tid in _threads():
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) > 0:
                os.setpriority(os.PRIO_PROCESS, tid, 0)
        except PermissionError:
            logger.warning("%s: runs at nice %d (Ray's worker niceness) and may not lower it: give the container "
                           "CAP_SYS_NICE, or start Ray with RAY_worker_niceness=0", name, os.nice(0))
            return False
        except OSError:  # a thread that ended meanwhile (ProcessLookupError)
            continue
    return True


def pin_process(slot: int, ranks: int, name: str) -> int | None:
    """Pin this process's threads to core `slot` of `ranks` CPU ranks on the host; returns the
    core, or None where the OS does not allow it or the host has fewer cores than ranks."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    allowed = sorted(os.sched_getaffinity(0))
    if ranks > len(allowed) or not 0 <= slot < len(allowed):
        logger.info("%s: %d CPU ranks on %d cores: not pinned", name, ranks, len(allowed))
        return None
    core = allowed[slot]
    for tid in _threads():
        try:
            os.sched_setaffinity(tid, {core})
        except OSError:  # a thread that ended meanwhile
            pass
    logger.info("%s: pinned to core %d", name, core)
    return core


def resident_bytes() -> int:
    """This process's resident memory (RSS), from /proc; 0 where the OS has no /proc."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def settle(runtime, rank: int, name: str) -> int | None:
    """A node actor's first act: its threads at nice 0, and pinned to a core where its runtime
    (AttentionRuntime or ExpertRuntime of a CPU plan) gives core slots. Returns the core."""
    restore_priority(name)
    if not runtime.cpu_slots:
        return None
    return pin_process(runtime.cpu_slots[rank], runtime.cpu_ranks, name)
