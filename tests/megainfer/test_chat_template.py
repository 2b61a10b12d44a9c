"""Chat templates: where they are found, rendering equal to transformers' apply_chat_template,
messages checked, template errors as request errors."""

import json

import pytest

from megainfer.chat_template import ChatTemplate
from megainfer.errors import CheckpointError, ConfigError, RequestError
from tests.tokenizer_checkpoints import (CHATML, GENERATION_PROMPT, HARMONY, MIXTRAL, write_llama_style_tokenizer,
                                         write_qwen_style_tokenizer)

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "¿Qué tal? ✓"}]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return write_llama_style_tokenizer(tmp_path_factory.mktemp("llama"))


@pytest.mark.parametrize("template", [CHATML, MIXTRAL, GENERATION_PROMPT], ids=["chatml", "mixtral", "gen-prompt"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_render_equals_transformers(llama_dir, template, add_generation_prompt):
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoTokenizer.from_pretrained(str(llama_dir))
    ours = ChatTemplate.load(llama_dir, template)
    chat = CHAT[1:] if template == MIXTRAL else CHAT  # Mixtral's template refuses a system message
    expected = ref.apply_chat_template(chat, tokenize=False, add_generation_prompt=add_generation_prompt,
                                       chat_template=template)
    assert ours.render(chat, add_generation_prompt=add_generation_prompt) == expected
    if template == MIXTRAL:
        assert expected.startswith("<s>[INST] Hi there [/INST]Hello!</s>")


def test_raise_exception_becomes_a_request_error(llama_dir):
    template = ChatTemplate.load(llama_dir, MIXTRAL)
    with pytest.raises(RequestError, match="roles must alternate"):
        template.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


def test_checkpoint_template_sources_and_their_priority(tmp_path):
    ckpt = write_qwen_style_tokenizer(tmp_path)  # tokenizer_config.json holds CHATML
    messages = [{"role": "user", "content": "hi"}]
    assert ChatTemplate.load(ckpt).render(messages) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    (ckpt / "chat_template.json").write_text(json.dumps({"chat_template": "json:{{ messages[0].content }}"}))
    assert ChatTemplate.load(ckpt).render(messages) == "json:hi"
    (ckpt / "chat_template.jinja").write_text("jinja:{{ messages[0].content }}{{ eos_token }}")
    assert ChatTemplate.load(ckpt).render(messages) == "jinja:hi<|im_end|>"
    # The override wins: a file, or the template's text itself.
    override = tmp_path / "mine.jinja"
    override.write_text("file:{{ messages[0]['content'] }}")
    assert ChatTemplate.load(ckpt, override).render(messages) == "file:hi"
    assert ChatTemplate.load(ckpt, str(override)).render(messages) == "file:hi"
    assert ChatTemplate.load(ckpt, "text:{{ messages | length }}").render(messages) == "text:1"
    assert ChatTemplate.load(None, ckpt / "chat_template.json").render(messages) == "json:hi"
    assert ChatTemplate.load(None, "{{ bos_token }}x").render(messages) == "x"  # a preset has no special tokens


def test_no_template_is_none_and_bad_overrides_are_config_errors(tmp_path):
    ckpt = write_llama_style_tokenizer(tmp_path)
    assert ChatTemplate.load(ckpt) is None and ChatTemplate.load(None) is None
    with pytest.raises(ConfigError, match="--chat-template 'missing.jinja': cannot read"):
        ChatTemplate.load(ckpt, "missing.jinja")
    with pytest.raises(ConfigError, match="line 1"):
        ChatTemplate.load(ckpt, "{% for m in messages %}")


def test_named_templates_use_default_and_the_override_may_name_one(tmp_path):
    ckpt = write_qwen_style_tokenizer(tmp_path, chat_template=[
        {"name": "default", "template": "d:{{ messages[0].content }}"},
        {"name": "tool_use", "template": "t:{{ messages[0].content }}"}])
    messages = [{"role": "user", "content": "x"}]
    assert ChatTemplate.load(ckpt).render(messages) == "d:x"
    assert ChatTemplate.load(ckpt, "tool_use").render(messages) == "t:x"
    write_qwen_style_tokenizer(tmp_path, chat_template=[{"name": "tool_use", "template": "t"}])
    with pytest.raises(CheckpointError, match="none named 'default'"):
        ChatTemplate.load(ckpt)


@pytest.mark.parametrize("messages, match", [
    ([], "non-empty list"),
    ("hi", "non-empty list"),
    ([{"role": "user", "content": "a"}, "b"], r"messages\[1\] must be an object"),
    ([{"content": "a"}], r"messages\[0\].role"),
    ([{"role": "user"}], r"messages\[0\].content is missing"),
    ([{"role": "user", "content": 3}], r"messages\[0\].content must be a string"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], r"messages\[0\].content\[0\].type"),
    ([{"role": "user", "content": [{"type": "text", "text": None}]}], r"messages\[0\].content\[0\].text"),
])
def test_malformed_messages_are_request_errors(messages, match):
    with pytest.raises(RequestError, match=match):
        ChatTemplate(CHATML, "test").render(messages)


def test_content_parts_tool_calls_reasoning_and_kwargs_reach_the_template():
    template = ChatTemplate(
        "{% for m in messages %}{{ m.role }}={{ m.content }}|{{ m.reasoning_content }}|"
        "{{ m.tool_calls | tojson if m.tool_calls }};{% endfor %}{{ enable_thinking }}", "test")
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "é"}]
    text = template.render([{"role": "user", "content": parts},
                            {"role": "assistant", "content": None, "reasoning": "hmm",
                             "tool_calls": [{"name": "f", "arguments": "ü"}]}], enable_thinking=False)
    assert text == 'user=a\né||;assistant=None|hmm|[{"name": "f", "arguments": "ü"}];False'


