"""Shared fixtures: tiny random Mixtral and Qwen3-MoE checkpoints written by transformers'
`save_pretrained`, and transformers' own greedy generations and logits for them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.helpers import NEW_TOKENS, PROMPT_LENGTHS


@dataclass
class HFReference:
    path: Path
    prompts: list[list[int]]
    tokens: list[list[int]]  # greedy continuation of each prompt, NEW_TOKENS long
    logits: list[torch.Tensor]  # [NEW_TOKENS, vocab] logits that chose each token


def _build(kind: str, directory: Path) -> HFReference:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    # initializer_range 0.2 keeps random logits well separated, so greedy choices are
    # decided by the model, not by float rounding.
    common = dict(vocab_size=320, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, num_experts_per_tok=2, max_position_embeddings=512,
                  initializer_range=0.2)
    if kind == "mixtral":
        cfg = transformers.MixtralConfig(intermediate_size=96, num_local_experts=6, **common)
        model = transformers.MixtralForCausalLM(cfg)
    else:
        # head_dim (24) differs from hidden/heads (16), and top-k weights are not renormalised.
        cfg = transformers.Qwen3MoeConfig(intermediate_size=96, moe_intermediate_size=48, head_dim=24,
                                          num_experts=6, norm_topk_prob=False,
                                          **{**common, "num_experts_per_tok": 3})
        model = transformers.Qwen3MoeForCausalLM(cfg)
    model.eval()
    model.save_pretrained(directory)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 320, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]
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


@pytest.fixture(scope="session", params=["mixtral", "qwen3_moe"])
def hf_ref(request) -> HFReference:
    return request.getfixturevalue("mixtral_ref" if request.param == "mixtral" else "qwen3_ref")


def pytest_collection_modifyitems(config, items):
    """`gpu` tests need CUDA: where there is none they are skipped, saying so."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False); run `python -m pytest "
                                   "-m gpu` on a GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
