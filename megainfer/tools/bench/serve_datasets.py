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
  simulator's trace format (read by megainfer.tools.bench.workload.load_trace, so a trace means the
  same requests to the simulator and to a server). Each request carries its arrival and a prompt of
  exactly input_len token ids (runs of consecutive non-special ids from a random offset, as the
  random dataset draws them), sent as ids: no tokenizer round trip changes its length. The
  requests come in arrival order; --num-prompts keeps the file's first N lines.
- prefix_repetition (vLLM's): --prefix-repetition-num-prefixes N prefixes of
  --prefix-repetition-prefix-len random non-special token ids, each followed by num_prompts / N
  suffixes of --prefix-repetition-suffix-len random ids (every suffix distinct), asking for
  --prefix-repetition-output-len tokens; the requests shuffled with the seed. Prompts go as token ids
  (megainfer-grpc, openai), so a prefix is the same tokens in every request that shares it; the chat
  endpoint takes their decoded text instead. num_prompts must be a multiple of N (vLLM would drop the
  remainder silently).
- conversation: multi-turn chats replayed turn by turn, for /v1/chat/completions. With
  --dataset-path, a ShareGPT file's conversations of at least two (human, gpt) exchanges, shuffled
  with the seed (a leading non-human turn is skipped; a conversation ends at its first break in the
  alternation or a turn without text); without one, generated conversations of user turns of
  --conversation-input-len random tokens and replies of --conversation-output-len (decoded to text:
  tokens drawn from those that decode alone to printable text and encode back, so the text keeps
  about its length; adjacent tokens may merge). Turn k of a conversation is
  one request whose messages are the conversation so far (the previous user turns and the recorded
  replies, never the server's: every backend sees the same prompts) plus user turn k; it asks for
  the recorded reply's token count (--conversation-output-len fixes it). --conversation-num
  conversations (all distinct), at most --conversation-turns turns each (generated: exactly that
  many, default 5); a conversation is cut before the first turn whose context would not fit
  max_model_len (the messages' tokens, TEMPLATE_ALLOWANCE per message for the chat template, and
  the output). --num-prompts does not apply. The requests come turn-major (every conversation's
  first turn, then every second turn, ...), the order the sender paces them in; each carries its
  conversation and turn, and bench serve sends turn k + 1 only once turn k has completed.

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
from megainfer.tools.bench.workload import load_trace
from megainfer.tokenizer import Tokenizer

DATASETS = ("sharegpt", "random", "trace", "prefix_repetition", "conversation")
SHAREGPT_URL = ("https://huggingface.co/datasets/anon8231489123/ShareGPT_Vicuna_unfiltered/resolve/main/"
                "ShareGPT_V3_unfiltered_cleaned_split.json")
# vLLM's ShareGPT filter (datasets/utils.py is_valid_sequence), in tokens.
MIN_LEN, MAX_PROMPT_LEN, MAX_TOTAL_LEN = 4, 1024, 2048
DECODE_RETRIES = 10  # random dataset: decode/re-encode rounds before a length mismatch is accepted
DEFAULT_CONVERSATION_TURNS = 5  # generated conversations, without --conversation-turns
TEXT_ID_SAMPLE = 4096  # generated conversations: vocabulary ids tried as text material
TEMPLATE_ALLOWANCE = 8  # tokens per chat message a chat template may add (role markers), for the context check
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bard": "assistant",
                  "bing": "assistant", "assistant": "assistant"}


@dataclass(frozen=True)
class SampleRequest:
    prompt: str
    prompt_len: int  # tokens, as the benchmark's tokenizer counts them
    expected_output_len: int  # tokens asked for (max_tokens)
    request_id: str
    prompt_token_ids: tuple[int, ...] | None = None  # sent instead of the text where set (trace, prefix_repetition)
    arrival_s: float | None = None  # seconds after the start it is sent (trace); None: paced by the rate
    # conversation: the chat sent, (role, content) pairs ending with the new user turn (`prompt`)
    messages: tuple[tuple[str, str], ...] | None = None
    conversation: int | None = None  # conversation: which one (0-based); its turns are sent one after another
    turn: int | None = None  # conversation: the turn's index in it (0-based)


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
    prefix_repetition_prefix_len: int = 256  # tokens of each shared prefix
    prefix_repetition_suffix_len: int = 256  # tokens of each request's own suffix
    prefix_repetition_num_prefixes: int = 10
    prefix_repetition_output_len: int = 128
    conversation_num: int = 100  # conversations replayed
    conversation_turns: int | None = None  # turns per conversation at most; None: a file's all, generated 5
    conversation_input_len: int = 256  # generated conversations: tokens of each user turn
    conversation_output_len: int | None = None  # tokens asked per turn; None: the recorded reply's (generated: 128)
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
        if self.name in ("random", "prefix_repetition") and self.path is not None:
            raise ConfigError(f"--dataset-name {self.name} takes no --dataset-path (got {self.path}); for a ShareGPT "
                              f"file use --dataset-name sharegpt (or conversation), for a JSONL trace --dataset-name "
                              f"trace")
        if self.name == "conversation":
            self._check_conversation()
        elif self.num_prompts is None and self.name != "trace":
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
        if self.name == "prefix_repetition":
            self._check_prefix_repetition()

    def _check_prefix_repetition(self) -> None:
        for flag, value in (("--prefix-repetition-prefix-len", self.prefix_repetition_prefix_len),
                            ("--prefix-repetition-suffix-len", self.prefix_repetition_suffix_len),
                            ("--prefix-repetition-num-prefixes", self.prefix_repetition_num_prefixes),
                            ("--prefix-repetition-output-len", self.prefix_repetition_output_len)):
            if value <= 0:
                raise ConfigError(f"{flag} must be positive, got {value}")
        n, prefixes = self.num_prompts, self.prefix_repetition_num_prefixes
        if n < prefixes or n % prefixes:
            fix = f"{n - n % prefixes} or {n - n % prefixes + prefixes}" if n >= prefixes else f"{prefixes}"
            raise ConfigError(f"--num-prompts {n} must be a multiple of --prefix-repetition-num-prefixes {prefixes} "
                              f"(each prefix is shared by num_prompts / num_prefixes requests): pass --num-prompts "
                              f"{fix}, or change --prefix-repetition-num-prefixes")

    def _check_conversation(self) -> None:
        if self.num_prompts is not None:
            raise ConfigError(f"--num-prompts {self.num_prompts} does not apply to --dataset-name conversation, whose "
                              f"requests are the turns of --conversation-num conversations: drop it and set "
                              f"--conversation-num (and --conversation-turns)")
        for flag, value in (("--conversation-num", self.conversation_num),
                            ("--conversation-turns", self.conversation_turns),
                            ("--conversation-input-len", self.conversation_input_len),
                            ("--conversation-output-len", self.conversation_output_len)):
            if value is not None and value <= 0:
                raise ConfigError(f"{flag} must be positive, got {value}")


def sample_requests(spec: DatasetSpec, tokenizer: Tokenizer, max_model_len: int | None = None) -> list[SampleRequest]:
    """The run's requests. `max_model_len`: the context a trace's requests must fit (trace), and a
    conversation's turns (conversation; None: unchecked)."""
    if spec.name == "sharegpt":
        return sample_sharegpt(spec, tokenizer)
    if spec.name == "prefix_repetition":
        return sample_prefix_repetition(spec, tokenizer)
    if spec.name == "conversation":
        return sample_conversations(spec, tokenizer, max_model_len)
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


def sample_prefix_repetition(spec: DatasetSpec, tokenizer: Tokenizer) -> list[SampleRequest]:
    """vLLM's prefix_repetition requests, as token ids: every request of prefix k starts with the same ids."""
    rng = np.random.default_rng(spec.seed)
    allowed = _non_special_ids(tokenizer)
    n, num_prefixes = spec.num_prompts, spec.prefix_repetition_num_prefixes
    prefixes = _distinct_rows(rng, allowed, num_prefixes, spec.prefix_repetition_prefix_len,
                              "--prefix-repetition-prefix-len", "--prefix-repetition-num-prefixes prefixes")
    suffixes = _distinct_rows(rng, allowed, n, spec.prefix_repetition_suffix_len,
                              "--prefix-repetition-suffix-len", "--num-prompts suffixes")
    per_prefix = n // num_prefixes
    samples = []
    for i, k in enumerate(rng.permutation(n).tolist()):
        ids = (*prefixes[k // per_prefix], *suffixes[k])
        samples.append(SampleRequest(tokenizer.decode(list(ids)), len(ids), spec.prefix_repetition_output_len,
                                     f"{spec.request_id_prefix}{i}", prompt_token_ids=ids))
    return samples


def _distinct_rows(rng: np.random.Generator, allowed: np.ndarray, count: int, length: int, length_flag: str,
                   what: str) -> list[tuple[int, ...]]:
    """`count` distinct runs of `length` ids drawn from `allowed` (a drawn duplicate is drawn again)."""
    if len(allowed) ** min(length, 64) < count:
        raise ConfigError(f"{length_flag} {length}: only {len(allowed)}^{length} distinct runs of the tokenizer's "
                          f"{len(allowed)} ids exist, fewer than the {count} {what}; raise {length_flag}")
    rows: dict[tuple[int, ...], None] = {}
    while len(rows) < count:
        for row in allowed[rng.integers(0, len(allowed), size=(count - len(rows), length))].tolist():
            rows.setdefault(tuple(row), None)
    return list(rows)


# A conversation as it is replayed: (user turn, recorded reply, tokens asked for) per exchange.
Exchange = tuple[str, str, int]


def sample_conversations(spec: DatasetSpec, tokenizer: Tokenizer,
                         max_model_len: int | None) -> list[SampleRequest]:
    """Every turn of `conversation_num` conversations, turn-major, each with the conversation so far."""
    if spec.path is None:
        conversations = _generated_conversations(spec, tokenizer)
    else:
        conversations = _sharegpt_conversations(spec, tokenizer, max_model_len)
    samples = []
    for c, exchanges in enumerate(conversations):
        history: list[tuple[str, str]] = []
        history_len = 0  # tokens of the history's contents
        for t, (user, reply, output_len) in enumerate(_fitting(exchanges, tokenizer, max_model_len)):
            user_len = len(tokenizer.encode(user, add_special_tokens=False))
            messages = (*history, ("user", user))
            samples.append(SampleRequest(user, history_len + user_len, output_len,
                                         f"{spec.request_id_prefix}{c}-{t}", messages=messages, conversation=c,
                                         turn=t))
            history += [("user", user), ("assistant", reply)]
            history_len += user_len + len(tokenizer.encode(reply, add_special_tokens=False))
    if not samples:
        raise ConfigError(f"--conversation-input-len {spec.conversation_input_len} and --conversation-output-len "
                          f"{spec.conversation_output_len or 128}: a first turn does not fit the model's context of "
                          f"{max_model_len} tokens; lower them")
    return sorted(samples, key=lambda s: (s.turn, s.conversation))


def _fitting(exchanges: list[Exchange], tokenizer: Tokenizer, max_model_len: int | None) -> list[Exchange]:
    """The exchanges before the first whose context (contents, template allowance, output) passes max_model_len."""
    used = 0  # tokens of the conversation so far, with the template's allowance
    for i, (user, reply, output_len) in enumerate(exchanges):
        used += len(tokenizer.encode(user, add_special_tokens=False)) + TEMPLATE_ALLOWANCE
        if max_model_len is not None and used + output_len > max_model_len:
            return exchanges[:i]
        used += len(tokenizer.encode(reply, add_special_tokens=False)) + TEMPLATE_ALLOWANCE
    return exchanges


def _generated_conversations(spec: DatasetSpec, tokenizer: Tokenizer) -> list[list[Exchange]]:
    rng = np.random.default_rng(spec.seed)
    pool = _text_ids(tokenizer, rng)
    turns = spec.conversation_turns or DEFAULT_CONVERSATION_TURNS
    output_len = spec.conversation_output_len or 128

    def text(length: int) -> str:
        return tokenizer.decode(pool[rng.integers(0, len(pool), size=length)].tolist())

    return [[(text(spec.conversation_input_len), text(output_len), output_len) for _ in range(turns)]
            for _ in range(spec.conversation_num)]


def _text_ids(tokenizer: Tokenizer, rng: np.random.Generator) -> np.ndarray:
    """Non-special ids (of up to TEXT_ID_SAMPLE drawn from the vocabulary) that decode alone to
    printable text which encodes back to the id: chat text, unlike random ids (a byte-level vocabulary's
    lone high bytes decode to U+FFFD), keeps its length and its difference from other draws."""
    allowed = _non_special_ids(tokenizer)
    sample = allowed if len(allowed) <= TEXT_ID_SAMPLE else rng.choice(allowed, TEXT_ID_SAMPLE, replace=False)
    pool = []
    for i in sample.tolist():
        piece = tokenizer.decode([i])
        if piece.isprintable() and piece.strip() and tokenizer.encode(piece, add_special_tokens=False) == [i]:
            pool.append(i)
    if not pool:
        raise ConfigError(f"--dataset-name conversation without --dataset-path writes its text from tokens that "
                          f"decode to printable text and encode back, and none of {len(sample)} tokens of this "
                          f"tokenizer does: pass --dataset-path a ShareGPT file")
    return np.array(sorted(pool))


def _sharegpt_conversations(spec: DatasetSpec, tokenizer: Tokenizer,
                            max_model_len: int | None) -> list[list[Exchange]]:
    entries = _load_sharegpt(Path(spec.path))
    random.Random(spec.seed).shuffle(entries)
    conversations = []
    for entry in entries:
        if len(conversations) == spec.conversation_num:
            break
        pairs = _exchanges(entry["conversations"])
        if len(pairs) < 2:
            continue  # not a multi-turn conversation
        exchanges = [(user, reply, spec.conversation_output_len or len(tokenizer.encode(reply,
                                                                                        add_special_tokens=False)))
                     for user, reply in pairs[:spec.conversation_turns]]
        if _fitting(exchanges, tokenizer, max_model_len):
            conversations.append(exchanges)
    if len(conversations) < spec.conversation_num:
        raise ConfigError(f"--conversation-num {spec.conversation_num}: --dataset-path {spec.path} holds only "
                          f"{len(conversations)} conversations of two or more (human, gpt) exchanges whose first "
                          f"turn fits the context; lower --conversation-num (or pass no --dataset-path for "
                          f"generated conversations)")
    return conversations


def _exchanges(turns: list) -> list[tuple[str, str]]:
    """(user, reply) pairs of a ShareGPT conversation: from its first human turn to its first break."""
    roles = [SHAREGPT_ROLES.get(t.get("from")) if isinstance(t, dict) and isinstance(t.get("value"), str)
             and t["value"] else None for t in turns]
    start = roles.index("user") if "user" in roles else len(roles)
    pairs = []
    for i in range(start, len(turns) - 1, 2):
        if (roles[i], roles[i + 1]) != ("user", "assistant"):
            break
        pairs.append((turns[i]["value"], turns[i + 1]["value"]))
    return pairs
