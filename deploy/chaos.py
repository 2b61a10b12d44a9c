"""Fault injection for `megainfer bench soak --chaos`: faults at random times while a deployment
serves, each timed from injection until the deployment serves a request again.

The faults (`FaultKind`) are what a cluster does to a serving system: a node's process dies
(attention node, expert node, a tensor-parallel follower), a node stops answering for longer
than its peers wait (SIGSTOP, then SIGCONT: a hung host, a long GC or swap storm), its M2N
connections drop (a network fault), and every client connection to the frontends drops at once
(a load balancer or client restart). Episodes mix single faults with two in a row (the second
right after the first recovered) and a fault during recovery (the second while the deployment
is still re-wiring after the first).

A fault's recovery: from injection until the deployment's nodes all serve again and a probe
request through the frontend completes. Where the deployment takes a while to notice a fault
(a stopped node is noticed when its peers time out), the probe waits for it to be noticed
first, so a probe that slipped through before the fault took effect does not count as recovery.
The bounds each fault is held to are in docs/reliability.md.
"""

from __future__ import annotations

import enum
import logging
import os
import random
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import ray

from deploy.node_link import PEER_TIMEOUT_S
from deploy.node_group import CALL_TIMEOUT_S, NodeGroup
from deploy.supervisor import HEALTH_EVERY_S
from megainfer.messages import FinishReason
from megainfer.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

STOP_FOR_S = PEER_TIMEOUT_S + 5.0  # a stopped node stays stopped longer than its peers wait for it
# Every request in flight when a node fails ends (OK or UNAVAILABLE) within this: a dead peer is
# noticed at once (its connections close), a stopped one after the peers' timeout, a stopped
# attention leader when the supervisor's health call times out.
IN_FLIGHT_END_BOUND_S = PEER_TIMEOUT_S + CALL_TIMEOUT_S + 2 * HEALTH_EVERY_S + 5.0
# From a fault until the deployment serves again: the fault noticed (as above), a killed node's
# process restarted with its weights loaded, every node re-wired. Generous for the tiny CPU plans
# on a shared 2-core machine; a GPU plan's weight loading adds its own time.
RECOVERY_BOUND_S = IN_FLIGHT_END_BOUND_S + 60.0
# How long to wait for the deployment to notice a fault: a hang is noticed when the peers time
# out; a death or a dropped connection at once, unless it missed its mark (a connection dropped
# while the node was being re-wired anyway), and then the deployment served throughout.
NOTICE_TIMEOUT_S = IN_FLIGHT_END_BOUND_S
NOTICE_AT_ONCE_S = 10.0
PROBE_PARAMS = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
PROBE_STALL_S = 30.0


class FaultKind(str, enum.Enum):
    KILL_ATTENTION = "kill_attention"  # an attention leader's process dies (Ray restarts it)
    KILL_EXPERT = "kill_expert"  # an expert leader's process dies
    KILL_TP_FOLLOWER = "kill_tp_follower"  # a tensor-parallel follower rank's process dies
    STOP_NODE = "stop_node"  # SIGSTOP for longer than the peer timeout, then SIGCONT
    DROP_CONNECTION = "drop_connection"  # a node's M2N connections drop
    RESTART_CLIENTS = "restart_clients"  # every client connection to the frontends drops and reconnects

    def __str__(self) -> str:
        return self.value


@dataclass
class FaultRecord:
    kind: FaultKind
    target: str  # the node (or "clients")
    at_s: float  # injected, seconds since the injector started
    bound_s: float  # the recovery bound this fault is held to
    recovery_s: float | None = None  # injection -> serving again; None: not within bound_s
    noticed_s: float | None = None  # injection -> a node reported not serving (None: never seen)
    during_recovery: bool = False  # injected while the previous fault was still recovering
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.recovery_s is not None and self.recovery_s <= self.bound_s

    def to_json(self) -> dict:
        return {"kind": self.kind.value, "target": self.target, "at_s": round(self.at_s, 3),
                "recovery_s": None if self.recovery_s is None else round(self.recovery_s, 3),
                "noticed_s": None if self.noticed_s is None else round(self.noticed_s, 3),
                "bound_s": self.bound_s, "during_recovery": self.during_recovery, "ok": self.ok,
                "detail": self.detail}


class Injection(NamedTuple):
    """A fault just injected, for `Chaos._await_recovery`."""

    record: FaultRecord
    at: float  # time.monotonic() when injected
    resume: threading.Thread | None  # the thread that will SIGCONT a stopped node
    since: int  # recoveries the supervisors had begun before it


