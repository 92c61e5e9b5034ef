"""Chat messages → prompt token ids, with the request's template fields (chat completions and /tokenize).

Every field is honoured or refused: documents reach a template that reads them and are a 400 otherwise (a
template that never mentions them would drop them without a word); chat_template_kwargs are the template's
own variables, so one it does not read changes nothing, as in vLLM, and is logged once per name.
"""

from __future__ import annotations

from typing import Any

from titan.server.chat_protocol import ChatTemplateFields
from titan.server.errors import bad_request
from titan.server.fields import warn_once
from titan.tokenizer import Tokenizer
from titan.tokenizer.chat_template import template_variables


def check_template_reads(tokenizer: Tokenizer, fields: ChatTemplateFields) -> None:
    """400 for documents the model's template would drop; a one-time WARNING per unread kwarg name."""
    template = tokenizer.chat_template
    if template is None:
        return  # rendering refuses it with its own message
    names = template_variables(template)
    if fields.documents is not None and "documents" not in names:
        raise bad_request("this model's chat template does not read documents", param="documents")
    for name in sorted(set(fields.chat_template_kwargs or {}) - names):
        warn_once(f"chat_template_kwargs:{name}",
                  "chat_template_kwargs %r is not read by this model's chat template (logged once)", name)


def chat_prompt_ids(tokenizer: Tokenizer, messages: list[dict[str, Any]], fields: ChatTemplateFields,
                    tools: list[dict[str, Any]] | None = None) -> list[int]:
    """The rendered conversation's token ids. Raises ValueError when the template refuses it (→ 400)."""
    text = tokenizer.apply_chat_template(messages, tools=tools, **fields.template_options())
    return tokenizer.encode(text, add_special_tokens=fields.add_special_tokens is not False)
