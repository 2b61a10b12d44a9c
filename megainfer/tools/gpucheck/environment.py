"""The `environment` check: what the GPU machine is, and whether Triton can build there."""

from __future__ import annotations

import platform
import shutil
import subprocess

import torch

from megainfer.tools.gpucheck.context import CheckContext


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except ImportError:
        return None


def _driver() -> str | None:
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        version = pynvml.nvmlSystemGetDriverVersion()
    except pynvml.NVMLError:
        return None
    return version.decode() if isinstance(version, bytes) else version


def _c_compiler() -> str | None:
    """The compiler Triton's launcher build finds (its `CC`, else cc/gcc/clang on PATH)."""
    import os

    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def run(ctx: CheckContext) -> None:
    with ctx.case("versions and device") as case:
        f = case.figures
        f |= {"python": platform.python_version(), "torch": torch.__version__, "triton": _version("triton"),
              "transformers": _version("transformers"), "numpy": _version("numpy"), "cpu": platform.processor()
              or platform.machine(), "cpus": __import__("os").cpu_count()}
        if ctx.on_gpu:
            props = torch.cuda.get_device_properties(ctx.device)
            f |= {"gpu": props.name, "sms": props.multi_processor_count, "memory_gib": round(props.total_memory / 2 ** 30, 2),
                  "compute_capability": f"{props.major}.{props.minor}", "cuda": torch.version.cuda,
                  "driver": _driver(), "gpus_visible": torch.cuda.device_count()}
    with ctx.case("Triton can build its launcher (a C compiler)") as case:
        compiler = _c_compiler()
        case.figures["cc"] = compiler
        if compiler is None:
            raise RuntimeError("no C compiler (CC, cc, gcc, clang): Triton compiles its launcher at the first kernel "
                               "launch and fails without one; install gcc")
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=10).stdout
        case.figures["cc_version"] = version.splitlines()[0] if version else ""
