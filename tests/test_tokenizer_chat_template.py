"""Chat template rendering, checked against transformers' `apply_chat_template(tokenize=False)`."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import models, pre_tokenizers

from titan.tokenizer import Tokenizer
from titan.tokenizer.chat_template import (
    FALLBACK_CHAT_TEMPLATE,
    ChatTemplateError,
    normalize_messages,
    render_chat_template,
    template_variables,
)

transformers = pytest.importorskip("transformers")

SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, "
    "trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Llama-3-style: BOS variable, whitespace control, trim, strftime_now, tools through tojson, loop controls.
LLAMA3_STYLE_TEMPLATE = """{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Today Date: " + strftime_now("%Y") + "\\n\\n" }}
{%- if tools is not none %}
    {%- for tool in tools %}
        {{- tool | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {%- if message['role'] == 'tool' %}{% continue %}{% endif %}
    {%- if message['role'] not in ['user', 'assistant'] %}
        {{- raise_exception('Unknown role: ' + message['role']) }}
    {%- endif %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}
    {{- message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""
# Block statements on their own lines: exercises trim_blocks / lstrip_blocks, plus `{% generation %}`.
BLOCKY_TEMPLATE = """{% for message in messages %}
    {% if message.role == 'assistant' %}
<assistant>{% generation %}{{ message.content }}{% endgeneration %}</assistant>
    {% else %}
<{{ message.role }}>{{ message.content }}</{{ message.role }}>
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}
<assistant>
{% endif %}
"""
CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "  Answer in French.  "}, {"role": "user", "content": "Hi"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "Und auf Deutsch? 你好 🤗"},
    ],
]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Météo à Paris",
                                           "parameters": {"type": "object", "properties": {}}}}]


@pytest.fixture(scope="module")
def reference():
    backend = BackendTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>")


def render(template: str, messages: list[dict], **kwargs) -> str:
    return render_chat_template(template, messages, special_tokens={"bos_token": "<s>", "eos_token": "</s>"},
                                **kwargs)


