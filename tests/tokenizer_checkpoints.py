"""Tokenizer files of the two families megainfer serves, written the way their checkpoints ship
them, for tests that compare with transformers' AutoTokenizer (tests never import each other,
so these live here)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

CORPUS = ["The quick brown fox jumps over the lazy dog.", "Hello world, hello tokenizer!",
          "Mixture-of-experts models route every token to a few experts.", "naïve café — ✓ 你好 1234",
          "def f(x):\n    return x * 2\n"] * 8

# A ChatML template (Qwen-style), a Mixtral-style one that enforces alternation, and one that
# writes BOS and an assistant header only on add_generation_prompt.
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
MIXTRAL = ("{{ bos_token }}{% for message in messages %}"
           "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
           "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
           "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
           "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
           "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}")
GENERATION_PROMPT = """{{- bos_token }}
{%- for message in messages %}
    {%- if message.role == 'system' %}
<<SYS>> {{ message.content | trim }} <</SYS>>
    {% else %}
<|{{ message.role }}|>
{{ message.content }}
    {%- endif %}
{%- endfor %}
{% if add_generation_prompt %}
<|assistant|>
{% endif %}"""


def write_llama_style_tokenizer(directory: Path, **config: Any) -> Path:
    """A Mixtral/Llama-style tokenizer: byte-fallback BPE over Metaspace pieces, `<unk>`, `<s>`,
    `</s>` as ids 0..2, a post-processor that prepends `<s>` (as Mixtral's tokenizer.json does),
    and tokenizer_config.json with `config` merged in."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    directory.mkdir(parents=True, exist_ok=True)
    specials = ["<unk>", "<s>", "</s>"]
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials, show_progress=False)
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tok.train_from_iterator(CORPUS, trainer)
    # Byte fallback needs the 256 byte tokens in the model's vocabulary (not as added tokens).
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for token in byte_tokens:
        vocab.setdefault(token, len(vocab))
    tok = Tokenizer.from_str(json.dumps(spec))
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(content=" ", left=1)])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", 1)])
    tok.save(str(directory / "tokenizer.json"))
    base = {"tokenizer_class": "LlamaTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
            "add_bos_token": True, "add_eos_token": False, "clean_up_tokenization_spaces": False, "legacy": False,
            "add_prefix_space": None}
    (directory / "tokenizer_config.json").write_text(json.dumps({**base, **config}))
    return directory


QWEN_PRETOKENIZE_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                          r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")


def write_qwen_style_tokenizer(directory: Path, **config: Any) -> Path:
    """A Qwen-style tokenizer: byte-level BPE behind Qwen2's split regex and NFC, no BOS, the
    ChatML tokens `<|endoftext|>`, `<|im_start|>`, `<|im_end|>` as added special tokens and
    `<think>` as a plain added token; tokenizer_config.json as Qwen3 ships it, `config` merged in."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from tokenizers import processors, trainers

    directory.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=420, show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    tok.add_tokens([AddedToken("<think>", special=False, normalized=False)])
    tok.save(str(directory / "tokenizer.json"))
    decoder = {str(tok.token_to_id(t)): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                         "single_word": False, "special": t != "<think>"}
               for t in [*specials, "<think>"]}
    base = {"tokenizer_class": "Qwen2Tokenizer", "add_bos_token": False, "add_prefix_space": False,
            "added_tokens_decoder": decoder, "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
            "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": None,
            "clean_up_tokenization_spaces": False, "errors": "replace", "split_special_tokens": False,
            "chat_template": CHATML}
    (directory / "tokenizer_config.json").write_text(json.dumps({**base, **config}))
    return directory


# A template in gpt-oss's harmony format (openai/gpt-oss-*'s chat_template.jinja renders the same
# layout; this one is written for the tests): a system message carrying the date and the
# `reasoning_effort` kwarg, a developer message with the instructions and the tools as a
# TypeScript namespace (a recursive macro), assistant turns on the final channel, a tool call on
# the commentary channel and its result, `namespace` state across the loop, `raise_exception`.
HARMONY = """{%- macro ts_type(spec) -%}
{%- if spec.type == "array" -%}{{ ts_type(spec['items']) }}[]
{%- elif spec.type == "object" and spec.properties -%}{ {% for name, p in spec.properties.items() %}{{ name }}: {{ ts_type(p) }}{% if not loop.last %}, {% endif %}{% endfor %} }
{%- elif spec.type == "integer" -%}number
{%- elif spec.enum -%}"{{ spec.enum | join('" | "') }}"
{%- else -%}{{ spec.type or "any" }}{%- endif -%}
{%- endmacro -%}
{{- "<|start|>system<|message|>" + (model_identity if model_identity is defined else "You are a model.") + "\\n" }}
{{- "Current date: " + strftime_now("%Y-%m-%d") + "\\n\\n" }}
{{- "Reasoning: " + (reasoning_effort if reasoning_effort is defined else "medium") + "\\n\\n" }}
{{- "# Valid channels: analysis, commentary, final.<|end|>" }}
{%- if messages[0].role in ("system", "developer") -%}
{%- set developer = messages[0].content -%}{%- set turns = messages[1:] -%}
{%- else -%}{%- set developer = "" -%}{%- set turns = messages -%}{%- endif -%}
{%- if developer or tools -%}
{{- "<|start|>developer<|message|>" }}{% if developer %}{{ "# Instructions\\n\\n" + developer }}{% endif %}
{%- if tools %}{{ "\\n\\n# Tools\\n\\nnamespace functions {\\n" }}{% for t in tools %}{% set f = t.function %}
{{- "// " + f.description + "\\ntype " + f.name + " = (_: " + ts_type(f.parameters) + ") => any;\\n" }}{% endfor %}{{ "} // namespace functions" }}{% endif %}
{{- "<|end|>" }}
{%- endif -%}
{%- set state = namespace(tool=none) -%}
{%- for m in turns -%}
{%- if m.role == "assistant" -%}
{%- if m.tool_calls -%}{%- set call = m.tool_calls[0].function -%}
{{- "<|start|>assistant to=functions." + call.name + "<|channel|>commentary json<|message|>" + call.arguments | tojson + "<|call|>" }}
{%- set state.tool = call.name -%}
{%- else -%}{{ "<|start|>assistant<|channel|>final<|message|>" + m.content + "<|end|>" }}{%- endif -%}
{%- elif m.role == "tool" -%}
{%- if state.tool is none %}{{ raise_exception("a tool message needs an assistant tool call before it") }}{% endif -%}
{{- "<|start|>functions." + state.tool + " to=assistant<|channel|>commentary<|message|>" + m.content | tojson + "<|end|>" }}
{%- else -%}{{ "<|start|>user<|message|>" + m.content + "<|end|>" }}{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}"""
