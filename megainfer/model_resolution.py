"""A model as users name it -> its `ModelConfig` and checkpoint directory: a preset, a checkpoint
directory, the demo checkpoint (`megainfer-demo`), or a Hugging Face repo id
(`org/name[@revision]`) found in the local Hugging Face cache (`megainfer.hub_cache`); nothing is
ever downloaded. Torch-free.
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

from megainfer.config import ModelConfig
from megainfer.errors import ConfigError
from megainfer.hf_config import from_pretrained
from megainfer.hub_cache import cached_snapshot
from megainfer.presets import PRESETS

DEMO_MODEL = "megainfer-demo"  # the small checkpoint trained by `python -m megainfer.tools.demo_train`
# org/name, optionally @revision (a branch, tag or commit): a Hugging Face repo id.
HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<revision>[\w./-]+))?$")


def demo_checkpoint() -> Path:
    """Where the demo checkpoint lives: inside the installed package."""
    return Path(__file__).resolve().parent / "demo" / "checkpoint"


def resolve_model(model: str | os.PathLike) -> tuple[ModelConfig, Path | None]:
    """A model as users name it -> (config, checkpoint directory or None for a preset): a preset
    name, `megainfer-demo`, a checkpoint directory, or a Hugging Face repo id (`org/name`,
    `org/name@revision`) in the local cache."""
    key = str(model)
    if key in PRESETS:
        return PRESETS[key], None
    if key == DEMO_MODEL:
        path = demo_checkpoint()
        if not (path / "config.json").is_file():
            raise ConfigError(f"the demo checkpoint is missing ({path} has no config.json); train it with "
                              "`python -m megainfer.tools.demo_train --minutes 40`")
        return dataclasses.replace(from_pretrained(path), name=DEMO_MODEL), path
    path = Path(key).expanduser()
    if path.exists():
        return from_pretrained(path), path
    hub = HUB_ID.match(key)
    if hub:
        snapshot = cached_snapshot(hub["repo"], hub["revision"])
        return dataclasses.replace(from_pretrained(snapshot), name=key), snapshot
    raise ConfigError(f"model {key!r} is neither a checkpoint directory, a Hugging Face repo id (org/name) nor "
                      f"a preset; presets: {', '.join(PRESETS)}, {DEMO_MODEL}")