@pytest.mark.parametrize("template", [SMOLLM2_TEMPLATE, LLAMA3_STYLE_TEMPLATE, BLOCKY_TEMPLATE],
                         ids=["smollm2", "llama3-style", "blocky"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_matches_transformers(reference, template: str, add_generation_prompt: bool) -> None:
    for messages in CONVERSATIONS:
        expected = reference.apply_chat_template(messages, tokenize=False, chat_template=template,
                                                 add_generation_prompt=add_generation_prompt)
        assert render(template, messages, add_generation_prompt=add_generation_prompt) == expected


def test_tools_match_transformers(reference) -> None:
    messages = CONVERSATIONS[1]
    expected = reference.apply_chat_template(messages, tokenize=False, chat_template=LLAMA3_STYLE_TEMPLATE,
                                             add_generation_prompt=True, tools=TOOLS)
    rendered = render(LLAMA3_STYLE_TEMPLATE, messages, tools=TOOLS)
    assert rendered == expected
    assert "Météo à Paris" in rendered  # tojson keeps non-ASCII text


def test_text_parts_are_joined(reference) -> None:
    parts = [{"role": "user", "content": [{"type": "text", "text": "First line."},
                                          {"type": "text", "text": "Second line."}]}]
    joined = [{"role": "user", "content": "First line.\nSecond line."}]
    expected = reference.apply_chat_template(joined, tokenize=False, chat_template=SMOLLM2_TEMPLATE,
                                             add_generation_prompt=True)
    assert render(SMOLLM2_TEMPLATE, parts) == expected
    assert normalize_messages(parts) == joined
    assert parts[0]["content"][0]["text"] == "First line."  # the caller's messages are not modified


def test_non_text_parts_are_rejected() -> None:
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    with pytest.raises(ValueError, match="image_url"):
        render(SMOLLM2_TEMPLATE, messages)
    with pytest.raises(ValueError, match="role"):
        render(SMOLLM2_TEMPLATE, [{"content": "no role"}])


def test_raise_exception_and_errors_are_value_errors() -> None:
    with pytest.raises(ChatTemplateError, match="Unknown role: narrator"):
        render(LLAMA3_STYLE_TEMPLATE, [{"role": "narrator", "content": "Once"}])
    with pytest.raises(ValueError, match="invalid chat template"):
        render("{% for m in messages %}", CONVERSATIONS[0])
    # The sandbox is immutable: a template cannot modify the conversation.
    with pytest.raises(ChatTemplateError):
        render("{{ messages.append(1) }}", CONVERSATIONS[0])


def test_unset_special_tokens_render_empty() -> None:
    assert render_chat_template("[{{ bos_token }}]{{ messages[0].content }}", CONVERSATIONS[0]) == "[]Hello!"


def test_fallback_template_is_chatml() -> None:
    rendered = render(FALLBACK_CHAT_TEMPLATE, CONVERSATIONS[0])
    assert rendered == "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n"


def test_tokenizer_passes_its_special_tokens(tmp_path) -> None:
    backend = BackendTokenizer(models.BPE())
    backend.add_special_tokens(["<s>", "</s>"])
    backend.save(str(tmp_path / "tokenizer.json"))
    template = "{{ bos_token }}{{ messages[0].content }}{{ eos_token }}"
    config = {"bos_token": "<s>", "eos_token": "</s>", "chat_template": template}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = Tokenizer.from_folder(tmp_path)
    assert tokenizer.apply_chat_template(CONVERSATIONS[0]) == "<s>Hello!</s>"


# A reply begun for the model: once ending in spaces (kept where the template keeps text as it is, trimmed
# where the template trims it, as transformers does).
PREFILLED = [
    CONVERSATIONS[2][:3] + [{"role": "user", "content": "And 3+3?"}, {"role": "assistant", "content": "It is"}],
    [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "My favourite colour is "}],
]


@pytest.mark.parametrize("template", [SMOLLM2_TEMPLATE, LLAMA3_STYLE_TEMPLATE, BLOCKY_TEMPLATE],
                         ids=["smollm2", "llama3-style", "blocky"])
def test_continue_final_message_matches_transformers(reference, template: str) -> None:
    for messages in PREFILLED:
        expected = reference.apply_chat_template(messages, tokenize=False, chat_template=template,
                                                 add_generation_prompt=False, continue_final_message=True)
        rendered = render(template, messages, add_generation_prompt=False, continue_final_message=True)
        assert rendered == expected
        assert rendered.rstrip().endswith(messages[-1]["content"].rstrip())
    # What the continued prompt leaves out is exactly the template's closing of that message.
    closed = render(SMOLLM2_TEMPLATE, PREFILLED[0], add_generation_prompt=False)
    assert closed == render(SMOLLM2_TEMPLATE, PREFILLED[0], add_generation_prompt=False,
                            continue_final_message=True) + "<|im_end|>\n"


def test_continue_final_message_errors() -> None:
    with pytest.raises(ChatTemplateError, match="add_generation_prompt"):
        render(SMOLLM2_TEMPLATE, PREFILLED[0], continue_final_message=True)  # add_generation_prompt defaults on
    tool_call = [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [{"id": "1"}]}]
    with pytest.raises(ChatTemplateError, match="text content"):
        render(SMOLLM2_TEMPLATE, tool_call, add_generation_prompt=False, continue_final_message=True)
    drops_text = "{% for m in messages %}<{{ m.role }}>{% endfor %}"
    with pytest.raises(ChatTemplateError, match="nothing to continue"):
        render(drops_text, PREFILLED[0], add_generation_prompt=False, continue_final_message=True)


def test_template_variables_and_kwargs_reach_the_template() -> None:
    template = ("{% if enable_thinking %}<think>{% endif %}{% for d in documents or [] %}[{{ d.text }}]{% endfor %}"
                "{{ messages[0].content }}")
    assert template_variables(template) == {"enable_thinking", "documents", "messages"}
    assert "enable_thinking" not in template_variables(SMOLLM2_TEMPLATE)
    docs = [{"title": "a", "text": "doc one"}]
    assert render(template, CONVERSATIONS[0], enable_thinking=True, documents=docs) == "<think>[doc one]Hello!"
    assert render(template, CONVERSATIONS[0], enable_thinking=False) == "Hello!"
    # A kwarg of a type the template cannot use fails the request, as a ChatTemplateError (400), not a crash.
    with pytest.raises(ChatTemplateError, match="chat template failed"):
        render("{% if budget > 3 %}x{% endif %}", CONVERSATIONS[0], budget={"a": 1})