@dataclass
class Episode:
    """One fault, or two: the second right after the first recovered (`gap_s` None) or while it
    is still recovering (`gap_s` seconds after the first)."""

    kinds: list[FaultKind]
    gap_s: float | None = None


def available_kinds(group: NodeGroup) -> list[FaultKind]:
    """The faults this deployment's shape allows (no follower to kill without tensor parallelism)."""
    kinds = [FaultKind.KILL_ATTENTION, FaultKind.KILL_EXPERT, FaultKind.STOP_NODE, FaultKind.DROP_CONNECTION,
             FaultKind.RESTART_CLIENTS]
    if group.shards or group.expert_shards:
        kinds.insert(2, FaultKind.KILL_TP_FOLLOWER)
    return kinds


def plan_episodes(kinds: list[FaultKind], rng: random.Random, count: int) -> list[Episode]:
    """`count` episodes covering every kind (shuffled), with one pair in a row and one fault
    during recovery among them once there are at least three."""
    order = list(kinds)
    rng.shuffle(order)
    singles = [order[i % len(order)] for i in range(count + 2)]
    episodes = []
    for i in range(count):
        if i == 1 and count >= 3:
            episodes.append(Episode([singles.pop(0), singles.pop(0)]))  # two faults in a row
        elif i == 2 and count >= 3:
            killers = [k for k in kinds if k in (FaultKind.KILL_EXPERT, FaultKind.KILL_ATTENTION)]
            episodes.append(Episode([rng.choice(killers), FaultKind.DROP_CONNECTION], gap_s=rng.uniform(1.0, 3.0)))
        else:
            episodes.append(Episode([singles.pop(0)]))
    return episodes


