"""One check in a process of its own: `python -m megainfer.tools.gpucheck.child NAME --device D
--out DIR --deadline T` (the runner starts it; see the package's docstring for why)."""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

import torch

from megainfer.tools.gpucheck.context import CheckContext

# The check's name -> its module, imported only in its own process.
MODULES = {"environment": "megainfer.tools.gpucheck.environment",
           "kernels": "megainfer.tools.gpucheck.kernel_checks",
           "engine": "megainfer.tools.gpucheck.engine_check",
           "pair": "megainfer.tools.gpucheck.pair_check",
           "graphs": "megainfer.tools.gpucheck.graph_check",
           "memory": "megainfer.tools.gpucheck.memory_check",
           "kernel_bench": "megainfer.tools.gpucheck.kernel_bench"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megainfer.tools.gpucheck.child")
    parser.add_argument("name", choices=sorted(MODULES))
    parser.add_argument("--device", required=True, choices=("cuda", "cpu"))
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--deadline", required=True, type=float, help="time.time() to stop by")
    args = parser.parse_args(argv)
    context = CheckContext(args.name, torch.device(args.device), args.out, args.deadline)
    importlib.import_module(MODULES[args.name]).run(context)
    return 0


if __name__ == "__main__":
    sys.exit(main())
