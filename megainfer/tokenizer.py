"""Tokenizers: a checkpoint's tokenizer.json (with its tokenizer_config.json) through
`tokenizers`, or bytes for presets.

`HFTokenizer` follows transformers' `AutoTokenizer` (5.x) for checkpoints that ship
tokenizer.json: the file's post-processor decides which special tokens `encode` adds (a
Mixtral tokenizer.json prepends `<s>`, a Qwen one adds nothing), since transformers drops
tokenizer_config.json's `add_bos_token`/`add_eos_token` whenever tokenizer.json exists;
tokenizer_config.json names the special tokens (`bos_token`, `eos_token`, ...), adds those
tokenizer.json lacks, and sets `split_special_tokens` and `clean_up_tokenization_spaces`.
Transformers' per-family classes may rebuild a tokenizer from its vocabulary; megainfer runs
tokenizer.json as written.

`IncrementalDetokenizer` turns a growing list of token ids into text deltas for
streaming, holding back text while a multi-byte character or merge is still incomplete.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from megainfer.config import ModelConfig
from megainfer.errors import CheckpointError, RequestError
from megainfer.hf_config import read_json_object

REPLACEMENT = "\ufffd"
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
# tokenizer_config.json keys naming one special token each (transformers' SPECIAL_TOKENS_ATTRIBUTES).
NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# transformers' clean_up_tokenization: spaces a WordPiece-style decode leaves before punctuation.
CLEAN_UP_REPLACEMENTS = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                         (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))


class Tokenizer(Protocol):
    vocab_size: int
    bos_token_id: int | None  # None where the tokenizer names no BOS token
    eos_token_ids: tuple[int, ...]  # the tokenizer's own EOS (the model's config may name more)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; `add_special_tokens` adds what the tokenizer adds around a
        sequence (BOS for Mixtral, nothing for Qwen). Chat prompts pass False: the template
        writes its special tokens itself. Text that is not valid Unicode raises RequestError
        (`check_text`)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...

    def token_text(self, token_id: int) -> str:
        """One token's own text (for logprobs): the token decoded alone, special tokens included."""


