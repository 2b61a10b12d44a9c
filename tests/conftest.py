"""Shared fixtures: tiny random Mixtral, Qwen3-MoE, DBRX and gpt-oss checkpoints written by transformers'
`save_pretrained`, and transformers' own greedy generations and logits for them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from megainfer.tools.gpucheck.tiny_checkpoints import tiny_prompts, write_tiny_checkpoint
from tests.helpers import NEW_TOKENS


@dataclass
class HFReference:
    path: Path
    prompts: list[list[int]]
    tokens: list[list[int]]  # greedy continuation of each prompt, NEW_TOKENS long
    logits: list[torch.Tensor]  # [NEW_TOKENS, vocab] logits that chose each token


def _build(kind: str, directory: Path) -> HFReference:
    pytest.importorskip("transformers")
    model = write_tiny_checkpoint(kind, directory)
    prompts = tiny_prompts()
    tokens, logits = [], []
    for p in prompts:
        out = model.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                             pad_token_id=0, return_dict_in_generate=True, output_logits=True)
        tokens.append(out.sequences[0, len(p):].tolist())
        logits.append(torch.cat(out.logits).float())
    return HFReference(directory, prompts, tokens, logits)


@pytest.fixture(scope="session")
def mixtral_ref(tmp_path_factory) -> HFReference:
    return _build("mixtral", tmp_path_factory.mktemp("mixtral"))


@pytest.fixture(scope="session")
def qwen3_ref(tmp_path_factory) -> HFReference:
    return _build("qwen3_moe", tmp_path_factory.mktemp("qwen3"))


@pytest.fixture(scope="session")
def dbrx_ref(tmp_path_factory) -> HFReference:
    return _build("dbrx", tmp_path_factory.mktemp("dbrx"))


@pytest.fixture(scope="session", params=["gpt_oss", "gpt_oss_gqa4"])
def gpt_oss_ref(request, tmp_path_factory) -> HFReference:
    """Both tiny gpt-oss checkpoints (tiny_checkpoints._gpt_oss): windows, sinks, biases, clamp, YaRN."""
    return _build(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="session", params=["deepseek_v3", "deepseek_v3_noq", "deepseek_v2"])
def deepseek_ref(request, tmp_path_factory) -> HFReference:
    """The tiny DeepSeek checkpoints (tiny_checkpoints._deepseek): MLA with and without the q
    bottleneck, grouped routing at three group settings, shared experts, dense first layers."""
    return _build(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="session")
def soft_verbs(tmp_path_factory) -> str:
    """The software verbs provider (tests/soft_rdma.py), built once from source into a
    temporary directory: the compiled core's rdma channels without an adapter."""
    from tests.soft_rdma import shared_library

    return shared_library("soft_verbs.cpp", tmp_path_factory.mktemp("verbs") / "libsoftverbs.so")


@pytest.fixture(scope="session", params=["mixtral", "qwen3_moe"])
def hf_ref(request) -> HFReference:
    return request.getfixturevalue("mixtral_ref" if request.param == "mixtral" else "qwen3_ref")


# What the serving side needs and the lent GPU machine lacks (../shared/notes/facts.md): a test
# module that imports one is skipped there, naming it, instead of stopping the whole collection
# (`python -m pytest -m gpu` must collect there; tests/test_gpucheck.py checks it). Where they are
# installed, as in CI, nothing changes; any other import error still fails the collection.
SERVING_PACKAGES = frozenset({"ray", "fastapi", "uvicorn", "pydantic", "httpx2", "grpc_health", "grpc_reflection",
                              "nixl_cu12", "pyverbs", "openai"})


class _Module(pytest.Module):
    def _getobj(self):
        try:
            return super()._getobj()
        except self.CollectError as exc:
            cause = exc.__cause__
            missing = getattr(cause, "name", None) or ""
            if isinstance(cause, ModuleNotFoundError) and missing.split(".")[0] in SERVING_PACKAGES:
                raise pytest.skip.Exception(f"{self.path.name} needs {missing}, which is not installed here",
                                             allow_module_level=True)
            raise


def pytest_pycollect_makemodule(module_path, parent):
    return _Module.from_parent(parent, path=module_path)


def pytest_collection_modifyitems(config, items):
    """`gpu` tests need CUDA: where there is none they are skipped, saying so."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False); run `python -m pytest "
                                   "-m gpu` on a GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
