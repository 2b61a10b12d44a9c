"""`megainfer` command line. Subcommand modules register their arguments cheaply and import
their heavy dependencies (torch, the engine, other packages) only when run."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from megainfer.errors import MegaInferError

# name -> module with register(subparsers); later packages add their commands here.
COMMANDS = {
    "generate": "megainfer.cli.generate",
    "bench": "megainfer.cli.bench",
    "plan": "megainfer.cli.plan",
    "profile": "megainfer.cli.profile",
    "serve": "megainfer.cli.serve",
    "simulate": "megainfer.cli.simulate",
    "simulate-routing": "megainfer.cli.simulate_routing",
    "deploy": "deploy.cli",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megainfer",
        description="Serve Mixture-of-Experts models with attention and experts disaggregated.")
    parser.add_argument("--log-level", default="WARNING", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in COMMANDS.values():
        importlib.import_module(module).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.run(args) or 0
    except MegaInferError as exc:
        print(f"megainfer {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"megainfer {args.command}: interrupted", file=sys.stderr)
        return 130
