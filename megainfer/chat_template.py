"""Chat templates: a checkpoint's Jinja template that turns chat messages into one prompt.

Where the template comes from, first found wins: the `--chat-template` override (a file, or
the template's text itself, as vLLM takes it), the checkpoint's `chat_template.jinja`, its
`chat_template.json` (`{"chat_template": ...}`), then `chat_template` in
tokenizer_config.json (a string, or a list of named templates of which "default" is used).

Rendering follows transformers' `apply_chat_template(tokenize=False)`: an immutable sandboxed
Jinja environment with trim_blocks and lstrip_blocks, the `raise_exception`, `strftime_now`,
`dict` and `namespace` globals, a `tojson` that keeps non-ASCII text, the `{% generation %}`
tag, and the tokenizer's special tokens (`bos_token`, `eos_token`, ...) as variables. The
template writes BOS itself, so the rendered prompt is tokenized with add_special_tokens=False.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from megainfer.errors import CheckpointError, ConfigError, RequestError
from megainfer.hf_config import read_json_object
from megainfer.tokenizer import read_tokenizer_config, special_token_strings

TEMPLATE_FILE = "chat_template.jinja"
TEMPLATE_JSON_FILE = "chat_template.json"
DEFAULT_TEMPLATE_NAME = "default"
# vLLM takes a --chat-template value holding any of these for the template itself, not a path.
TEMPLATE_CHARS = ("{", "}", "\n")
# Names a message's reasoning travels under; templates read the first (transformers aliases them).
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# Marks the end of the final message when it is continued rather than closed.
CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's own tojson escapes HTML characters, which would change the prompt.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


def _environment():
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(Extension):
        """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; rendering
        keeps the body as it is."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    class SafeNamespace(jinja2.utils.Namespace):
        """Jinja's namespace, refusing underscore names so templates cannot reach interpreter internals."""

        def __init__(*args, **kwargs):  # Jinja's signature trick: `namespace(self=...)` must work
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                SafeNamespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            SafeNamespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"chat templates cannot store underscore-prefixed attributes on a namespace, got {name!r}")

    class TemplateDict:
        """`dict(...)` and `dict.fromkeys(...)` without the dict type itself."""

        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationTag, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=_strftime_now, dict=TemplateDict(),
                       namespace=SafeNamespace)
    return env


def _plain(value: Any) -> Any:
    """JSON-like data only: the sandbox must not see objects whose methods it does not know."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, dict):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    for kind in (str, int, float):  # subclasses (enums, numpy scalars) lose their extra methods
        if isinstance(value, kind):
            return kind(value)
    return f"<{type(value).__name__}>"


def _content_text(content: Any, where: str) -> str:
    """A message's content: a string, or OpenAI content parts whose "text" parts are joined by
    newlines (as vLLM joins them)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"{where}.content must be a string or a list of content parts, "
                           f"got {type(content).__name__}")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict):
            raise RequestError(f"{where}.content[{j}] must be an object with 'type' and 'text', "
                               f"got {type(part).__name__}")
        if part.get("type") != "text":
            raise RequestError(f"{where}.content[{j}].type {part.get('type')!r} is not supported; this model "
                               "takes text parts only (type 'text')")
        if not isinstance(part.get("text"), str):
            raise RequestError(f"{where}.content[{j}].text must be a string, got {part.get('text')!r}")
        texts.append(part["text"])
    return "\n".join(texts)


def check_messages(messages: Any) -> list[dict[str, Any]]:
    """Chat messages as templates read them: plain dicts, content a string (or None for an
    assistant message with tool calls), reasoning under every name templates use."""
    if not isinstance(messages, list) or not messages:
        raise RequestError(f"messages must be a non-empty list of messages, got {messages!r:.80}")
    checked = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise RequestError(f"{where} must be an object with 'role' and 'content', got {type(message).__name__}")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise RequestError(f"{where}.role must be a non-empty string, got {role!r}")
        message = _plain(message)
        if message.get("content") is None:
            if not message.get("tool_calls"):
                raise RequestError(f"{where}.content is {'null' if 'content' in message else 'missing'}; every "
                                   "message needs content (only an assistant message with tool_calls may omit it)")
        else:
            message["content"] = _content_text(message["content"], where)
        reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        checked.append(message)
    return checked


