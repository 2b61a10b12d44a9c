"""The software verbs provider (tests/transport/verbs/soft_verbs.cpp) for tests that run the
compiled core's rdma channels without an adapter: building it and the libcuda stand-in with
the C++ compiler that builds the core, and pointing endpoints that choose rdma at its device."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from transport import backends, rdma
from transport import rdma_port as rp

ROOT = Path(__file__).resolve().parents[1]
HERE = ROOT / "tests" / "transport" / "verbs"
SOFT_GID = rp.GidEntry(3, "0000:0000:0000:0000:0000:ffff:0a00:0005", rp.ROCE_V2, "veth0")
SOFT = rp.PortChoice("soft0", 1, rp.LINK_ETHERNET, 0, 5, SOFT_GID)


def compiler() -> str:
    found = shutil.which("g++") or shutil.which("c++")
    if not found:
        pytest.skip("no C++ compiler to build the software verbs provider")
    return found


def shared_library(source: str, out: Path) -> str:
    """tests/transport/verbs/`source` built into the shared library `out`."""
    subprocess.run([compiler(), "-std=c++17", "-O1", "-shared", "-fPIC", f"-I{ROOT / 'transport' / 'csrc'}",
                    str(HERE / source), "-o", str(out)], check=True, capture_output=True)
    return str(out)


def soft_device(monkeypatch, library: str) -> None:
    """Endpoints that choose rdma find the software provider's device: the probe passes on it,
    the port chosen is SOFT's, and the core loads `library`."""
    monkeypatch.setenv("MEGAINFER_LIBIBVERBS", library)
    monkeypatch.setattr(backends.rdma, "probe", lambda **kw: rdma.ProbeResult(True, device="soft0", port=1,
                                                                               gid_index=3, mtu=4096))
    closed = SimpleNamespace(close=lambda: None)  # the pyverbs context select_port would have opened
    monkeypatch.setattr(rdma, "select_port", lambda environ=None, allowed=(): (closed, SOFT))
