"""`megainfer serve`: one colocated engine behind the gRPC frontend and the OpenAI-compatible
HTTP API (no Ray)."""

from __future__ import annotations

import argparse
import sys

from megainfer.cli.options import add_engine_options, engine_config
from megainfer.server.frontend_options import add_frontend_options, frontend_access, wait_for_signal

def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve one colocated engine over gRPC and an OpenAI-compatible HTTP API "
                                     "(no Ray, no disaggregation)")
    add_engine_options(p)
    p.add_argument("--host", default="127.0.0.1", help="bind address (gRPC, and HTTP unless --http-host)")
    p.add_argument("--port", type=int, default=50051, help="gRPC port (0: any free port)")
    add_frontend_options(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from megainfer.engine.engine import Engine
    from megainfer.server.endpoints import Endpoints
    from megainfer.server.engine_backend import EngineBackend
    from megainfer.server.served_model import ServedModel

    # Before the weights load: a bad --chat-template, --served-model-name, key or TLS file fails at once.
    served = ServedModel.load(args.model, args.served_model_name, args.chat_template, args.max_model_len)
    access, tls = frontend_access(args)
    backend = EngineBackend(Engine(args.model, engine_config(args, show_progress=True)))
    served.max_model_len = backend.engine.max_model_len
    try:
        endpoints = Endpoints(backend, served, args.host, args.port, args.http_host,
                              None if args.no_http else args.http_port, args.metrics_port, access=access,
                              tls=tls).start()
    except BaseException:
        backend.close()
        raise
    print(f"serving {args.model}:", file=sys.stderr)
    report = backend.engine.runner.kernels  # decided at the engine's start (kernels/startup.py)
    for line in endpoints.describe() + report.lines():
        print(f"  {line}", file=sys.stderr)
    try:
        wait_for_signal()
    finally:
        endpoints.stop()
        backend.close()
    return 0
