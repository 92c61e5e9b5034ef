"""What routing reads from a request body: the model it names and its prefix-affinity key.

The router has no tokenizer, so the key is cut from characters, not tokens. The prompt becomes one
text — a completion's prompt as is (the first one of a batch; token ids as their decimal numbers),
a chat's messages as `role \\x1f content \\x1e` in order, so the system prompt comes first — and the
key is the hash of its first `prefix_chars` characters, rounded down to whole chunks of `chunk_chars`.
A prompt shorter than one chunk is hashed whole.

Requests that agree on those chunks go to the same backend, whose prefix cache then already holds
them. Set `prefix_chars` no longer than the shared part of your prompts (a system prompt, few-shot
examples): a window that reaches into the per-request text scatters requests that share a prefix. The
defaults (256 and 64 characters) are about 64 and 16 tokens of English text: 4 and 1 KV blocks of 16.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

MESSAGE_SEPARATOR = "\x1e"
ROLE_SEPARATOR = "\x1f"


@dataclass(frozen=True)
class RoutingInfo:
    model: str | None = None
    key: bytes | None = None  # None: no affinity (not a completion or chat, or no prompt)
    blocks: tuple[bytes, ...] = ()  # chained block hashes of the prompt text (the score policy's; scoring.py)
    prompt_chars: int = 0


def content_text(content: Any) -> str:
    """A chat message's content: a string, or parts (text parts by their text, others as JSON)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        pieces = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text":
                pieces.append(str(part.get("text", "")))
            else:
                pieces.append(json.dumps(part, sort_keys=True, separators=(",", ":")))
        return "".join(pieces)
    return json.dumps(content, sort_keys=True, separators=(",", ":"))


def chat_text(messages: Any) -> str | None:
    if not isinstance(messages, list) or not messages:
        return None
    rendered = []
    for message in messages:
        if not isinstance(message, dict):
            return None
        rendered.append(f"{message.get('role', '')}{ROLE_SEPARATOR}{content_text(message.get('content'))}")
    return MESSAGE_SEPARATOR.join(rendered) + MESSAGE_SEPARATOR


def completion_text(prompt: Any) -> str | None:
    """str | list[str] | list[int] | list[list[int]] → the (first) prompt as text."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if isinstance(first, str):
            return first
        if isinstance(first, int):
            return " ".join(str(token) for token in prompt)
        if isinstance(first, list):
            return " ".join(str(token) for token in first)
    return None


def responses_messages(body: dict[str, Any]) -> list[Any]:
    """A Responses API request's conversation as chat messages (instructions first), for the same key."""
    instructions, given = body.get("instructions"), body.get("input")
    messages: list[Any] = [{"role": "system", "content": instructions}] if isinstance(instructions, str) else []
    if isinstance(given, str):
        return messages + [{"role": "user", "content": given}]
    return messages + (given if isinstance(given, list) else [])


def prompt_text(path: str, body: dict[str, Any]) -> str | None:
    if path.endswith("/chat/completions"):
        return chat_text(body.get("messages"))
    if path.endswith("/responses"):
        return chat_text(responses_messages(body))
    if path.endswith("/completions"):
        return completion_text(body.get("prompt"))
    return None


def affinity_key(text: str, prefix_chars: int, chunk_chars: int) -> bytes | None:
    """The hash of the text's leading whole chunks (at most `prefix_chars` characters)."""
    if not text:
        return None
    window = min(len(text), prefix_chars)
    whole = window - window % chunk_chars
    leading = text[: whole or window]
    return hashlib.blake2b(leading.encode("utf-8", "surrogatepass"), digest_size=16).digest()


def block_hashes(text: str, chunk_chars: int, max_chars: int) -> tuple[bytes, ...]:
    """Chained hashes of the text's whole `chunk_chars` blocks within its first `max_chars` characters
    (each hash covers its block and every block before it, as vLLM's KV block hashes do)."""
    hashes: list[bytes] = []
    previous = b""
    limit = min(len(text), max_chars)
    for start in range(0, limit - chunk_chars + 1, chunk_chars):
        chunk = text[start:start + chunk_chars].encode("utf-8", "surrogatepass")
        previous = hashlib.blake2b(previous + chunk, digest_size=12).digest()
        hashes.append(previous)
    return tuple(hashes)


def routing_info(path: str, body: bytes, prefix_chars: int, chunk_chars: int, block_chars: int = 0) -> RoutingInfo:
    """Never fails: a body that is not JSON is routed without a key and the backend answers it."""
    if not body:
        return RoutingInfo()
    try:
        parsed = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):  # nested past the parser's depth: the backend's 400
        return RoutingInfo()
    if not isinstance(parsed, dict):
        return RoutingInfo()
    model = parsed.get("model")
    text = prompt_text(path, parsed)
    key = affinity_key(text, prefix_chars, chunk_chars) if text else None
    blocks = block_hashes(text, chunk_chars, block_chars) if text and block_chars else ()
    return RoutingInfo(model if isinstance(model, str) else None, key, blocks, len(text) if text else 0)
