"""`megainfer serve`: one colocated engine behind the gRPC frontend (no Ray)."""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from megainfer.cli.options import add_engine_options, engine_config


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve one colocated engine over gRPC (no Ray, no disaggregation)")
    add_engine_options(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50051)
    p.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus metrics on this HTTP port")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from megainfer.engine import Engine
    from megainfer.server.engine_backend import EngineBackend
    from megainfer.server.service import Server

    backend = EngineBackend(Engine(args.model, engine_config(args, show_progress=True)))
    server = Server(backend, host=args.host, port=args.port, metrics_port=args.metrics_port).start()
    print(f"serving {args.model} on {server.address}", file=sys.stderr)
    if server.metrics_port is not None:
        print(f"metrics on http://{args.host}:{server.metrics_port}/metrics", file=sys.stderr)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(0.5):
        pass
    server.stop()
    backend.close()
    return 0
