"""Render HF chat templates (Jinja) the way transformers does, in a sandbox.

Same environment settings as transformers: `trim_blocks`, `lstrip_blocks`, the `loopcontrols`
extension, `raise_exception` / `strftime_now` globals, a `tojson` filter that keeps non-ASCII text, and a
no-op `{% generation %}` block (transformers uses it to mark assistant tokens for training masks).
"""

from __future__ import annotations

import datetime
import functools
import json
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Used only when a caller opts in (the model has no template of its own): ChatML, which many
# instruction-tuned models understand and which has no model-specific tokens besides the markers.
FALLBACK_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class ChatTemplateError(ValueError):
    """The template rejected the conversation (its `raise_exception`) or failed to render."""


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _strftime_now(format_string: str) -> str:
    return datetime.datetime.now().strftime(format_string)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own `tojson` escapes HTML characters and forces ASCII; templates expect plain JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


@functools.cache
def _environment() -> ImmutableSandboxedEnvironment:
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    return environment


@functools.lru_cache(maxsize=16)
def compile_template(template: str) -> jinja2.Template:
    """Compiling costs milliseconds; a model uses one template, so keep it."""
    try:
        return _environment().from_string(template)
    except jinja2.TemplateSyntaxError as error:
        raise ChatTemplateError(f"invalid chat template: {error}") from error


@functools.lru_cache(maxsize=16)
def template_variables(template: str) -> frozenset[str]:
    """The names `template` reads from its caller (messages, tools, documents, its own keyword arguments)."""
    try:
        return frozenset(jinja2.meta.find_undeclared_variables(_environment().parse(template)))
    except jinja2.TemplateSyntaxError as error:
        raise ChatTemplateError(f"invalid chat template: {error}") from error


def normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Copy messages, turning OpenAI-style content parts (`[{"type": "text", "text": ...}]`) into one
    string joined by newlines, so every template sees plain string content."""
    normalized = []
    for message in messages:
        if not isinstance(message, Mapping) or "role" not in message:
            raise ValueError("each chat message must be an object with a 'role'")
        copy = dict(message)
        content = copy.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                if isinstance(part, str):
                    texts.append(part)
                elif isinstance(part, Mapping) and part.get("type") == "text":
                    texts.append(str(part.get("text", "")))
                else:
                    kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                    raise ValueError(f"unsupported message content part of type {kind!r}; only text is "
                                     "supported")
            copy["content"] = "\n".join(texts)
        elif content is None and "tool_calls" not in copy:
            copy["content"] = ""
        normalized.append(copy)
    return normalized


def render_chat_template(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    special_tokens: Mapping[str, str | None] | None = None,
    tools: list[dict[str, Any]] | None = None,
    **template_kwargs: Any,
) -> str:
    """Render `template` for `messages`; `special_tokens` supplies `bos_token`, `eos_token`, ...

    continue_final_message: the prompt ends inside the last message, after its text, with nothing the
    template closes it with, so the model goes on writing that message (an assistant reply begun for it)."""
    if continue_final_message and add_generation_prompt:
        raise ChatTemplateError("continue_final_message and add_generation_prompt cannot both be set")
    # Unset special tokens stay undefined (rendering as ""), as in transformers.
    variables: dict[str, Any] = {name: value for name, value in (special_tokens or {}).items() if value}
    variables.update(template_kwargs)
    normalized = normalize_messages(messages)
    if continue_final_message:
        normalized[-1] = _marked(normalized[-1] if normalized else None)
    variables.update(messages=normalized, add_generation_prompt=add_generation_prompt,
                     tools=tools, documents=template_kwargs.get("documents"))
    try:
        rendered = compile_template(template).render(**variables)
    except ChatTemplateError:
        raise
    except (jinja2.TemplateError, TypeError, ValueError, KeyError, AttributeError, IndexError) as error:
        # The template ran on the request's data (messages, tools, documents, kwargs): a value of a type it
        # did not expect is the request's failure (400), not the server's.
        raise ChatTemplateError(f"chat template failed: {error}") from error
    return _cut_at_marker(rendered) if continue_final_message else rendered


# Appended to the message being continued, so the rendered prompt can be cut where its text ends. The
# trailing space tells whether the template strips message text: if it is gone, the template trims, and the
# cut text is trimmed too (transformers' and vLLM's prompt for the same request).
_CONTINUE_MARKER = "\u2063titan-continue\u2063 "


def _marked(message: dict[str, Any] | None) -> dict[str, Any]:
    content = None if message is None else message.get("content")
    if not isinstance(content, str):
        raise ChatTemplateError("continue_final_message needs a final message with text content")
    return {**message, "content": content + _CONTINUE_MARKER}  # type: ignore[dict-item]


def _cut_at_marker(rendered: str) -> str:
    marker = _CONTINUE_MARKER.rstrip()
    at = rendered.rfind(marker)
    if at < 0:
        raise ChatTemplateError("continue_final_message: the chat template does not render the final "
                                "message's text, so there is nothing to continue")
    kept_spacing = rendered.startswith(_CONTINUE_MARKER, at)
    return rendered[:at] if kept_spacing else rendered[:at].rstrip()
