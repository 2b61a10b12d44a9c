"""Every environment variable megainfer's serving core, CLI and deploy read, in one table: its
name, type, default and meaning.

Readers ask a setting's `read()` when they need it, as they read `os.environ` before (a
`read(environ)` takes a mapping the caller was handed, e.g. a test's).

Why megainfer/ has a table of its own: kernels/ and transport/ below it may not import
megainfer/ (DESIGN.md), and neither may import the other, so no one module serves every
reader; each layer that reads variables keeps one table of the same shape:
`kernels/kernel_settings.py`, `transport/transport_settings.py` and this one; `python -m
megainfer.tools.settings_table` writes the README's table from the three (and
tests/test_settings.py checks that they agree). The two lower layers parse choices and
integers (each its own `Setting`, raising its layer's error: transport/ may not import
kernels/'s torch-importing package); megainfer's variables are text.

Not here, because megainfer does not own them and only passes them on or reads them as their
owner does: `HF_HUB_CACHE`, `HUGGINGFACE_HUB_CACHE`, `HF_HOME`, `XDG_CACHE_HOME`
(huggingface_hub's cache, megainfer/hub_cache.py), `TRITON_INTERPRET` (Triton's,
kernels/launch.py), `OPENAI_API_KEY` (the OpenAI SDK's, megainfer/tools/bench/serve_requests.py),
`CC` (the C compiler the GPU check reports, megainfer/tools/gpucheck/environment.py); and
writes: the environment the GPU check hands its child processes
(megainfer/tools/gpucheck/runner.py sets or drops MEGAINFER_KERNELS there),
`OMP_WAIT_POLICY` (megainfer/tools/demo_train.py).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Setting:
    """One environment variable whose value is text (every one megainfer itself owns): `read`
    gives it, or `default` when unset or blank. No value is malformed, so nothing is refused here;
    the variables that are parsed (choices, integers) belong to kernels/ and transport/."""

    name: str
    default: str | None
    meaning: str  # one line, for the README's table
    kind = "string"

    def read(self, environ: Mapping[str, str] | None = None) -> str | None:
        """The value now, from `environ` (default: os.environ, read at this call)."""
        raw = (os.environ if environ is None else environ).get(self.name, "")
        return raw if raw.strip() else self.default


API_KEY = Setting(
    "MEGAINFER_API_KEY", None,
    "the API key a server requires when no --api-key is given (added to --api-key-file's), and the one "
    "`megainfer generate --server` and `megainfer deploy`'s demo client send")

SETTINGS = (API_KEY,)
