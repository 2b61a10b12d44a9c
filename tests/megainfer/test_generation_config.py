"""generation_config.json as request defaults (vLLM's --generation-config auto)."""

import json

import pytest

from megainfer.errors import CheckpointError
from megainfer.generation_config import generation_defaults
from megainfer.sampling_params import SamplingParams


def test_sampling_keys_the_file_sets_become_defaults(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({
        "bos_token_id": 1, "eos_token_id": [2, 3], "do_sample": True, "temperature": 0.6, "top_p": 0.95,
        "top_k": 20, "min_p": None, "repetition_penalty": 1.05, "max_new_tokens": 64, "max_length": 4096}))
    defaults = generation_defaults(tmp_path)
    assert defaults == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.05, "max_tokens": 64}
    assert SamplingParams(**{**defaults, "temperature": 0.0}).temperature == 0.0  # a request's own value wins


def test_no_file_or_no_checkpoint_means_no_defaults(tmp_path):
    assert generation_defaults(tmp_path) == {} and generation_defaults(None) == {}


@pytest.mark.parametrize("key, value", [("temperature", -1), ("top_p", 0), ("top_k", 1.5), ("min_p", 2),
                                        ("repetition_penalty", 0), ("max_new_tokens", 0), ("temperature", "hot")])
def test_a_bad_value_names_the_file_and_key(tmp_path, key, value):
    (tmp_path / "generation_config.json").write_text(json.dumps({key: value}))
    with pytest.raises(CheckpointError, match=rf"generation_config.json: {key} = "):
        generation_defaults(tmp_path)


def test_malformed_file_is_a_checkpoint_error(tmp_path):
    (tmp_path / "generation_config.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="JSON object"):
        generation_defaults(tmp_path)
    (tmp_path / "generation_config.json").write_text("{")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        generation_defaults(tmp_path)
