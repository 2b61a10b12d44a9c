"""`python -m megainfer.gpucheck` as the GPU machine runs it: from the checkout with
PYTHONPATH=., on a package set without Ray, FastAPI, uvicorn, pydantic, httpx2, gRPC's health
and reflection services, NIXL or pyverbs. Here an import hook (a sitecustomize.py on
PYTHONPATH, so every child process has it too) makes those unimportable, and the check runs on
the CPU (`--device cpu`): small shapes, Triton's interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from megainfer.tools.gpucheck.records import JSONL, SUMMARY, CheckRecord, Status
from tests.helpers import ROOT

ABSENT_ON_THE_GPU_MACHINE = ("ray", "fastapi", "uvicorn", "pydantic", "httpx2", "grpc_health", "grpc_reflection",
                             "nixl_cu12", "pyverbs")
HOOK = f'''
import importlib.abc
import sys

ABSENT = {ABSENT_ON_THE_GPU_MACHINE!r}


class Absent(importlib.abc.MetaPathFinder):
    """As if these packages were not installed."""

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ABSENT:
            raise ModuleNotFoundError(f"No module named {{name!r}} (made absent for the GPU check's test)", name=name)
        return None


sys.meta_path.insert(0, Absent())
'''


@pytest.fixture(scope="module")
def gpu_machine_env(tmp_path_factory) -> dict[str, str]:
    """The environment of a process (and its children) where those packages cannot be imported."""
    hook_dir = tmp_path_factory.mktemp("absent-packages")
    (hook_dir / "sitecustomize.py").write_text(HOOK)
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "MEGAINFER_KERNELS")}
    env["PYTHONPATH"] = os.pathsep.join([str(hook_dir), str(ROOT)])
    return env


def _records(out) -> list[CheckRecord]:
    return [CheckRecord.from_json(line) for line in (out / JSONL).read_text().splitlines()]


def test_the_hook_makes_the_packages_absent(gpu_machine_env):
    for name in ABSENT_ON_THE_GPU_MACHINE:
        out = subprocess.run([sys.executable, "-c", f"import {name}"], capture_output=True, text=True,
                             env=gpu_machine_env, timeout=60)
        assert out.returncode != 0 and "made absent" in out.stderr, name


def test_gpucheck_runs_on_the_cpu_without_the_serving_packages(gpu_machine_env, tmp_path):
    out = subprocess.run([sys.executable, "-m", "megainfer.gpucheck", "--device", "cpu", "--out", str(tmp_path)],
                         capture_output=True, text=True, env=gpu_machine_env, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr + (tmp_path / "gpucheck.log").read_text()
    assert out.stdout.startswith("megainfer GPU check on cpu: budget 420 s")  # the plan comes first
    records = _records(tmp_path)
    checks = {r.check for r in records}
    assert checks == {"environment", "kernels", "engine", "pair", "graphs", "memory", "kernel_bench"}
    assert not [r for r in records if r.status in (Status.FAILED, Status.NOT_RUN)]
    passed = {(r.check, r.case) for r in records if r.status is Status.PASSED}
    assert any(check == "kernels" and case.startswith("pod ") for check, case in passed)
    assert any(check == "pair" and "m = 2" in case for check, case in passed)
    assert any(check == "graphs" and case.startswith("attention half") for check, case in passed)
    summary = (tmp_path / SUMMARY).read_text()
    assert "| kernels | decode gqa4" in summary and "| pair |" in summary


def test_the_engine_check_passes_against_transformers_on_the_cpu(tmp_path):
    """Where the serving packages are absent (above), transformers cannot be imported here (this
    huggingface_hub needs httpx2; the GPU machine's needs httpx) and the engine check skips its
    transformers cases. Here it runs them: every family, float32 equal, bfloat16 up to rounding."""
    from megainfer.tools.gpucheck.tiny_checkpoints import KINDS

    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "MEGAINFER_KERNELS")}
    out = subprocess.run([sys.executable, "-m", "megainfer.gpucheck", "--device", "cpu", "--out", str(tmp_path),
                          "--checks", "engine"], capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    passed = {r.case.split(":")[0] for r in _records(tmp_path) if r.check == "engine" and r.status is Status.PASSED}
    assert {f"{kind} {dtype}" for kind in KINDS for dtype in ("float32", "bfloat16")} <= passed, passed


def test_a_short_budget_ends_inside_it_with_what_finished(gpu_machine_env, tmp_path):
    budget = 20
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "megainfer.gpucheck", "--device", "cpu", "--out", str(tmp_path),
                          "--budget-s", str(budget)], capture_output=True, text=True, env=gpu_machine_env, timeout=120,
                         cwd=ROOT)
    elapsed = time.monotonic() - start
    assert out.returncode == 2, out.stdout + out.stderr  # nothing failed, some checks cut off
    assert elapsed < budget + 3  # the interpreter's own start, before the budget's clock
    records = _records(tmp_path)
    assert [r for r in records if r.status is Status.PASSED]  # what finished is kept
    assert [r for r in records if r.status is Status.NOT_RUN]  # and what did not is said
    assert "not run" in (tmp_path / SUMMARY).read_text()
    assert "the budget" in out.stdout


def test_the_gpu_tests_collect_without_the_serving_packages(gpu_machine_env):
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "gpu", "-p",
                          "no:cacheprovider"], capture_output=True, text=True, env=gpu_machine_env, timeout=300,
                         cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "error" not in out.stdout.splitlines()[-1]


def test_the_m2n_core_build_says_why_it_failed(tmp_path):
    from megainfer.tools.gpucheck.environment import build_m2n_core

    built, said = build_m2n_core(tmp_path)  # no setup.py there
    assert not built and "setup.py" in said


@pytest.mark.slow
def test_the_m2n_core_builds_in_place_from_the_checkout(tmp_path):
    """What the GPU check does where pip did not build the core (~12 s of g++)."""
    import shutil

    from megainfer.tools.gpucheck.environment import build_m2n_core
    from tests.helpers import ROOT

    shutil.copy(ROOT / "setup.py", tmp_path / "setup.py")
    shutil.copytree(ROOT / "transport" / "csrc", tmp_path / "transport" / "csrc")
    built, said = build_m2n_core(tmp_path)
    assert built, said
    assert list((tmp_path / "transport").glob("_m2n_core*.so"))


TRANSFORMERS_CASE = "transformers loads models beside this checkout's kernels package"


def _environment_where_transformers_raises(monkeypatch, tmp_path, error: ImportError) -> dict:
    """The environment check run where importing transformers' models raises `error`: its records by case."""
    import importlib

    import torch

    from megainfer.tools.gpucheck import environment
    from megainfer.tools.gpucheck.context import CheckContext
    from megainfer.tools.gpucheck.records import RecordLog

    real = importlib.import_module

    def failing(name, *args):
        if name == "transformers.modeling_utils":
            raise error
        return real(name, *args)

    monkeypatch.setattr(environment.importlib, "import_module", failing)
    environment.run(CheckContext("environment", torch.device("cpu"), tmp_path, float("inf")))
    return {r.case: r for r in RecordLog(tmp_path).read()}


def test_the_environment_check_names_a_transformers_that_imports_hugging_faces_kernels(monkeypatch, tmp_path):
    """transformers 5.25 imports Hugging Face's `kernels` with every model; from a checkout ours
    shadows it. The check fails that case naming the collision and the fix, and goes on."""
    records = _environment_where_transformers_raises(monkeypatch, tmp_path, ImportError(
        "cannot import name 'CUDAProperties' from 'kernels' (/checkout/kernels/__init__.py)"))
    failed = records[TRANSFORMERS_CASE]
    assert failed.status is Status.FAILED
    assert "shadows it" in failed.detail and "transformers below 5.25" in failed.detail
    assert records["the compiled M2N core (built here if missing)"].status is Status.PASSED  # the check went on


def test_the_environment_check_skips_where_transformers_itself_cannot_load(monkeypatch, tmp_path):
    """Without transformers' own dependencies (the serving packages hidden above) that case is a
    skip, as the engine check's transformers cases are, not a failure."""
    records = _environment_where_transformers_raises(monkeypatch, tmp_path,
                                                     ModuleNotFoundError("No module named 'httpx2'"))
    assert records[TRANSFORMERS_CASE].status is Status.SKIPPED
