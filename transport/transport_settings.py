"""Every environment variable the M2N transport reads, in one table: its name, type, default and
meaning, parsed here with an error that names the variable, its bad value and the fix.

Readers ask a setting's `read(environ)` when they need it, as they read `os.environ` before
(`environ`: a mapping the caller was handed, e.g. a test's; None: os.environ at that moment).

Why a table for transport/ alone, not one module for the whole project: transport/ is a library
that never imports megainfer, deploy or planner (DESIGN.md), and kernels/ beside it imports
nothing of transport/; no module exists that every reader could import without an upward or
sideways import. So each layer that reads variables keeps one table of the same shape:
`kernels/kernel_settings.py`, this one and `megainfer/settings.py`; `python -m
megainfer.tools.settings_table` writes the README's table from the three (and
tests/test_settings.py checks that they agree). The `Setting` shape is restated in each, its
error belonging to that layer.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass


class SettingError(ValueError):
    """An environment variable holds a value its setting does not accept."""


@dataclass(frozen=True)
class Setting:
    """One environment variable: `read` parses it (unset or blank: `default`)."""

    name: str
    default: str | int | None
    meaning: str  # one line, for the README's table
    choices: tuple[str, ...] = ()  # a choice, lower-cased; else an integer >= minimum; else a string
    minimum: int | None = None
    maximum: int | None = None  # an integer's upper bound, where it has one

    @property
    def kind(self) -> str:
        if self.choices:
            return " | ".join(self.choices)
        if self.minimum is None:
            return "string"
        return f"integer >= {self.minimum}" if self.maximum is None else f"integer {self.minimum}..{self.maximum}"

    def read(self, environ: Mapping[str, str] | None = None):
        """The value now, from `environ` (default: os.environ, read at this call)."""
        raw = (os.environ if environ is None else environ).get(self.name, "")
        text = raw.strip()
        if not text:
            return self.default
        if self.choices:
            if text.lower() in self.choices:
                return text.lower()
            raise SettingError(f"{self.name}={text!r} is not one of {', '.join(self.choices)}; {self._fix()}")
        if self.minimum is None:
            return raw
        value = int(text) if text.lstrip("-").isdigit() else None
        if value is None or value < self.minimum or (self.maximum is not None and value > self.maximum):
            raise SettingError(f"{self.name}={text!r} is not an {self.kind}; {self._fix()}")
        return value

    def _fix(self) -> str:
        default = "" if self.default in (None, "") else f" (default: {self.default})"
        wanted = " or ".join(self.choices) if self.choices else f"an {self.kind}"
        return f"set it to {wanted}, or unset it{default}"



M2N_CORE = Setting(
    "MEGAINFER_M2N_CORE", "auto",
    "whether endpoints whose spec says core=auto drive shm, tcp and rdma channels with the compiled M2N core: "
    "auto (where built), on (fail where not built) or off (the pure-Python reference)",
    choices=("auto", "on", "off"))
RDMA_DEVICE = Setting(
    "MEGAINFER_RDMA_DEVICE", None,
    "the verbs device rdma uses on this host, over plan.yaml's transport.rdma_devices; unset: the first usable "
    "device nearest the GPU")
RDMA_PORT = Setting("MEGAINFER_RDMA_PORT", 1, "the verbs device's port rdma uses", minimum=1)
RDMA_GID_INDEX = Setting(
    "MEGAINFER_RDMA_GID_INDEX", None,
    "the GID table entry rdma sends from, whatever its type; unset: IB's port GID, else RoCE v2 (IPv4-mapped "
    "first)", minimum=0)

RDMA_TRAFFIC_CLASS = Setting(
    "MEGAINFER_RDMA_TRAFFIC_CLASS", 0,
    "the traffic class RoCE packets carry (DSCP x 4 + ECN, as NCCL_IB_TC): the lossless priority a PFC fabric "
    "maps to", minimum=0, maximum=255)
RDMA_SERVICE_LEVEL = Setting(
    "MEGAINFER_RDMA_SERVICE_LEVEL", 0,
    "the service level of the queue pairs' path (as NCCL_IB_SL): InfiniBand's virtual lane", minimum=0, maximum=15)
LIBIBVERBS = Setting(
    "MEGAINFER_LIBIBVERBS", None,
    "the libibverbs (a path or a soname) the M2N core's rdma channels load; unset: the one pyverbs loaded, else "
    "libibverbs.so.1")

SETTINGS = (M2N_CORE, RDMA_DEVICE, RDMA_PORT, RDMA_GID_INDEX, RDMA_TRAFFIC_CLASS, RDMA_SERVICE_LEVEL, LIBIBVERBS)
