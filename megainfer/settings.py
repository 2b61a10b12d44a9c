"""Every environment variable megainfer's serving core, CLI and deploy read, in one table: its
name, type, default and meaning, parsed here with an error (a `ConfigError`, which the CLI
prints without a traceback) that names the variable, its bad value and the fix.

Readers ask a setting's `read()` when they need it, as they read `os.environ` before (a
`read(environ)` takes a mapping the caller was handed, e.g. a test's).

Why megainfer/ has a table of its own: kernels/ and transport/ below it may not import
megainfer/ (DESIGN.md), and neither may import the other, so no one module serves every
reader; each layer that reads variables keeps one table of the same shape:
`kernels/kernel_settings.py`, `transport/transport_settings.py` and this one; `python -m
megainfer.tools.settings_table` writes the README's table from the three (and
tests/test_settings.py checks that they agree). The `Setting` shape is restated in each, its
error belonging to that layer.

Not here, because megainfer does not own them and only passes them on or reads them as their
owner does: `HF_HUB_CACHE`, `HUGGINGFACE_HUB_CACHE`, `HF_HOME`, `XDG_CACHE_HOME`
(huggingface_hub's cache, megainfer/hub_cache.py), `TRITON_INTERPRET` (Triton's,
kernels/launch.py), `OPENAI_API_KEY` (the OpenAI SDK's, megainfer/bench/serve_requests.py),
`CC` (the C compiler the GPU check reports, megainfer/tools/gpucheck/environment.py); and
writes: the environment the GPU check hands its child processes
(megainfer/tools/gpucheck/runner.py sets or drops MEGAINFER_KERNELS there),
`OMP_WAIT_POLICY` (megainfer/demo/train.py).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from megainfer.errors import ConfigError


class SettingError(ConfigError):
    """An environment variable holds a value its setting does not accept."""


@dataclass(frozen=True)
class Setting:
    """One environment variable: `read` parses it (unset or blank: `default`)."""

    name: str
    default: str | int | None
    meaning: str  # one line, for the README's table
    choices: tuple[str, ...] = ()  # a choice, lower-cased; else an integer >= minimum; else a string
    minimum: int | None = None

    @property
    def kind(self) -> str:
        if self.choices:
            return " | ".join(self.choices)
        return "string" if self.minimum is None else f"integer >= {self.minimum}"

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
        if value is None or value < self.minimum:
            raise SettingError(f"{self.name}={text!r} is not an integer >= {self.minimum}; {self._fix()}")
        return value

    def _fix(self) -> str:
        default = "" if self.default in (None, "") else f" (default: {self.default})"
        wanted = " or ".join(self.choices) if self.choices else f"an {self.kind}"
        return f"set it to {wanted}, or unset it{default}"



API_KEY = Setting(
    "MEGAINFER_API_KEY", None,
    "the API key a server requires when no --api-key is given (added to --api-key-file's), and the one "
    "`megainfer generate --server` and `megainfer deploy`'s demo client send")

SETTINGS = (API_KEY,)
