"""megainfer's greedy output is token-identical to transformers', and its logits agree to 1e-4,
with whole prompts, with chunked prefill splitting prompts, and with preemption."""

from __future__ import annotations

import pytest
import torch

from megainfer import LLM, SamplingParams
from megainfer.request_group import engine_request_id
from tests.helpers import NEW_TOKENS

CONFIGS = {
    "whole-prompts": {},
    "small-chunks": dict(max_num_batched_tokens=8),
    "tiny-kv-cache": dict(num_kv_blocks=20, block_size=4),
    "tiny-kv-and-chunks": dict(num_kv_blocks=20, block_size=4, max_num_batched_tokens=8),
    # gpt-oss: a sequence also holds a window's blocks for its windowed layers (5 here), so its
    # longest request needs 22 blocks, not 17.
    "tiny-kv-and-chunks-windowed": dict(num_kv_blocks=26, block_size=4, max_num_batched_tokens=8),
    "layered-tiny-kv-windowed": dict(prefill_policy="layered", group_tokens=8, num_kv_blocks=26, block_size=4),
    "layered": dict(prefill_policy="layered", group_tokens=16),
    "layered-one-layer-per-group": dict(prefill_policy="layered", num_layer_groups=3),
    "layered-long-prompts-in-chunks": dict(prefill_policy="layered", group_tokens=8, layered_chunk_tokens=20),
    "layered-tiny-kv": dict(prefill_policy="layered", group_tokens=8, num_kv_blocks=20, block_size=4),
}


@pytest.fixture
def captured_logits(monkeypatch):
    """Logits each request was sampled from, step by step (recorded on the real path: every
    runner samples through `model_runner.sample_tokens`, whichever sampler path it takes)."""
    from megainfer.runner import model_runner

    seen: dict[str, list[torch.Tensor]] = {}
    original = model_runner.sample_tokens

    def recording(sampler, logits, seqs, layout):
        for row, sampled in enumerate(layout.sampled_rows):
            seen.setdefault(seqs[sampled.sequence].request_id, []).append(logits[row].clone())
        return original(sampler, logits, seqs, layout)

    monkeypatch.setattr(model_runner, "sample_tokens", recording)
    return seen


@pytest.mark.parametrize("name", [n for n in CONFIGS if "windowed" not in n])
def test_greedy_matches_transformers(hf_ref, name, captured_logits):
    check_greedy(hf_ref, name, captured_logits)


@pytest.mark.parametrize("name", ["whole-prompts", "small-chunks", "tiny-kv-and-chunks", "layered"])
def test_dbrx_greedy_matches_transformers(dbrx_ref, name, captured_logits):
    """DBRX: fused Wqkv split per head, q/k/v clipped, bias-free LayerNorms (the fused add-norm's
    LayerNorm variant), every expert a slice of the fused w1/v1/w2."""
    check_greedy(dbrx_ref, name, captured_logits)


@pytest.mark.parametrize("name", ["whole-prompts", "small-chunks", "tiny-kv-and-chunks-windowed", "layered",
                                  "layered-long-prompts-in-chunks"])
def test_gpt_oss_greedy_matches_transformers(gpt_oss_ref, name, captured_logits):
    """Windows shorter than most prompts (8 and 16 tokens), sinks, biases, the clamp binding, YaRN."""
    check_greedy(gpt_oss_ref, name, captured_logits)


@pytest.mark.parametrize("name", ["whole-prompts", "small-chunks", "tiny-kv-and-chunks", "layered",
                                  "layered-long-prompts-in-chunks"])
def test_deepseek_greedy_matches_transformers(deepseek_ref, name, captured_logits):
    """MLA over the compressed cache (absorbed), grouped routing, shared experts on the attention
    side, dense first layers, YaRN's mscale in the softmax scale."""
    check_greedy(deepseek_ref, name, captured_logits)


# Prefix caching off (vLLM's --no-enable-prefix-caching): every family through whole prompts,
# chunks with preemption under KV pressure, and layered prefill, equal to transformers as with it on.
WITHOUT_CACHING = ["whole-prompts", "tiny-kv-and-chunks", "layered-tiny-kv"]


@pytest.mark.parametrize("name", WITHOUT_CACHING)
def test_greedy_matches_transformers_without_prefix_caching(hf_ref, name, captured_logits):
    check_greedy(hf_ref, name, captured_logits, prefix_caching=False)


@pytest.mark.parametrize("name", ["tiny-kv-and-chunks", "layered-tiny-kv"])
def test_dbrx_matches_transformers_without_prefix_caching(dbrx_ref, name, captured_logits):
    check_greedy(dbrx_ref, name, captured_logits, prefix_caching=False)


# gpt-oss's windows need a few more blocks under pressure (CONFIGS' windowed rows).
@pytest.mark.parametrize("name", ["tiny-kv-and-chunks-windowed", "layered-tiny-kv-windowed"])
def test_gpt_oss_matches_transformers_without_prefix_caching(gpt_oss_ref, name, captured_logits):
    check_greedy(gpt_oss_ref, name, captured_logits, prefix_caching=False)


@pytest.mark.parametrize("name", ["tiny-kv-and-chunks", "layered-tiny-kv"])
def test_deepseek_matches_transformers_without_prefix_caching(deepseek_ref, name, captured_logits):
    check_greedy(deepseek_ref, name, captured_logits, prefix_caching=False)


def check_greedy(hf_ref, name, captured_logits, prefix_caching: bool = True) -> None:
    llm = LLM(str(hf_ref.path), dtype="float32", enable_prefix_caching=prefix_caching, **CONFIGS[name])
    outs = llm.generate(hf_ref.prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
    for i, (out, expected) in enumerate(zip(outs, hf_ref.tokens)):
        assert out.outputs[0].token_ids == expected, f"prompt {i} (length {len(hf_ref.prompts[i])}) diverged"
        assert out.outputs[0].finish_reason == "length"
        ours = torch.stack(captured_logits[engine_request_id(out.request_id, 0)])  # its one completion's
        assert ours.shape == hf_ref.logits[i].shape
        torch.testing.assert_close(ours, hf_ref.logits[i], atol=1e-4, rtol=0)
    stats = llm.engine.stats()
    if "tiny-kv" in name:
        assert stats.num_preemptions > 0, "the small cache was meant to force preemption"
    if "chunks" in name or "layered" in name:
        assert stats.num_steps > NEW_TOKENS  # prompts were split over several steps (or layer groups)
    assert stats.kv_cache_usage == 0.0  # every block came back
    # Prefix caching is on by default: the prompts admitted after those they share a prefix with
    # (split prompts, preempted ones) took cached blocks, and the tokens above stayed equal.
    assert stats.prefix_caching is prefix_caching
    if not prefix_caching:
        assert stats.prefix_cache_hits == 0
    elif "chunks" in name or "tiny-kv" in name:
        assert stats.prefix_cache_hits > 0, "no prompt found a cached prefix"


def test_batch_composition_does_not_change_tokens(mixtral_ref):
    """The same prompt alone and inside a batch gives the same greedy tokens."""
    llm = LLM(str(mixtral_ref.path))
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    alone = llm.generate([mixtral_ref.prompts[2]], params)[0].outputs[0].token_ids
    together = llm.generate(mixtral_ref.prompts, params)[2].outputs[0].token_ids
    assert alone == together == mixtral_ref.tokens[2]
