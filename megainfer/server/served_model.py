"""The model as the API frontends present it: the names clients ask for, its tokenizer and chat
template (prompts are tokenized here, so the frontend knows their lengths), and the sampling
defaults of its generation_config.json."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megainfer.chat_template import ChatTemplate
from megainfer.errors import ConfigError
from megainfer.generation_config import generation_defaults
from megainfer.model_resolution import resolve_model
from megainfer.tokenizer import Tokenizer, load_tokenizer


@dataclass
class ServedModel:
    name: str  # the name responses carry: the first --served-model-name, else the model argument
    root: str  # the checkpoint directory, preset name or hub id it was loaded from
    tokenizer: Tokenizer | None  # None: prompts must be token ids
    chat_template: ChatTemplate | None  # None: /v1/chat/completions answers 400
    defaults: dict[str, Any] = field(default_factory=dict)  # SamplingParams fields from generation_config.json
    max_model_len: int = 0  # prompt plus generated tokens, at most
    aliases: tuple[str, ...] = ()  # further names requests may use (vLLM's several --served-model-name)

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)

    @classmethod
    def load(cls, model: str | os.PathLike, served_model_name: str | list[str] | None = None,
             chat_template: str | Path | None = None, max_model_len: int | None = None) -> "ServedModel":
        """`model` as `megainfer serve --model` takes it; `chat_template` a Jinja file (or the
        template's text) that replaces the checkpoint's; `max_model_len` the engine's limit
        (default: the model's max_position_embeddings)."""
        config, checkpoint = resolve_model(model)
        names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name or [])
        if any(not n.strip() for n in names):
            raise ConfigError(f"--served-model-name {names!r}: a served name cannot be empty")
        names = names or [str(model)]
        limit = max_model_len or config.max_position_embeddings
        if limit > config.max_position_embeddings:
            raise ConfigError(f"--max-model-len {limit} exceeds the model's max_position_embeddings "
                              f"({config.max_position_embeddings})")
        return cls(name=names[0], root=str(model), tokenizer=load_tokenizer(checkpoint, config),
                   chat_template=ChatTemplate.load(checkpoint, chat_template),
                   defaults=generation_defaults(checkpoint), max_model_len=limit, aliases=tuple(names[1:]))

    def serves(self, name: str | None) -> bool:
        return name is None or name in self.names
