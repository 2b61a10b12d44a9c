"""The prompts of `megainfer bench serve`: vLLM's ShareGPT and random datasets, sampled as
`vllm bench serve` samples them, and a recorded trace replayed request for request.

- sharegpt: a JSON list of {"conversations": [{"from": "human", "value": ...}, {"from": "gpt",
  "value": ...}, ...]}. Entries with fewer than two turns are dropped and the rest shuffled with
  the seed; an entry's first turn is the prompt, the second's token count the output length
  (unless --sharegpt-output-len fixes it). vLLM's filter keeps prompts of 4 to 1024 tokens,
  outputs of at least 4 tokens (not checked when the length is fixed) and prompt + output within
  2048. When fewer entries pass than prompts are asked for, passing entries drawn with the seed
  repeat (vLLM's oversampling).
- random: lengths uniform in [floor(len * (1 - r)), ceil(len * (1 + r))] (the input range after
  the tokenizer's special tokens are taken off), a fixed prefix of random tokens, then runs of
  consecutive non-special token ids from a random offset, decoded to text and re-encoded until the
  text is the intended number of tokens (up to 10 tries; a tokenizer that merges or splits across
  the joins leaves a few tokens off, and the prompt length is what the text re-encodes to).
- trace: a JSONL file of {"arrival": s, "input_len": tokens, "output_len": tokens} lines, the
  simulator's trace format (read by megainfer.bench.workload.load_trace, so a trace means the
  same requests to the simulator and to a server). Each request carries its arrival and a prompt of
  exactly input_len token ids (runs of consecutive non-special ids from a random offset, as the
  random dataset draws them), sent as ids: no tokenizer round trip changes its length. The
  requests come in arrival order; --num-prompts keeps the file's first N lines.

Lengths are counted with the benchmark's tokenizer. Nothing here depends on the backend, so the
same seed and dataset arguments give the same prompts to every backend.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from megainfer.errors import ConfigError
from megainfer.bench.workload import load_trace
from megainfer.tokenizer import Tokenizer

DATASETS = ("sharegpt", "random", "trace")
SHAREGPT_URL = ("https://huggingface.co/datasets/anon8231489123/ShareGPT_Vicuna_unfiltered/resolve/main/"
                "ShareGPT_V3_unfiltered_cleaned_split.json")
# vLLM's ShareGPT filter (datasets/utils.py is_valid_sequence), in tokens.
MIN_LEN, MAX_PROMPT_LEN, MAX_TOTAL_LEN = 4, 1024, 2048
DECODE_RETRIES = 10  # random dataset: decode/re-encode rounds before a length mismatch is accepted


@dataclass(frozen=True)
class SampleRequest:
    prompt: str
    prompt_len: int  # tokens, as the benchmark's tokenizer counts them
    expected_output_len: int  # tokens asked for (max_tokens)
    request_id: str
    prompt_token_ids: tuple[int, ...] | None = None  # sent instead of the text where set (trace)
    arrival_s: float | None = None  # seconds after the start it is sent (trace); None: paced by the rate


@dataclass
class DatasetSpec:
    """The dataset arguments of `bench serve` (vLLM's flags and defaults)."""

    name: str = "random"
    path: str | None = None  # sharegpt: the JSON file; trace: the JSONL file
    num_prompts: int | None = 1000  # trace: the file's first N lines, None: all of them
    seed: int = 0
    sharegpt_output_len: int | None = None  # None: each conversation's own answer length
    random_input_len: int = 1024
    random_output_len: int = 128
    random_range_ratio: float = 0.0
    random_prefix_len: int = 0
    request_id_prefix: str = ""

    def __post_init__(self) -> None:
        if self.name not in DATASETS:
            raise ConfigError(f"--dataset-name {self.name!r}: choose one of {', '.join(DATASETS)}")
        if self.name == "sharegpt" and self.path is None:
            raise ConfigError(f"--dataset-name sharegpt needs --dataset-path, a ShareGPT JSON file; download "
                              f"{SHAREGPT_URL} (the file vLLM's benchmarks use)")
        if self.name == "trace" and self.path is None:
            raise ConfigError('--dataset-name trace needs --dataset-path, a JSONL file of {"arrival": s, '
                              '"input_len": tokens, "output_len": tokens} lines')
        if self.name == "random" and self.path is not None:
            raise ConfigError(f"--dataset-name random takes no --dataset-path (got {self.path}); for a ShareGPT "
                              f"file use --dataset-name sharegpt, for a JSONL trace --dataset-name trace")
        if self.num_prompts is None and self.name != "trace":
            raise ConfigError(f"--dataset-name {self.name} needs --num-prompts")
        if self.num_prompts is not None and self.num_prompts <= 0:
            raise ConfigError(f"--num-prompts must be positive, got {self.num_prompts}")
        for flag, value in (("--sharegpt-output-len", self.sharegpt_output_len),
                            ("--random-output-len", self.random_output_len)):
            if value is not None and value <= 0:
                raise ConfigError(f"{flag} must be positive, got {value}")
        if self.random_input_len < 0 or self.random_prefix_len < 0:
            raise ConfigError(f"--random-input-len and --random-prefix-len must be >= 0, got "
                              f"{self.random_input_len} and {self.random_prefix_len}")
        if not 0 <= self.random_range_ratio < 1:
            raise ConfigError(f"--random-range-ratio must lie in [0, 1), got {self.random_range_ratio}")


def sample_requests(spec: DatasetSpec, tokenizer: Tokenizer, max_model_len: int | None = None) -> list[SampleRequest]:
    """The run's requests. `max_model_len`: the context a trace's requests must fit (trace only)."""
    if spec.name == "sharegpt":
        return sample_sharegpt(spec, tokenizer)
    if spec.name == "trace":
        if max_model_len is None:
            raise ValueError("a trace is checked against the model's context: pass max_model_len")
        return sample_trace(spec, tokenizer, max_model_len)
    return sample_random(spec, tokenizer)


def sample_trace(spec: DatasetSpec, tokenizer: Tokenizer, max_model_len: int) -> list[SampleRequest]:
    """The trace's requests in arrival order, each prompt exactly its input_len token ids."""
    if not Path(spec.path).is_file():
        raise ConfigError(f"--dataset-path {spec.path}: no such file; a trace is a JSONL file of "
                          f'{{"arrival": s, "input_len": tokens, "output_len": tokens}} lines')
    trace = load_trace(spec.path, max_model_len=max_model_len, num_requests=spec.num_prompts)
    rng = np.random.default_rng(spec.seed)
    allowed = _non_special_ids(tokenizer)
    offsets = rng.integers(0, len(allowed), size=len(trace))
    samples = []
    for i, (request, offset) in enumerate(zip(trace, offsets)):
        ids = tuple(allowed[(offset + i + np.arange(request.input_len)) % len(allowed)].tolist())
        samples.append(SampleRequest(tokenizer.decode(list(ids)), request.input_len, request.output_len,
                                     f"{spec.request_id_prefix}{i}", prompt_token_ids=ids,
                                     arrival_s=request.arrival_s))
    return samples


def _non_special_ids(tokenizer: Tokenizer) -> np.ndarray:
    """Every token id but BOS and the EOS ids: prompt material that neither starts nor stops anything."""
    special = {*tokenizer.eos_token_ids, tokenizer.bos_token_id} - {None}
    return np.setdiff1d(np.arange(tokenizer.vocab_size), sorted(special))


def sample_sharegpt(spec: DatasetSpec, tokenizer: Tokenizer) -> list[SampleRequest]:
    entries = [e for e in _load_sharegpt(Path(spec.path)) if len(e["conversations"]) >= 2]
    random.Random(spec.seed).shuffle(entries)
    samples: list[SampleRequest] = []
    for entry in entries:
        if len(samples) == spec.num_prompts:
            break
        prompt, completion = (turn.get("value") if isinstance(turn, dict) else None
                              for turn in entry["conversations"][:2])
        if not isinstance(prompt, str) or not isinstance(completion, str):
            continue  # a turn without text cannot be sent
        prompt_len = len(tokenizer.encode(prompt))
        output_len = spec.sharegpt_output_len or len(tokenizer.encode(completion))
        if not _valid_lengths(prompt_len, output_len, fixed_output=spec.sharegpt_output_len is not None):
            continue
        samples.append(SampleRequest(prompt, prompt_len, output_len, f"{spec.request_id_prefix}{len(samples)}"))
    if not samples:
        raise ConfigError(f"--dataset-path {spec.path}: no conversation passes vLLM's length filter (prompt "
                          f"{MIN_LEN}..{MAX_PROMPT_LEN} tokens, answer >= {MIN_LEN}, both <= {MAX_TOTAL_LEN}) "
                          f"with this tokenizer")
    rng, passed = random.Random(spec.seed), list(samples)
    for i in range(len(passed), spec.num_prompts):
        samples.append(replace(rng.choice(passed), request_id=f"{spec.request_id_prefix}{i}"))
    return samples


def _load_sharegpt(path: Path) -> list[dict]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"--dataset-path {path}: no such file; download {SHAREGPT_URL}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--dataset-path {path}: cannot be read ({exc})") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--dataset-path {path}: not JSON ({exc}); a ShareGPT file is a JSON list of "
                          f'{{"conversations": [...]}} entries') from None
    if not isinstance(data, list):
        raise ConfigError(f'--dataset-path {path}: a ShareGPT file is a JSON list of {{"conversations": [...]}} '
                          f"entries, this one holds a {type(data).__name__}")
    return [e for e in data if isinstance(e, dict) and isinstance(e.get("conversations"), list)]


