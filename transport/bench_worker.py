"""A benchmark process's entry point: the role it was given, run by M2N's, torch's or a floor's
loop (transport/bench_loop.py, transport/bench_floor.py), its report sent to the parent."""

from __future__ import annotations

import json

from transport.bench_floor import FLOOR_RUNNERS
from transport.bench_loop import run_m2n, run_torch
from transport.bench_spec import BenchSpec, Role


def worker(role_json: str, conn) -> None:
    """A benchmark process's entry point: run the role, report, never hang the parent."""
    role = Role(**json.loads(role_json))
    spec = BenchSpec(**role.spec)
    try:
        if role.system == "floor":
            runner = FLOOR_RUNNERS[spec.backend]
        else:
            runner = {"m2n": run_m2n, "torch": run_torch}[role.system]
        runner(role, spec, conn)
    except BaseException as exc:
        conn.send_bytes(json.dumps({"error": f"{role.name}: {type(exc).__name__}: {exc}"}).encode())
    finally:
        conn.close()
