"""Models named by Hugging Face repo id, found in the local hub cache: nothing is downloaded.

The cache is where huggingface_hub keeps it (HF_HUB_CACHE, else HF_HOME/hub, else
~/.cache/huggingface/hub), read from the environment at each call. A model that is not
there is a ConfigError saying where megainfer looked and the command that fetches it.
"""

from __future__ import annotations

import os
from pathlib import Path

from megainfer.errors import ConfigError


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache huggingface_hub reads, from the environment now (HF_HUB_CACHE,
    else HF_HOME/hub, else ~/.cache/huggingface/hub), so a changed environment is honoured."""
    explicit = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache"), "huggingface")
    return Path(home).expanduser() / "hub"


def cached_snapshot(repo_id: str, revision: str | None = None) -> Path:
    """The local snapshot directory of a hub model, from the cache only (never downloads)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    cache = hub_cache_dir()
    try:
        return Path(snapshot_download(repo_id, revision=revision, cache_dir=cache, local_files_only=True))
    except HFValidationError as exc:
        raise ConfigError(f"model {repo_id!r} is not a valid Hugging Face repo id ({exc})") from None
    except LocalEntryNotFoundError:
        at = f"@{revision}" if revision else ""
        fetch = f"hf download {repo_id}" + (f" --revision {revision}" if revision else "")
        raise ConfigError(
            f"model {repo_id}{at} is not in the local Hugging Face cache (looked in {cache}; HF_HUB_CACHE or "
            f"HF_HOME move it). megainfer never downloads: fetch it with `{fetch}` (or `huggingface-cli "
            f"download {repo_id}`), or pass a checkpoint directory") from None
