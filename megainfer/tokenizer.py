"""Tokenizers: a checkpoint's tokenizer.json through `tokenizers`, or bytes for presets.

`IncrementalDetokenizer` turns a growing list of token ids into text deltas for
streaming, holding back text while a multi-byte character or merge is still incomplete.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from megainfer.config import ModelConfig
from megainfer.errors import CheckpointError

REPLACEMENT = "\ufffd"


class Tokenizer(Protocol):
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes are ids 0..255; 256 is BOS (prepended), 257 is EOS; other ids decode to nothing."""

    BOS, EOS = 256, 257

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        return [self.BOS, *text.encode("utf-8")]

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer as _Tokenizer

        try:
            self._tok = _Tokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises a bare Exception on malformed files
            raise CheckpointError(f"{path}: cannot be read by `tokenizers` ({exc})") from None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=True).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)


def load_tokenizer(checkpoint: Path | None, cfg: ModelConfig) -> Tokenizer | None:
    """The checkpoint's tokenizer.json, the byte tokenizer for byte-vocabulary models, or None
    (then prompts must be token ids)."""
    if checkpoint is not None and (checkpoint / "tokenizer.json").is_file():
        return HFTokenizer(checkpoint / "tokenizer.json")
    if cfg.vocab_size >= 258:
        return ByteTokenizer(cfg.vocab_size)
    return None


class IncrementalDetokenizer:
    """Text of the generated ids so far, emitted as deltas (vLLM's prefix/read offsets)."""

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""

    def add(self, new_ids: list[int]) -> str:
        """Append ids; return the newly completed text (possibly empty)."""
        if self.tokenizer is None:
            return ""
        self.ids.extend(new_ids)
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset])
        full = self.tokenizer.decode(self.ids[self.prefix_offset:])
        if len(full) <= len(prefix) or full.endswith(REPLACEMENT):
            return ""  # an incomplete character: wait for the next token
        delta = full[len(prefix):]
        # The last emitted piece stays as context, so merges and leading spaces decode right.
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end: whatever was held back, replacement characters included."""
        if self.tokenizer is None or self.read_offset == len(self.ids):
            return ""
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset])
        delta = self.tokenizer.decode(self.ids[self.prefix_offset:])[len(prefix):]
        self.read_offset = len(self.ids)
        self.text += delta
        return delta
