"""Helpers several test modules share (tests never import each other)."""

from __future__ import annotations

import subprocess
import sys
import urllib.request
from pathlib import Path

from transport import Endpoint
from transport.endpoint import connect_concurrently

ROOT = Path(__file__).resolve().parents[1]  # the checkout
NEW_TOKENS = 32  # greedy tokens generated per prompt by the transformers references (conftest)


def megainfer(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run the `megainfer` CLI from the checkout's root, capturing its output."""
    return subprocess.run([sys.executable, "-m", "megainfer", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def generate_all(engine, prompts, params) -> list[list[int]]:
    """Every prompt's generated tokens, in order: the engine (a megainfer Engine) is stepped
    until all of its requests finished."""
    ids = [f"r{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts):
        engine.add_request(request_id, prompt, params)
    out: dict[str, list[int]] = {request_id: [] for request_id in ids}
    while engine.has_unfinished_requests():
        for d in engine.step():
            out[d.request_id].extend(d.new_token_ids)
    return [out[request_id] for request_id in ids]


def connect_all(endpoints: dict[str, Endpoint], links: dict[str, list[str]]) -> None:
    """Connect every endpoint to its listed peers concurrently (as separate processes would)."""
    connect_concurrently([(endpoints[name], {p: endpoints[p].address for p in links[name]}) for name in endpoints],
                         30.0)


def scrape(port: int) -> dict[str, float]:
    """name{labels} -> value, from the text exposition format."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            values[key] = float(value)
    return values


def write_chat_checkpoint(directory: Path, generation_config: dict | None = None) -> Path:
    """A tiny random Qwen3-MoE checkpoint written by transformers, whose vocabulary is a Qwen-style
    tokenizer's (tests/tokenizer_checkpoints.py, with its ChatML template), `generation_config`
    merged into its generation_config.json."""
    import json

    import torch
    import transformers

    from tests.tokenizer_checkpoints import write_qwen_style_tokenizer

    path = write_qwen_style_tokenizer(directory)
    tok = transformers.AutoTokenizer.from_pretrained(str(path))
    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(vocab_size=len(tok), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=96, moe_intermediate_size=48,
                                      head_dim=16, num_experts=4, num_experts_per_tok=2, max_position_embeddings=512,
                                      initializer_range=0.2, eos_token_id=tok.eos_token_id, bos_token_id=None)
    transformers.Qwen3MoeForCausalLM(cfg).save_pretrained(path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": tok.eos_token_id,
                                                             **(generation_config or {})}))
    return path
