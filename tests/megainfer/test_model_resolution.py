"""Models as users name them: Hugging Face repo ids found in the local hub cache (never
downloaded), and the demo checkpoint."""

from __future__ import annotations

import dataclasses
import shutil

import pytest

from megainfer.errors import ConfigError
from megainfer.hf_config import from_pretrained
import megainfer.model_resolution
from megainfer.model_resolution import resolve_model

COMMIT = "0123456789abcdef0123456789abcdef01234567"
OTHER_COMMIT = "fedcba9876543210fedcba9876543210fedcba98"


def fake_hub_cache(root, repo_id, checkpoint, commit=COMMIT, ref="main"):
    """huggingface_hub's cache layout: models--org--name/{refs/<ref>, snapshots/<commit>/...}."""
    repo = root / f"models--{repo_id.replace('/', '--')}"
    shutil.copytree(checkpoint, repo / "snapshots" / commit)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
    return repo / "snapshots" / commit


@pytest.fixture
def hub(tmp_path, monkeypatch):
    root = tmp_path / "hub"
    root.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return root


def test_hub_id_resolves_to_its_cached_snapshot(hub, mixtral_ref):
    snapshot = fake_hub_cache(hub, "acme/tiny-moe", mixtral_ref.path)
    cfg, path = resolve_model("acme/tiny-moe")
    assert path == snapshot and cfg.name == "acme/tiny-moe"
    assert cfg == dataclasses.replace(from_pretrained(mixtral_ref.path), name="acme/tiny-moe")


def test_revisions_by_branch_and_by_commit(hub, mixtral_ref, qwen3_ref):
    fake_hub_cache(hub, "acme/tiny-moe", mixtral_ref.path)
    dev = fake_hub_cache(hub, "acme/tiny-moe", qwen3_ref.path, commit=OTHER_COMMIT, ref="dev")
    assert resolve_model("acme/tiny-moe")[0].model_type == "mixtral"
    assert resolve_model("acme/tiny-moe@dev")[1] == dev
    cfg, path = resolve_model(f"acme/tiny-moe@{OTHER_COMMIT}")
    assert path == dev and cfg.model_type == "qwen3_moe"


def test_hf_home_locates_the_cache(tmp_path, monkeypatch, mixtral_ref):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    snapshot = fake_hub_cache(tmp_path / "hf" / "hub", "acme/tiny-moe", mixtral_ref.path)
    assert resolve_model("acme/tiny-moe")[1] == snapshot


def test_a_model_missing_from_the_cache_says_where_it_looked_and_how_to_fetch_it(hub):
    with pytest.raises(ConfigError) as info:
        resolve_model("Qwen/Qwen3-30B-A3B")
    message = str(info.value)
    assert "not in the local Hugging Face cache" in message and str(hub) in message
    assert "`hf download Qwen/Qwen3-30B-A3B`" in message and "huggingface-cli download" in message
    with pytest.raises(ConfigError, match="--revision v2"):
        resolve_model("Qwen/Qwen3-30B-A3B@v2")


def test_a_local_directory_wins_over_a_hub_id(hub, mixtral_ref, tmp_path, monkeypatch):
    local = tmp_path / "acme" / "tiny-moe"
    shutil.copytree(mixtral_ref.path, local)
    monkeypatch.chdir(tmp_path)
    cfg, path = resolve_model("acme/tiny-moe")
    assert path.resolve() == local.resolve()


def test_engine_serves_a_hub_id_like_its_directory(hub, mixtral_ref):
    from megainfer.engine.engine import Engine
    from megainfer.sampling_params import SamplingParams
    from tests.helpers import generate_all

    fake_hub_cache(hub, "acme/tiny-moe", mixtral_ref.path)
    engine = Engine("acme/tiny-moe", num_kv_blocks=64)
    tokens = generate_all(engine, mixtral_ref.prompts[:2], SamplingParams(max_tokens=8, temperature=0.0,
                                                                           ignore_eos=True))
    assert tokens == [t[:8] for t in mixtral_ref.tokens[:2]]


def test_demo_checkpoint_resolves_when_trained_and_says_how_to_train_it_otherwise(tmp_path, monkeypatch,
                                                                                 mixtral_ref):
    missing = tmp_path / "demo" / "checkpoint"
    monkeypatch.setattr(megainfer.model_resolution, "demo_checkpoint", lambda: missing)
    with pytest.raises(ConfigError, match="demo checkpoint is missing.*python -m megainfer.tools.demo_train"):
        resolve_model("megainfer-demo")
    shutil.copytree(mixtral_ref.path, missing)
    cfg, path = resolve_model("megainfer-demo")
    assert path == missing and cfg.name == "megainfer-demo"


def test_the_demo_checkpoint_lives_in_the_package():
    assert megainfer.model_resolution.demo_checkpoint().parts[-3:] == ("megainfer", "demo", "checkpoint")
