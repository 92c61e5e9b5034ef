"""No silent ignores: request fields outside Titan's schema are either refused or logged, never dropped.

A field of OpenAI's or vLLM's API that Titan knows but cannot honour (with the value given) is a 400
with code `unsupported_parameter` naming it. A field Titan has never heard of is ignored, as OpenAI's
own server does, and logged once per name at WARNING so an operator sees what clients send.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any

from titan.server.errors import bad_request

logger = logging.getLogger("titan.server")


def _given(value: Any) -> bool:
    return value is not None


def _truthy(value: Any) -> bool:
    return bool(value)


# field → does this value ask for something Titan does not do?
UNSUPPORTED_FIELDS: dict[str, Callable[[Any], bool]] = {
    "functions": _truthy,  # the legacy form of tools
    "function_call": lambda value: value not in (None, "none"),
    "suffix": _truthy,  # no fill-in-the-middle
    "best_of": lambda value: value not in (None, 1),
    "use_beam_search": _truthy,
    "audio": _given,
    "modalities": lambda value: value not in (None, ["text"]),
    "prediction": _given,
    "web_search_options": _given,
    "reasoning_effort": _given,
    "store": _truthy,
    "logits_processors": _truthy,
    "chat_template": _given,  # a request's own Jinja template: only the model's runs here
    "length_penalty": lambda value: value not in (None, 1, 1.0),  # beam search only
    "structural_tag": _given,
    "prompt_embeds": _given,
    "kv_transfer_params": _given,
    "vllm_xargs": _given,
    "mm_processor_kwargs": _truthy,
    # Inside objects (the name is the field's path):
    "structured_outputs.structural_tag": _given,
    "structured_outputs.whitespace_pattern": _given,
    "structured_outputs.disable_additional_properties": _truthy,
}
# Known fields that change nothing Titan computes: accepted without a word.
# (spaces_between_special_tokens: vLLM applies it to slow tokenizers only, and Titan's is a fast one; JSON
# constraints here never allow free whitespace, so disable_any_whitespace holds already; there is no fallback
# grammar backend to disable.)
INFORMATIONAL_FIELDS = frozenset({"metadata", "service_tier", "guided_decoding_backend",
                                  "guided_whitespace_pattern", "request_id", "spaces_between_special_tokens",
                                  "structured_outputs.disable_any_whitespace", "structured_outputs.disable_fallback"})

MAX_LOGGED_NAMES = 1024
_logged: set[str] = set()
_lock = threading.Lock()


def check_extra_fields(extra: Mapping[str, Any] | None, prefix: str = "") -> None:
    """400 for a known field Titan cannot honour; a one-time WARNING for each unknown field name. `prefix`:
    the path of the object holding them (`stream_options.`)."""
    for key, value in (extra or {}).items():
        name = prefix + key
        rule = UNSUPPORTED_FIELDS.get(name)
        if rule is not None:
            if rule(value):
                raise bad_request(f"{name} is not supported by this server", param=name, code="unsupported_parameter")
            continue
        if name not in INFORMATIONAL_FIELDS:
            warn_once(f"field:{name}", "ignoring unknown request field %r (logged once per field name)", name)


def warn_once(key: str, message: str, *args: object) -> None:
    """A WARNING the first time `key` comes up in this process. Keys come from clients, so at most
    MAX_LOGGED_NAMES are remembered; past that, one last WARNING says new ones go unlogged."""
    with _lock:
        if key in _logged or len(_logged) > MAX_LOGGED_NAMES:
            return
        _logged.add(key)
        full = len(_logged) > MAX_LOGGED_NAMES
    if full:
        logger.warning("more than %d distinct unknown request names: new ones are no longer logged",
                       MAX_LOGGED_NAMES)
    else:
        logger.warning(message, *args)