@dataclass
class ChatTemplate:
    source: str  # the Jinja text
    origin: str  # where it came from, for messages
    special_tokens: dict[str, str] = field(default_factory=dict)  # bos_token, eos_token, ... as variables

    def __post_init__(self) -> None:
        import jinja2

        try:
            self._template = _environment().from_string(self.source)
        except jinja2.TemplateSyntaxError as exc:
            raise ConfigError(f"chat template from {self.origin}: line {exc.lineno}: {exc.message}") from None

    @classmethod
    def load(cls, checkpoint: Path | None, override: str | Path | None = None) -> "ChatTemplate | None":
        """The template to use (see the module docstring), or None when there is none."""
        config = read_tokenizer_config(checkpoint) if checkpoint is not None else {}
        special = special_token_strings(config)
        named = _named_templates(config, checkpoint)
        if override is not None:
            source, origin = _override(override, named)
            return cls(source, origin, special)
        if checkpoint is None:
            return None
        jinja_file, json_file = checkpoint / TEMPLATE_FILE, checkpoint / TEMPLATE_JSON_FILE
        if jinja_file.is_file():
            return cls(jinja_file.read_text(encoding="utf-8"), str(jinja_file), special)
        if json_file.is_file():
            source = read_json_object(json_file).get("chat_template")
            if not isinstance(source, str):
                raise CheckpointError(f"{json_file}: 'chat_template' must be a string, got {type(source).__name__}")
            return cls(source, str(json_file), special)
        if not named:
            return None
        where = f"{checkpoint / 'tokenizer_config.json'}"
        if DEFAULT_TEMPLATE_NAME not in named:
            raise CheckpointError(f"{where}: chat_template lists templates {sorted(named)} but none named "
                                  f"'{DEFAULT_TEMPLATE_NAME}'; pass --chat-template with one of the names or a file")
        return cls(named[DEFAULT_TEMPLATE_NAME], where, special)

    def render(self, messages: list[dict[str, Any]], /, add_generation_prompt: bool = True,
               continue_final_message: bool = False, **kwargs: Any) -> str:
        """The prompt text of `messages` (checked first: RequestError names the bad message and
        field). `continue_final_message` leaves the last message open for the model to go on
        with (vLLM's option); `kwargs` reach the template as variables (tools, documents,
        chat_template_kwargs such as enable_thinking), overriding the special tokens (never
        `messages` or `add_generation_prompt`); any name may be a variable, `self` included."""
        import jinja2

        chat = check_messages(messages)
        if continue_final_message:
            if add_generation_prompt:
                raise RequestError("continue_final_message and add_generation_prompt cannot both be true")
            if not isinstance(chat[-1].get("content"), str):
                raise RequestError(f"messages[{len(chat) - 1}].content: continue_final_message needs the final "
                                   "message's content")
            final = chat[-1]["content"]
            chat[-1] = {**chat[-1], "content": final + CONTINUE_TAG}
        # One mapping, not keywords: a variable may be called `self` (Template.render's own argument).
        variables = {"tools": None, "documents": None, **self.special_tokens, **_plain(kwargs),
                     "messages": chat, "add_generation_prompt": add_generation_prompt}
        try:
            text = self._template.render(variables)
        except jinja2.TemplateError as exc:
            raise RequestError(f"chat template: {exc.message or exc}") from None
        except (TypeError, ValueError, KeyError, IndexError, AttributeError, ZeroDivisionError) as exc:
            raise RequestError(f"chat template from {self.origin} failed on these messages: "
                               f"{type(exc).__name__}: {exc}") from None
        if continue_final_message:
            tag = text.rfind(CONTINUE_TAG.strip())
            if tag < 0 or final.strip() not in text:
                raise RequestError("continue_final_message: the chat template does not write the final message's "
                                   "content as given, so it cannot be continued")
            # A template that strips the message also strips the tag's trailing space: strip what precedes it too.
            text = text[:tag] if text[tag:tag + len(CONTINUE_TAG)] == CONTINUE_TAG else text[:tag].rstrip()
        return text


def _named_templates(config: dict[str, Any], checkpoint: Path | None) -> dict[str, str]:
    """tokenizer_config.json's chat_template as {name: template}; a single string is "default"."""
    value = config.get("chat_template")
    if value is None:
        return {}
    if isinstance(value, str):
        return {DEFAULT_TEMPLATE_NAME: value}
    where = f"{checkpoint / 'tokenizer_config.json'}" if checkpoint else "tokenizer_config.json"
    if isinstance(value, list) and all(isinstance(t, dict) and isinstance(t.get("name"), str)
                                       and isinstance(t.get("template"), str) for t in value):
        return {t["name"]: t["template"] for t in value}
    raise CheckpointError(f"{where}: chat_template must be a string or a list of {{name, template}} objects")


def _override(override: str | Path, named: dict[str, str]) -> tuple[str, str]:
    """--chat-template: a file, one of the checkpoint's named templates, or the template's text."""
    text = str(override)
    if isinstance(override, str) and text in named:
        return named[text], f"the checkpoint's template {text!r}"
    path = Path(text).expanduser()
    if isinstance(override, Path) or not any(c in text for c in TEMPLATE_CHARS):
        try:
            source = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"--chat-template {text!r}: cannot read the file ({exc}); pass a Jinja template "
                              "file or the template's text") from None
        if path.suffix == ".json":  # a chat_template.json of another checkpoint
            try:
                source = json.loads(source)["chat_template"]
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise ConfigError(f"--chat-template {text!r}: a .json file must hold {{\"chat_template\": "
                                  f"...}} ({exc!r})") from None
            if not isinstance(source, str):
                raise ConfigError(f"--chat-template {text!r}: 'chat_template' must be a string")
        return source, str(path)
    return text, "--chat-template"