def check_text(text: str) -> None:
    """Raise RequestError unless `text` is valid Unicode: a lone surrogate (which a JSON escape
    such as \\ud800 can carry into a Python string) has no UTF-8 form, so no tokenizer takes it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise RequestError(f"text holds a lone surrogate U+{ord(text[exc.start]):04X} at character {exc.start}, "
                           "which is not valid Unicode; send valid UTF-8 (a character beyond U+FFFF as its "
                           "surrogate pair)") from None


class ByteTokenizer:
    """UTF-8 bytes are ids 0..255; 256 is BOS (`<s>`), 257 is EOS (`</s>`); other ids decode to nothing."""

    BOS, EOS = 256, 257
    SPECIAL_TEXT = {BOS: "<s>", EOS: "</s>"}

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.bos_token_id: int | None = self.BOS
        self.eos_token_ids: tuple[int, ...] = (self.EOS,)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        check_text(text)
        body = list(text.encode("utf-8"))
        return [self.BOS, *body] if add_special_tokens else body

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        # Bytes between special tokens decode together, so a character split across ids stays whole.
        pieces: list[str] = []
        run = bytearray()
        for i in ids:
            if 0 <= i < 256:
                run.append(i)
            elif not skip_special_tokens and i in self.SPECIAL_TEXT:
                pieces.append(run.decode("utf-8", errors="replace"))
                pieces.append(self.SPECIAL_TEXT[i])
                run = bytearray()
        pieces.append(run.decode("utf-8", errors="replace"))
        return "".join(pieces)

    def token_text(self, token_id: int) -> str:
        return self.decode([token_id], skip_special_tokens=False)


def _token_content(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken's fields."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _added_token(entry: Any, special: bool):
    from tokenizers import AddedToken

    if isinstance(entry, dict):
        return AddedToken(entry["content"], single_word=bool(entry.get("single_word", False)),
                          lstrip=bool(entry.get("lstrip", False)), rstrip=bool(entry.get("rstrip", False)),
                          normalized=bool(entry.get("normalized", not special)),
                          special=bool(entry.get("special", special)))
    return AddedToken(entry, special=special, normalized=False)


def read_tokenizer_config(directory: Path) -> dict[str, Any]:
    """tokenizer_config.json of a checkpoint ({} when it has none)."""
    return read_json_object(directory / TOKENIZER_CONFIG_FILE)


def special_token_strings(config: dict[str, Any]) -> dict[str, str]:
    """The named special tokens tokenizer_config.json sets, e.g. {"bos_token": "<s>", ...}."""
    named = {key: _token_content(config.get(key)) for key in NAMED_SPECIAL_TOKENS}
    return {key: value for key, value in named.items() if value is not None}


class HFTokenizer:
    """A checkpoint's tokenizer.json, with its tokenizer_config.json (see the module docstring)."""

    def __init__(self, directory: str | Path) -> None:
        from tokenizers import Tokenizer as _Tokenizer

        directory = Path(directory)
        if directory.name == TOKENIZER_FILE:
            directory = directory.parent
        path = directory / TOKENIZER_FILE
        try:
            self._tok = _Tokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises a bare Exception on malformed files
            raise CheckpointError(f"{path}: cannot be read by `tokenizers` ({exc})") from None
        config = read_tokenizer_config(directory)
        # Encoding a prompt never truncates or pads it, whatever tokenizer.json says (as transformers).
        self._tok.no_truncation()
        self._tok.no_padding()
        self._add_missing_tokens(config, directory)
        self._tok.encode_special_tokens = bool(config.get("split_special_tokens", False))
        # transformers skips the clean-up for BPE models: it would eat real spaces before punctuation.
        self._clean_up = (bool(config.get("clean_up_tokenization_spaces", False))
                          and type(self._tok.model).__name__ != "BPE")
        self.special_tokens = special_token_strings(config)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.bos_token_id = self._id_of("bos_token", directory)
        eos = self._id_of("eos_token", directory)
        self.eos_token_ids = () if eos is None else (eos,)

    def _add_missing_tokens(self, config: dict[str, Any], directory: Path) -> None:
        """Added tokens and special tokens tokenizer_config.json names but tokenizer.json lacks."""
        present = {token.content for token in self._tok.get_added_tokens_decoder().values()}
        wanted: list[tuple[Any, bool]] = []
        decoder = config.get("added_tokens_decoder") or {}
        if not isinstance(decoder, dict):
            raise CheckpointError(f"{directory / TOKENIZER_CONFIG_FILE}: added_tokens_decoder must map ids to "
                                  f"tokens, got {type(decoder).__name__}")
        for _, entry in sorted(decoder.items(), key=lambda item: int(item[0])):
            if isinstance(entry, dict) and isinstance(entry.get("content"), str):
                wanted.append((entry, bool(entry.get("special", False))))
        wanted += [(content, True) for content in special_token_strings(config).values()]
        extra = config.get("extra_special_tokens", config.get("additional_special_tokens")) or []
        if isinstance(extra, dict):  # transformers 5 may name them: {"image_token": "<image>"}
            extra = list(extra.values())
        wanted += [(entry, True) for entry in extra if _token_content(entry) is not None]
        for entry, special in wanted:
            content = _token_content(entry)
            if content in present:
                continue
            present.add(content)
            token = _added_token(entry, special)
            if token.special:
                self._tok.add_special_tokens([token])
            else:
                self._tok.add_tokens([token])

    def _id_of(self, key: str, directory: Path) -> int | None:
        content = self.special_tokens.get(key)
        if content is None:
            return None
        token_id = self._tok.token_to_id(content)
        if token_id is None:
            raise CheckpointError(f"{directory / TOKENIZER_CONFIG_FILE}: {key} {content!r} is not in the "
                                  "tokenizer's vocabulary")
        return token_id

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        check_text(text)
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        text = self._tok.decode(ids, skip_special_tokens=skip_special_tokens)
        if self._clean_up:
            for old, new in CLEAN_UP_REPLACEMENTS:
                text = text.replace(old, new)
        return text

    def token_text(self, token_id: int) -> str:
        return self._tok.decode([token_id], skip_special_tokens=False)

    def token_bytes(self, skip_special_tokens: bool) -> list[bytes] | None:
        """Each token id's bytes where decoding is their concatenation read as UTF-8 (a byte-level
        BPE whose decoder is exactly `ByteLevel`, with no clean-up): what `tokenizers`' ByteLevel
        decoder maps each token's characters to (a token with a character outside the byte
        alphabet gives its own UTF-8 bytes), special tokens empty when skipped. None otherwise.
        Built once per setting, on first use."""
        if self._clean_up or type(self._tok.decoder).__name__ != "ByteLevel":
            return None
        tables = self.__dict__.setdefault("_token_bytes", {})
        if skip_special_tokens not in tables:
            byte_of = _byte_level_alphabet()
            special = {i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}
            table = []
            for i in range(self.vocab_size):
                token = self._tok.id_to_token(i)
                if token is None or (skip_special_tokens and i in special):
                    table.append(b"")
                elif all(c in byte_of for c in token):
                    table.append(bytes(byte_of[c] for c in token))
                else:
                    table.append(token.encode("utf-8"))
            tables[skip_special_tokens] = table
        return tables[skip_special_tokens]


    def token_texts(self, skip_special_tokens: bool) -> list[str | None]:
        """`token_bytes` decoded where a token's bytes are whole UTF-8 on their own, else None
        (a token that ends inside a character, or holds invalid bytes). Built once per setting."""
        tables = self.__dict__.setdefault("_token_texts", {})
        if skip_special_tokens not in tables:
            tables[skip_special_tokens] = [_whole_utf8(b) for b in self.token_bytes(skip_special_tokens)]
        return tables[skip_special_tokens]


