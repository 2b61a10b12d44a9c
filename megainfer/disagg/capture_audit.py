"""What a CUDA graph's captured region may not do, checked on the CPU.

A CUDA graph records the kernels a region launches, with their arguments, once; a replay
launches them again with nothing of the host in between. So a captured region must not
synchronise with the host (an `.item()`, a `nonzero`, a boolean mask, a `bincount`: torch
reads the device back, which capture refuses, or which would freeze one step's answer into
every replay), must not make a tensor from host data (the copy is recorded with that data
and replays it forever), and must not produce shapes that depend on values. Allocation is
allowed: the graph takes its memory from its private pool, once, at capture.

`CaptureAudit` is a `TorchDispatchMode` that records every aten op a region dispatches and
names those capture forbids. Triton kernels launch no aten op on a GPU; under Triton's
interpreter (how the CPU runs them) their bodies dispatch torch ops of the interpreter's
own, which are not the region's: ops issued from inside the interpreter count as one launch
of the kernel and are not audited.
"""

from __future__ import annotations

import sys
from collections import Counter
from dataclasses import dataclass

from torch.utils._python_dispatch import TorchDispatchMode

# aten overloads a captured region may not dispatch, and why.
FORBIDDEN = {
    "aten._local_scalar_dense.default": "reads a device value on the host (.item(), .tolist(), bool())",
    "aten.nonzero.default": "a value-dependent shape (reads the count back)",
    "aten.masked_select.default": "a value-dependent shape (reads the count back)",
    "aten.unique_consecutive.default": "a value-dependent shape",
    "aten._unique2.default": "a value-dependent shape",
    "aten.unique_dim.default": "a value-dependent shape",
    "aten.bincount.default": "reads the largest value back to size its output",
    "aten.repeat_interleave.Tensor": "without output_size the output's length is read back",
    "aten.equal.default": "answers on the host",
    "aten.is_nonzero.default": "answers on the host",
    "aten.lift_fresh.default": "a tensor from host data: its copy would replay the capture's data",
    "aten._pin_memory.default": "host memory",
    "aten.allclose.default": "answers on the host",
}
_INTERPRETER = ("triton/runtime/interpreter", "triton\\runtime\\interpreter")


@dataclass(frozen=True)
class Violation:
    op: str
    reason: str


class CaptureAudit(TorchDispatchMode):
    """Ops dispatched inside it: `ops` (by overload, Triton launches as `triton:<kernel>`) and the
    `violations` of what capture forbids, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.violations: list[Violation] = []
        self._kernel: str | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kernel = _interpreted_kernel()
        if kernel is not None:
            if kernel != self._kernel:  # a new launch (the interpreter's ops of one kernel come together)
                self.ops[f"triton:{kernel}"] += 1
                self._kernel = kernel
            return func(*args, **(kwargs or {}))
        self._kernel = None
        name = str(func)
        self.ops[name] += 1
        if name in FORBIDDEN and not _sized_repeat(name, kwargs):
            self.violations.append(Violation(name, FORBIDDEN[name]))
        return func(*args, **(kwargs or {}))


def _sized_repeat(name: str, kwargs) -> bool:
    """repeat_interleave given its output size reads nothing back."""
    return name == "aten.repeat_interleave.Tensor" and (kwargs or {}).get("output_size") is not None


def _interpreted_kernel() -> str | None:
    """The Triton kernel whose interpreted body is running (the outermost), or None."""
    frame, found = sys._getframe(2), None
    while frame is not None:
        if any(part in frame.f_code.co_filename for part in _INTERPRETER) and frame.f_code.co_name == "__call__":
            fn = frame.f_locals.get("self")
            found = getattr(getattr(fn, "fn", None), "__name__", None) or found or "kernel"
        frame = frame.f_back
    return found
