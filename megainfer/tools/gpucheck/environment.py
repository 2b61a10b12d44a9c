"""The `environment` check: what the GPU machine is, whether Triton can build there, and the
compiled M2N core (built in place where pip did not build it: the GPU machine has no package
registry, but has setuptools, pybind11 and g++)."""

from __future__ import annotations

import importlib
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from megainfer.tools.gpucheck.context import CheckContext


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except ImportError:
        return None


def _distribution_version(name: str) -> str | None:
    """An installed distribution's version (not a module's: the module name may be shadowed)."""
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
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


def build_m2n_core(root: Path) -> tuple[bool, str]:
    """`python setup.py build_ext --inplace` in the checkout `root`; (built, what it said)."""
    try:
        done = subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=root, capture_output=True,
                              text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, str(exc)
    said = (done.stderr or done.stdout).strip().splitlines()
    return done.returncode == 0, "\n".join(said[-6:])


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
    with ctx.case("transformers loads models beside this checkout's kernels package") as case:
        case.figures["hf_kernels"] = _distribution_version("kernels")
        try:
            importlib.import_module("transformers.modeling_utils")
        except ImportError as exc:
            if "kernels" not in str(exc):  # transformers itself cannot load: the engine check skips its cases too
                case.skip(f"transformers cannot be imported here ({exc})")
            else:
                raise RuntimeError(
                    f"transformers {_version('transformers')} imports Hugging Face's `kernels` "
                    f"{case.figures['hf_kernels']} with every model, and this checkout's top-level `kernels` package "
                    "shadows it, so the engine and pair checks cannot build their transformers references: use "
                    "transformers below 5.25 (its `kernels` is optional: pip uninstall kernels) "
                    "(docs/architecture.md, 'Departures')") from exc
    with ctx.case("Triton can build its launcher (a C compiler)") as case:
        compiler = _c_compiler()
        case.figures["cc"] = compiler
        if compiler is None:
            raise RuntimeError("no C compiler (CC, cc, gcc, clang): Triton compiles its launcher at the first kernel "
                               "launch and fails without one; install gcc")
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=10).stdout
        case.figures["cc_version"] = version.splitlines()[0] if version else ""
    with ctx.case("the compiled M2N core (built here if missing)") as case:
        from transport import core

        case.figures["built_before"] = core.native is not None
        if core.native is None:
            t0 = time.monotonic()
            built, said = build_m2n_core(Path(core.__file__).resolve().parent.parent)
            case.figures["build_s"] = round(time.monotonic() - t0, 1)
            importlib.invalidate_caches()
            importlib.reload(core)  # the pair check's nodes, spawned later, import it afresh
            if not built or core.native is None:
                raise RuntimeError(f"the M2N core did not build, so the pair check runs the pure-Python path: {said}"
                                   f" ({core.BUILD_ERROR})")
        case.figures["m2n"] = "core"
