"""Triton's interpreter or its compiler, once for the session: `@triton.jit` picks one when a
kernel module is first imported, so the choice is made here, before any test module imports
one (test modules are imported while collecting, GPU-marked or not).

A session that selects the GPU tests (`-m gpu`) on a machine with CUDA compiles the kernels;
every other session runs them in the interpreter on CPU tensors (TRITON_INTERPRET=1, unless
the environment already says otherwise). Each test module skips, with the reason, whatever
the session's choice cannot run."""

from __future__ import annotations

import os

import torch


def compiles_for_gpu(markexpr: str) -> bool:
    """Whether a session with this `-m` expression runs the GPU tests (on a CUDA machine)."""
    selected = "gpu" in markexpr and "not gpu" not in markexpr
    return selected and torch.cuda.is_available()


def pytest_configure(config):
    if not compiles_for_gpu(config.getoption("markexpr") or ""):
        os.environ.setdefault("TRITON_INTERPRET", "1")