def _valid_lengths(prompt_len: int, output_len: int, fixed_output: bool) -> bool:
    return (prompt_len >= MIN_LEN and (fixed_output or output_len >= MIN_LEN) and prompt_len <= MAX_PROMPT_LEN
            and prompt_len + output_len <= MAX_TOTAL_LEN)


def num_special_tokens(tokenizer: Tokenizer) -> int:
    """Tokens the tokenizer adds around a text (a BOS, say): `num_special_tokens_to_add()`."""
    return len(tokenizer.encode("", add_special_tokens=True)) - len(tokenizer.encode("", add_special_tokens=False))


def sample_random(spec: DatasetSpec, tokenizer: Tokenizer) -> list[SampleRequest]:
    # One generator drawn in vLLM's order (input lengths, output lengths, offsets, prefix, then
    # the padding of each prompt), so a seed means the same prompts here as there.
    rng = np.random.default_rng(spec.seed)
    r, n = spec.random_range_ratio, spec.num_prompts
    real_input_len = max(0, spec.random_input_len - num_special_tokens(tokenizer))
    input_low, input_high = math.floor(real_input_len * (1 - r)), math.ceil(real_input_len * (1 + r))
    if spec.random_prefix_len + input_low < 1:
        raise ConfigError(f"--random-input-len {spec.random_input_len} is too small: after the tokenizer's "
                          f"{num_special_tokens(tokenizer)} special token(s) and --random-range-ratio {r} a prompt "
                          f"could be empty; raise --random-input-len or --random-prefix-len")
    output_low = max(1, math.floor(spec.random_output_len * (1 - r)))
    output_high = max(1, math.ceil(spec.random_output_len * (1 + r)))
    input_lens = rng.integers(input_low, input_high + 1, size=n)
    output_lens = rng.integers(output_low, output_high + 1, size=n)
    offsets = rng.integers(0, tokenizer.vocab_size, size=n)
    allowed = _non_special_ids(tokenizer)
    prefix = allowed[rng.integers(0, len(allowed), size=spec.random_prefix_len)].tolist() \
        if spec.random_prefix_len else []
    samples = []
    for i in range(n):
        inner = allowed[(offsets[i] + i + np.arange(input_lens[i])) % len(allowed)].tolist()
        prompt, ids = decode_to_length(tokenizer, prefix + inner, spec.random_prefix_len + int(input_lens[i]), rng)
        samples.append(SampleRequest(prompt, len(ids), int(output_lens[i]), f"{spec.request_id_prefix}{i}"))
    return samples


def decode_to_length(tokenizer: Tokenizer, ids: list[int], target: int,
                     rng: np.random.Generator) -> tuple[str, list[int]]:
    """A text that re-encodes to `target` tokens where the tokenizer allows (vLLM's
    gen_prompt_decode_to_target_len): decode, re-encode, pad with random ids or cut, retry."""
    for attempt in range(DECODE_RETRIES + 1):
        prompt = tokenizer.decode(ids)
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        if len(ids) == target or attempt == DECODE_RETRIES:
            break
        if len(ids) < target:
            ids += rng.integers(0, tokenizer.vocab_size, size=target - len(ids)).tolist()
        else:
            ids = ids[:target]
    return prompt, ids