def _whole_utf8(data: bytes) -> str | None:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-to-character map, inverted: the character byte-level BPE writes for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def _complete_prefix(data: bytearray) -> int:
    """How many leading bytes of `data` to decode now: all but a trailing UTF-8 sequence that is
    still incomplete (a lead byte whose continuation bytes have not all arrived)."""
    n = len(data)
    for back in range(1, min(3, n) + 1):
        b = data[n - back]
        if b & 0xC0 == 0x80:  # a continuation byte: look further back for its lead
            continue
        need = 2 if 0xC2 <= b <= 0xDF else 3 if 0xE0 <= b <= 0xEF else 4 if 0xF0 <= b <= 0xF4 else 1
        return n - back if need > back else n
    return n


def load_tokenizer(checkpoint: Path | None, cfg: ModelConfig) -> Tokenizer | None:
    """The checkpoint's tokenizer.json, the byte tokenizer for byte-vocabulary models, or None
    (then prompts must be token ids)."""
    if checkpoint is not None and (checkpoint / TOKENIZER_FILE).is_file():
        return HFTokenizer(checkpoint)
    if cfg.vocab_size >= 258:
        return ByteTokenizer(cfg.vocab_size)
    return None


class IncrementalDetokenizer:
    """A request's generated ids as text deltas. A byte-level BPE (`HFTokenizer.token_bytes`)
    appends each token's bytes and reads off the complete UTF-8, holding back an unfinished
    character; any other tokenizer decodes two windows per token (vLLM's prefix/read offsets),
    since its decoding is not concatenation (Metaspace, byte fallback, stripping, clean-up).
    Either way the deltas and the flush add up to `decode` of all the ids."""

    def __init__(self, tokenizer: Tokenizer | None, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        # Byte-level BPE: decoding is concatenation, so each token's bytes are appended and the
        # complete UTF-8 read off (a step's cost per sequence a dict-free lookup, not two decodes).
        table = getattr(tokenizer, "token_bytes", None)
        self._bytes: list[bytes] | None = table(skip_special_tokens) if table is not None else None
        # Each token's text where its bytes are whole UTF-8 on their own (None where not): with
        # nothing pending, a token's delta is that text, one list lookup.
        self._texts: list[str | None] | None = tokenizer.token_texts(skip_special_tokens) \
            if self._bytes is not None else None
        self._pending = bytearray()

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, new_ids: list[int]) -> str:
        """Append ids; return the newly completed text (possibly empty)."""
        tokenizer = self.tokenizer
        if tokenizer is None:
            return ""
        if self._bytes is not None:
            pending, table = self._pending, self._bytes
            for i in new_ids:
                pending += table[i]
            cut = _complete_prefix(pending)
            if not cut:
                return ""
            delta = pending[:cut].decode("utf-8", errors="replace")
            del pending[:cut]
            return delta
        ids = self.ids
        ids.extend(new_ids)
        skip = self.skip_special_tokens
        prefix = tokenizer.decode(ids[self.prefix_offset:self.read_offset], skip_special_tokens=skip)
        full = tokenizer.decode(ids[self.prefix_offset:], skip_special_tokens=skip)
        if len(full) <= len(prefix) or full.endswith(REPLACEMENT):
            return ""  # an incomplete character: wait for the next token
        delta = full[len(prefix):]
        # The last emitted piece stays as context, so merges and leading spaces decode right.
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        return delta

    def add_one(self, token_id: int) -> str:
        """`add([token_id])`, without the work where nothing is pending and the token's bytes are
        whole UTF-8 (almost every token of a byte-level BPE)."""
        if self._texts is not None and not self._pending:
            text = self._texts[token_id]
            if text is not None:
                return text
        return self.add([token_id])

    def flush(self) -> str:
        """At the end: whatever was held back, replacement characters included."""
        if self._bytes is not None:
            delta = self._pending.decode("utf-8", errors="replace")
            self._pending.clear()
            return delta
        if self.tokenizer is None or self.read_offset == len(self.ids):
            return ""
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        delta = self._decode(self.ids[self.prefix_offset:])[len(prefix):]
        self.read_offset = len(self.ids)
        return delta
