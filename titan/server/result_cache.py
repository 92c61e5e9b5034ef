"""The exact result cache: a deterministic request seen before gets the stored response back.

Key: the scope (the tenant, unless `--result-cache-shared`), the served model, the route, every prompt's
token ids, the server's sampling defaults and every field of the body that shapes the output (all but
`stream`, `stream_options`, `user`, `priority` and Titan's own switches). Only requests whose output
cannot vary are cached: every choice greedy (temperature 0 or top_k 1) or seeded. A hit replays the
stored choices and usage, as JSON or as a normal SSE stream, under `X-Titan-Cache: hit`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Mapping
from typing import Any

from titan.engine.sampling_params import SamplingParams

CACHE_HEADER = "X-Titan-Cache"
# Body fields that change nothing the engine computes or the choices carry.
NOT_IN_KEY = {"stream", "stream_options", "user", "priority", "titan_cache", "titan_semantic_cache",
              "titan_timeline"}


def deterministic(params: SamplingParams) -> bool:
    return params.temperature == 0 or params.top_k == 1 or params.seed is not None


def cache_key(scope: str, model: str, route_object: str, body: Mapping[str, Any], prompts: list[list[int]],
              defaults: Mapping[str, float] | None) -> str:
    shaped = {name: value for name, value in body.items() if name not in NOT_IN_KEY}
    material = json.dumps([scope, model, route_object, shaped, prompts, dict(defaults or {})], sort_keys=True,
                          separators=(",", ":"), default=str)
    return hashlib.sha256(material.encode()).hexdigest()


def encode_entry(choices: list[dict[str, Any]], usage: dict[str, Any]) -> bytes:
    return json.dumps({"choices": choices, "usage": usage}, separators=(",", ":")).encode()


def decode_entry(raw: bytes) -> dict[str, Any] | None:
    try:
        entry = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(entry, dict) or not isinstance(entry.get("choices"), list):
        return None
    return entry


def replay_chunks(chunk_object: str, choices: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """The streamed choice entries that rebuild `choices` (whole-response entries), in order."""
    chat = chunk_object == "chat.completion.chunk"
    for choice in choices:
        index = choice["index"]
        # vLLM's prompt_logprobs ride on a choice's first chunk, live and replayed alike (a hit dropped them).
        extras = {"prompt_logprobs": choice["prompt_logprobs"]} if "prompt_logprobs" in choice else {}
        if chat:
            message = choice.get("message") or {}
            yield {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                   "finish_reason": None}
            if message.get("content"):
                yield {"index": index, "delta": {"content": message["content"]}, "logprobs": choice.get("logprobs"),
                       "finish_reason": None} | extras
                extras = {}
            final: dict[str, Any] = {}
            if message.get("tool_calls"):
                final["tool_calls"] = [{"index": i, **call} for i, call in enumerate(message["tool_calls"])]
            yield {"index": index, "delta": final, "logprobs": None,
                   "finish_reason": choice.get("finish_reason")} | extras
        else:
            if choice.get("text") or extras:
                yield {"index": index, "text": choice.get("text") or "", "logprobs": choice.get("logprobs"),
                       "finish_reason": None} | extras
            yield {"index": index, "text": "", "logprobs": None, "finish_reason": choice.get("finish_reason")}