@dataclass
class Chaos:
    """Injects faults into `backend` (a Deployment or ReplicaSet) from a thread until stopped.
    `restart_clients` drops and reopens every client connection of the load generator."""

    backend: object
    restart_clients: Callable[[], None]
    seed: int = 0
    duration_s: float = 600.0
    kinds: list[FaultKind] | None = None  # default: every kind the deployment allows
    quiet_s: float = 15.0  # calm between episodes (and before the first), so each is measured alone
    records: list[FaultRecord] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chaos", daemon=True)
        self._t0 = 0.0
        self._probes = 0

    @property
    def group(self) -> NodeGroup:
        return self.backend.groups[0]

    def start(self) -> "Chaos":
        self._t0 = time.monotonic()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(RECOVERY_BOUND_S + STOP_FOR_S + 30)

    def once(self, kind: FaultKind) -> FaultRecord:
        """Inject one fault now and wait for the deployment to recover from it (tests, drills)."""
        if not self._t0:
            self._t0 = time.monotonic()
        injected = self._inject(kind)
        self._await_recovery(injected)
        return injected.record

    def _run(self) -> None:
        kinds = self.kinds or available_kinds(self.group)
        # An episode takes about a quiet spell plus a recovery: fit as many as the run allows,
        # spread over all of it (each in a slot of its own, at a random point of its first half).
        count = max(1, int(self.duration_s // (self.quiet_s + 40.0)))
        last_start = self.duration_s - 30.0  # late enough to see it recover before the end
        slot = max(last_start - self.quiet_s, 0.0) / count
        for i, episode in enumerate(plan_episodes(kinds, self._rng, count)):
            start = self.quiet_s + i * slot + self._rng.uniform(0.0, slot / 2)
            wait = max(start - (time.monotonic() - self._t0), self.quiet_s if i else 0.0)
            if self._stop.wait(wait) or time.monotonic() - self._t0 > last_start:
                return
            try:
                self._episode(episode)
            except Exception:  # the injector must not take the soak down; the record says what happened
                logger.exception("chaos: an episode failed")

    def _episode(self, episode: Episode) -> None:
        first = self._inject(episode.kinds[0])
        if len(episode.kinds) == 1:
            self._await_recovery(first)
            return
        if episode.gap_s is None:  # two in a row: the second as soon as the first recovered
            self._await_recovery(first)
            self._await_recovery(self._inject(episode.kinds[1]))
            return
        time.sleep(episode.gap_s)  # the second while the first is still being recovered from
        second = self._inject(episode.kinds[1], during_recovery=True)
        self._await_recovery(first)
        self._await_recovery(second)

    # -- injecting ------------------------------------------------------------------------------
    def _inject(self, kind: FaultKind, during_recovery: bool = False) -> Injection:
        group = self.group
        since = self._incidents()
        at = time.monotonic()
        resume = None
        if kind is FaultKind.RESTART_CLIENTS:
            target = "clients"
            self.restart_clients()
        elif kind is FaultKind.KILL_ATTENTION:
            target, actor = self._pick(group.attention, group.attention_names)
            ray.kill(actor, no_restart=False)
        elif kind is FaultKind.KILL_EXPERT:
            target, actor = self._pick(group.experts, group.expert_names)
            ray.kill(actor, no_restart=False)
        elif kind is FaultKind.KILL_TP_FOLLOWER:
            followers = group.shards + group.expert_shards
            names = [name for name, _, rank in group.ranks() if rank > 0]
            target, actor = self._pick(followers, names)
            ray.kill(actor, no_restart=False)
        elif kind is FaultKind.DROP_CONNECTION:
            target, actor = self._pick(group.attention + group.experts, group.attention_names + group.expert_names)
            actor.drop_connections.remote()
        elif kind is FaultKind.STOP_NODE:
            target, actor = self._pick(group.attention + group.experts, group.attention_names + group.expert_names)
            pid = ray.get(actor.resources.remote(), timeout=CALL_TIMEOUT_S).pid
            os.kill(pid, signal.SIGSTOP)
            resume = threading.Thread(target=_resume_later, args=(pid, STOP_FOR_S), name="chaos-sigcont", daemon=True)
            resume.start()
        else:
            raise ValueError(f"unknown fault {kind}")
        bound = RECOVERY_BOUND_S + (STOP_FOR_S if kind is FaultKind.STOP_NODE else 0.0)
        record = FaultRecord(kind, target, at - self._t0, bound, during_recovery=during_recovery)
        self.records.append(record)
        logger.warning("chaos: %s on %s at %.1f s", kind, target, record.at_s)
        return Injection(record, at, resume, since)

    def _pick(self, actors: list, names: list[str]) -> tuple[str, object]:
        i = self._rng.randrange(len(actors))
        return names[i], actors[i]

    # -- measuring --------------------------------------------------------------------------------
    def _await_recovery(self, injected: Injection) -> None:
        record, at, resume, since = injected
        deadline = at + record.bound_s
        served_throughout = False
        if record.kind is not FaultKind.RESTART_CLIENTS:
            window = NOTICE_TIMEOUT_S if record.kind is FaultKind.STOP_NODE else NOTICE_AT_ONCE_S
            noticed = self._wait_noticed(since, at + window)
            record.noticed_s = None if noticed is None else noticed - at
            if noticed is None:
                served_throughout = True
                record.detail = (f"no recovery of its own began within {window:g} s: no outage to time (it missed, "
                                 "e.g. a node still restarting from the previous fault, or was absorbed)")
        while time.monotonic() < deadline:
            if self._all_serving() and self._probe(deadline):
                # No outage of its own: 0, once a probe confirmed the deployment serves.
                record.recovery_s = 0.0 if served_throughout else time.monotonic() - at
                break
            time.sleep(0.2)
        if resume is not None:
            resume.join()
        if record.recovery_s is None:
            record.detail = (record.detail + "; " if record.detail else "") + f"not serving within {record.bound_s:g} s"
        logger.warning("chaos: %s on %s: %s", record.kind, record.target,
                       f"serving again after {record.recovery_s:.1f} s" if record.recovery_s is not None
                       else record.detail)

    def _wait_noticed(self, since: int, until: float) -> float | None:
        """When the deployment noticed the fault: a supervisor began a recovery (counted, so a
        recovery quicker than a health poll is not missed) or a node reported not serving."""
        while time.monotonic() < until:
            if self._incidents() > since or not self._all_serving():
                return time.monotonic()
            time.sleep(0.1)
        return None

    def _incidents(self) -> int:
        return sum(s.incidents for s in self.backend.supervisors)

    def _all_serving(self) -> bool:
        return all(h.serving for h in self.backend.health())

    def _probe(self, deadline: float) -> bool:
        """A tiny request through the frontend completes."""
        self._probes += 1
        request_id = f"chaos-probe-{self._probes}"
        try:
            stream = self.backend.submit(request_id, [1, 2, 3], PROBE_PARAMS)
        except Exception as exc:  # refused: not recovered yet
            logger.info("chaos: probe refused: %s", exc)
            return False
        stall = max(1.0, min(PROBE_STALL_S, deadline - time.monotonic()))
        while True:
            delta = stream.get(stall)
            if delta is None:
                self.backend.abort(request_id)
                return False
            if delta.finished:
                return delta.finish_reason is not FinishReason.ERROR


def _resume_later(pid: int, after_s: float) -> None:
    time.sleep(after_s)
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass
