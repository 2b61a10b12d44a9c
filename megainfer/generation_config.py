"""Sampling defaults from a checkpoint's generation_config.json (vLLM's `--generation-config auto`).

Only the sampling keys vLLM takes are read (temperature, top_p, top_k, min_p,
repetition_penalty, and max_new_tokens as max_tokens), and only those the file sets. They
are the defaults of requests that leave the field unset; a request's own value wins.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from megainfer.errors import CheckpointError, RequestError
from megainfer.hf_config import read_json_object
from megainfer.sampling_params import SamplingParams

GENERATION_CONFIG_FILE = "generation_config.json"
# generation_config.json key -> SamplingParams field
SAMPLING_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                 "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def read_generation_config(checkpoint: Path | None) -> dict[str, Any]:
    """The checkpoint's generation_config.json as a dict ({} for a preset or when absent)."""
    return {} if checkpoint is None else read_json_object(checkpoint / GENERATION_CONFIG_FILE)


def generation_defaults(checkpoint: Path | None) -> dict[str, Any]:
    """SamplingParams field -> value, for the sampling keys generation_config.json sets.
    A value SamplingParams would refuse is a CheckpointError naming the file and the key."""
    data = read_generation_config(checkpoint)
    defaults: dict[str, Any] = {}
    for key, name in SAMPLING_KEYS.items():
        value = data.get(key)
        if value is None:
            continue
        try:
            SamplingParams(**{name: value})
        except RequestError as exc:
            raise CheckpointError(f"{checkpoint / GENERATION_CONFIG_FILE}: {key} = {value!r} is invalid "
                                  f"({exc}); fix or remove it") from None
        defaults[name] = value
    return defaults