def test_continue_final_message_leaves_the_last_message_open():
    template = ChatTemplate(CHATML, "test")
    chat = [{"role": "user", "content": "Count"}, {"role": "assistant", "content": "1, 2,"}]
    text = template.render(chat, add_generation_prompt=False, continue_final_message=True)
    assert text.endswith("<|im_start|>assistant\n1, 2,")
    with pytest.raises(RequestError, match="cannot both be true"):
        template.render(chat, continue_final_message=True)


def test_sandbox_and_namespace_guards_are_request_errors():
    with pytest.raises(RequestError, match="chat template"):
        ChatTemplate("{{ messages.__class__.__mro__ }}", "test").render([{"role": "user", "content": "x"}])
    with pytest.raises(RequestError, match="underscore"):
        ChatTemplate("{% set ns = namespace(_x=1) %}", "test").render([{"role": "user", "content": "x"}])


def test_strftime_now_and_loop_controls_are_available():
    from datetime import datetime

    template = ChatTemplate("{{ strftime_now('%Y') }}{% for m in messages %}{% if loop.index > 1 %}{% break %}"
                            "{% endif %}{{ m.content }}{% endfor %}", "test")
    text = template.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    assert text == f"{datetime.now().year}a"


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"},
        "units": {"type": "string", "enum": ["c", "f"]}, "hours": {"type": "array", "items": {"type": "integer"}}}}}}
HARMONY_CHATS = {
    "plain": [{"role": "user", "content": "Hi there"}],
    "developer-and-turns": CHAT,
    "tool-call-and-result": [
        {"role": "developer", "content": "Use tools."}, {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
            "name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}}]},
        {"role": "tool", "content": "{\"temp\": -3}"}],
}


@pytest.mark.parametrize("chat", HARMONY_CHATS)
@pytest.mark.parametrize("kwargs", [{}, {"reasoning_effort": "high", "model_identity": "You are megainfer's test."}],
                         ids=["defaults", "effort-and-identity"])
def test_harmony_template_renders_as_transformers_does(llama_dir, chat, kwargs):
    """gpt-oss's harmony format (the checkpoint's own chat_template.jinja is what megainfer
    renders): macros calling themselves, namespace state, strftime_now, tools, template kwargs."""
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoTokenizer.from_pretrained(str(llama_dir))
    messages, tools = HARMONY_CHATS[chat], [WEATHER_TOOL] if chat != "plain" else None
    expected = ref.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True,
                                       chat_template=HARMONY, **kwargs)
    ours = ChatTemplate.load(llama_dir, HARMONY).render(messages, tools=tools, **kwargs)
    assert ours == expected
    assert ours.endswith("<|start|>assistant") and ("Reasoning: high" in ours) == bool(kwargs)


def test_harmony_template_refuses_a_tool_result_without_a_call(llama_dir):
    with pytest.raises(RequestError, match="needs an assistant tool call"):
        ChatTemplate.load(llama_dir, HARMONY).render([{"role": "tool", "content": "{}"}])


def test_openai_reasoning_effort_reaches_the_template(llama_dir):
    """The chat API's `reasoning_effort` (OpenAI's field) becomes the template's variable, as
    gpt-oss's template reads it; chat_template_kwargs, where they set it too, win."""
    from types import SimpleNamespace

    from megainfer.server.openai_generate import _render_chat
    from megainfer.server.openai_protocol import ChatCompletionRequest

    served = SimpleNamespace(chat_template=ChatTemplate.load(llama_dir, HARMONY), name="m")
    body = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "Hi"}], reasoning_effort="low")
    assert "Reasoning: low" in _render_chat(served, body)
    body = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "Hi"}], reasoning_effort="low",
                                 chat_template_kwargs={"reasoning_effort": "high"})
    assert "Reasoning: high" in _render_chat(served, body)
