"""The host's CPU time per M2N round, as the planner charges it (issue 31).

A (layer, micro-batch) is one round each way: an attention rank posts to its N expert nodes
and collects their answers; an expert node collects from its M attention ranks and answers
each. Its host cost is work the GPU does not hide: if a round takes the host longer than the
micro-batch's compute (T_a on the attention side, T_e on the expert side), the host sets the
pace. The model is linear, per side:

    round_s = per_peer_s * peers + per_byte_s * bytes
    bytes   = 2 * peers * message_bytes     (each message out, and its answer back, through host memory)

fitted from a `megainfer bench host PLAN --json PATH` file (the compiled core's rows): its
4 KiB round at the plan's peers gives the per-peer cost, its round at the plan's own message
size the per-byte cost. The file is the profile, stored as the tool writes it, like an
operator profile; `megainfer plan --host-profile PATH` charges it. A profile says what host
it was measured on: one measured on a small VM overstates a GPU server's host.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from megainfer.errors import PlanError
from planner.json_file import read_json_file

SIDES = ("attention", "expert")


@dataclass(frozen=True)
class SideCost:
    per_peer_s: float
    per_byte_s: float

    def round_s(self, peers, message_bytes):
        """Seconds of one round with `peers` peers and messages of `message_bytes` (numpy-broadcast)."""
        return self.per_peer_s * peers + self.per_byte_s * 2 * peers * message_bytes


@dataclass(frozen=True)
class HostCost:
    source: str  # the file it came from, and what it was measured on
    attention: SideCost
    expert: SideCost

    @classmethod
    def load(cls, path: str | os.PathLike) -> "HostCost":
        path = Path(path)
        fix = "write one with `megainfer bench host PLAN --json PATH`"
        data = read_json_file(path, f"--host-profile {str(path)!r}", fix)
        if data.get("benchmark") != "host":
            raise PlanError(f"{path}: not a `megainfer bench host` result (its 'benchmark' is not 'host'); {fix}")
        sides = {side: _fit(path, data, side) for side in SIDES}
        where = data.get("machine") or "an unrecorded host"
        return cls(f"{path} ({where})", sides["attention"], sides["expert"])


def _fit(path: Path, data: dict, side: str) -> SideCost:
    """per-peer and per-byte costs from the core's two rounds of `side` (4 KiB and the plan's size)."""
    try:
        small, large = (data[f"{side}_round_cpu_us{suffix}"]["core"] for suffix in ("", "_plan_size"))
        points = [(float(r["cpu_us"]) * 1e-6, int(r["peers"]), int(r["message_bytes"])) for r in (small, large)]
    except (KeyError, TypeError, ValueError):
        raise PlanError(f"{path}: {side}_round_cpu_us and {side}_round_cpu_us_plan_size need a 'core' row with cpu_us, "
                        "peers and message_bytes (a bench host result of this version: rerun it)") from None
    (s_small, peers, b_small), (s_large, peers_large, b_large) = points
    if peers != peers_large or peers <= 0 or b_large <= b_small or min(s_small, s_large) <= 0:
        raise PlanError(f"{path}: the {side} rounds must share their peers and differ in message size "
                        f"(got {peers} and {peers_large} peers, {b_small} and {b_large} bytes)")
    per_byte = max(0.0, (s_large - s_small) / (2 * peers * (b_large - b_small)))
    per_peer = max(0.0, (s_small - per_byte * 2 * peers * b_small) / peers)
    return SideCost(per_peer, per_byte)


def host_bound(t_a, t_e, host_a, host_e) -> np.ndarray:
    """Rows whose rounds the host cannot post within the micro-batch's compute."""
    return (np.asarray(host_a) > np.asarray(t_a)) | (np.asarray(host_e) > np.asarray(t_e))
