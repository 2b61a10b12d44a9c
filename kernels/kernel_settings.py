"""Every environment variable the kernels read, in one table: its name, type, default and meaning,
parsed here with an error that names the variable, its bad value and the fix.

Readers ask `KERNELS.read()` at the moment they need the value (the dispatcher does on every
call, as it read `os.environ` before), so a changed environment, a test's monkeypatch
included, is honoured.

Why a table for kernels/ alone, not one module for the whole project: kernels/ is the lowest
layer under the serving core and imports nothing of megainfer, deploy, planner or transport
(DESIGN.md), and transport/ beside it may not import kernels/ either; no module exists that
every reader could import without an upward or sideways import. So each layer that reads
variables keeps one table of the same shape: this one, `transport/transport_settings.py` and
`megainfer/settings.py`; `python -m megainfer.tools.settings_table` writes the README's table
from the three (and tests/test_settings.py checks that they agree).

Not here: `TRITON_INTERPRET` (Triton's own switch, which kernels/launch.py asks about exactly
as Triton reads it).
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


KERNELS = Setting(
    "MEGAINFER_KERNELS", "",
    "forces every kernel call's backend; unset: on CUDA the faster per shape, timed at start, elsewhere the "
    "torch reference (triton on CPU tensors needs TRITON_INTERPRET=1)",
    choices=("reference", "triton"))

SETTINGS = (KERNELS,)
