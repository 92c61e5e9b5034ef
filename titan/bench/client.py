"""Streaming OpenAI HTTP client that stamps every token's arrival.

Each request's failure (refused connection, 4xx/5xx, malformed SSE, a stream cut short) is caught and
recorded on its `RequestResult`; nothing here raises into the load loop except cancellation.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from titan.bench.workload import RequestSpec

_LINE_BREAK = re.compile(rb"\r\n|\r|\n")


class SseParser:
    """Incremental `text/event-stream` parser: bytes in, the `data` of each complete event out.

    Follows the WHATWG rules that matter here: lines end in CRLF, LF or CR (also when split across
    chunks), `:` starts a comment, several `data:` lines join with newlines, a blank line ends an event.
    Bytes are decoded per complete line, so a UTF-8 character split across chunks survives.
    """

    def __init__(self) -> None:
        self._pending = b""
        self._after_cr = False
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[str]:
        if not chunk:
            return []
        # A CR that ended the previous chunk may be the first half of a CRLF.
        if self._after_cr and chunk.startswith(b"\n"):
            chunk = chunk[1:]
        self._after_cr = chunk.endswith(b"\r")
        *lines, self._pending = _LINE_BREAK.split(self._pending + chunk)
        events: list[str] = []
        for line in lines:
            self._line(line, events)
        return events

    def close(self) -> list[str]:
        """End of stream: an event without its closing blank line still counts (lenient on purpose)."""
        events: list[str] = []
        if self._pending:
            self._line(self._pending, events)
            self._pending = b""
        self._line(b"", events)
        return events

    def _line(self, raw: bytes, events: list[str]) -> None:
        line = raw.decode("utf-8", errors="replace")
        if line == "":
            if self._data:
                events.append("\n".join(self._data))
                self._data = []
            return
        if line.startswith(":"):
            return
        name, _, value = line.partition(":")
        if name == "data":
            self._data.append(value[1:] if value.startswith(" ") else value)


@dataclass
class RequestResult:
    """Everything measured for one request. Times are seconds since the run's start."""

    index: int
    request_class: str
    input_tokens_estimate: int
    max_tokens: int
    scheduled_at: float  # when the arrival process made it due
    sent_at: float = math.nan  # when the client actually sent it (after any concurrency wait)
    token_times: list[float] = field(default_factory=list)  # arrival of each non-empty text chunk
    finished_at: float = math.nan
    status: int = 0  # HTTP status; 0 when no response arrived
    error: str | None = None
    error_kind: str | None = None  # connect | timeout | http | malformed_sse | stream_error | ...
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    usage_source: str | None = None  # "usage" (server-reported) or "chunks" (counted text chunks)
    finish_reason: str | None = None
    output_chars: int = 0

    @property
    def success(self) -> bool:
        return self.error is None and self.status == 200

    @property
    def client_wait(self) -> float:
        """Time the request spent waiting inside the client (concurrency cap, event-loop lag)."""
        return self.sent_at - self.scheduled_at

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.sent_at if self.token_times else None

    @property
    def e2e(self) -> float | None:
        return self.finished_at - self.sent_at if self.success else None

    @property
    def itls(self) -> list[float]:
        times = self.token_times
        return [later - earlier for earlier, later in zip(times, times[1:], strict=False)]

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first, from the server's token count."""
        if not self.success or not self.token_times or not self.completion_tokens or self.completion_tokens < 2:
            return None
        return (self.finished_at - self.token_times[0]) / (self.completion_tokens - 1)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        for key in ("sent_at", "finished_at"):
            if math.isnan(data[key]):
                data[key] = None
        data["ttft"] = self.ttft
        data["e2e"] = self.e2e
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RequestResult:
        known = {name: data[name] for name in cls.__dataclass_fields__ if name in data}
        for key in ("sent_at", "finished_at"):
            if known.get(key) is None:
                known[key] = math.nan
        return cls(**known)


def request_body(spec: RequestSpec, model: str, *, temperature: float, ignore_eos: bool,
                 include_usage: bool, send_priority: bool, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "max_tokens": spec.max_tokens, "temperature": temperature,
                            "stream": True}
    if spec.messages is not None:
        body["messages"] = spec.messages
    else:
        body["prompt"] = spec.prompt
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    if ignore_eos:  # vLLM-style extensions: the server generates exactly max_tokens
        body["ignore_eos"] = True
        body["min_tokens"] = spec.max_tokens
    if send_priority and spec.priority is not None:
        body["priority"] = spec.priority
    if extra:
        body.update(extra)
    return body


def error_message(status: int, content: bytes) -> str:
    """The human part of an error body: OpenAI, TGI, FastAPI and plain-text shapes."""
    text = content.decode("utf-8", errors="replace").strip()
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        data = None
    if isinstance(data, dict):
        error = data.get("error")
        if isinstance(error, dict) and error.get("message"):
            return f"HTTP {status}: {error['message']}"
        for value in (error, data.get("detail"), data.get("message")):
            if isinstance(value, str) and value:
                return f"HTTP {status}: {value}"
    return f"HTTP {status}: {text[:300]}" if text else f"HTTP {status}"


class _StreamFailure(Exception):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def _chunk_text(choice: dict[str, Any]) -> str:
    if "delta" in choice:  # chat
        delta = choice["delta"] or {}
        if not isinstance(delta, dict):
            raise _StreamFailure("malformed_sse", f"delta is not an object: {str(delta)[:100]}")
        return (delta.get("content") or "") + (delta.get("reasoning_content") or "")
    return choice.get("text") or ""


def _apply_event(data: str, result: RequestResult, now: float) -> bool:
    """Fold one SSE data payload into the result; True at `[DONE]`."""
    if data.strip() == "[DONE]":
        return True
    try:
        payload = json.loads(data)
    except json.JSONDecodeError:
        raise _StreamFailure("malformed_sse", f"SSE data is not JSON: {data[:100]!r}") from None
    if not isinstance(payload, dict):
        raise _StreamFailure("malformed_sse", f"SSE data is not an object: {data[:100]!r}")
    if payload.get("error"):
        error = payload["error"]
        message = error.get("message", error) if isinstance(error, dict) else error
        raise _StreamFailure("stream_error", f"error event: {str(message)[:300]}")
    choices = payload.get("choices") or []
    if not isinstance(choices, list):
        raise _StreamFailure("malformed_sse", "'choices' is not a list")
    for choice in choices:
        if not isinstance(choice, dict):
            raise _StreamFailure("malformed_sse", "a choice is not an object")
        text = _chunk_text(choice)
        if text:
            result.token_times.append(now)
            result.output_chars += len(text)
        if choice.get("finish_reason"):
            result.finish_reason = choice["finish_reason"]
    usage = payload.get("usage")
    if isinstance(usage, dict):
        if isinstance(usage.get("prompt_tokens"), int):
            result.prompt_tokens = usage["prompt_tokens"]
        if isinstance(usage.get("completion_tokens"), int):
            result.completion_tokens = usage["completion_tokens"]
            result.usage_source = "usage"
    return False


async def send_request(client: httpx.AsyncClient, url: str, body: dict[str, Any], result: RequestResult,
                       start: float, headers: dict[str, str] | None = None) -> RequestResult:
    """Send one streaming request and fill `result`; never raises except on cancellation."""
    result.sent_at = time.perf_counter() - start
    done = False
    try:
        async with client.stream("POST", url, json=body, headers=headers) as response:
            result.status = response.status_code
            if response.status_code != 200:
                raise _StreamFailure("http", error_message(response.status_code, await response.aread()))
            parser = SseParser()
            async for chunk in response.aiter_bytes():
                now = time.perf_counter() - start
                for data in parser.feed(chunk):
                    done = _apply_event(data, result, now) or done
                if done:
                    break
            if not done:
                now = time.perf_counter() - start
                for data in parser.close():
                    done = _apply_event(data, result, now) or done
        if not done and result.finish_reason is None:
            content_type = response.headers.get("content-type", "")
            hint = "" if "event-stream" in content_type else f" (content-type {content_type!r}: not a stream)"
            raise _StreamFailure("incomplete_stream", "stream ended without [DONE] or a finish_reason" + hint)
    except _StreamFailure as failure:
        result.error_kind, result.error = failure.kind, str(failure)
    except httpx.ConnectError as error:
        result.error_kind, result.error = "connect", f"cannot connect: {error}"
    except httpx.TimeoutException as error:
        result.error_kind, result.error = "timeout", f"timed out ({type(error).__name__})"
    except httpx.HTTPError as error:  # connection reset or closed mid-stream, protocol errors
        result.error_kind, result.error = "stream_broken", f"{type(error).__name__}: {error}"
    except asyncio.CancelledError:
        result.error_kind, result.error = "cancelled", "run interrupted"
        result.finished_at = time.perf_counter() - start
        raise
    except Exception as error:  # the tool reports, it never dies on one request
        result.error_kind, result.error = "client_error", f"{type(error).__name__}: {error}"
    result.finished_at = time.perf_counter() - start
    if result.success and result.completion_tokens is None:
        result.completion_tokens = len(result.token_times)
        result.usage_source = "chunks"
    return result


def make_client(timeout: float, api_key: str | None = None) -> httpx.AsyncClient:
    # No pool limit: a capped pool would queue requests inside httpx and the wait would look like TTFT.
    # trust_env=False: a proxy from the environment must never sit between the bench and the server.
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.AsyncClient(
        timeout=httpx.Timeout(timeout, connect=min(timeout, 10.0)),
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
        trust_env=False, headers=headers,
    )


def api_root(base_url: str) -> str:
    """`http://host:port` from a base URL given with or without `/v1`."""
    root = base_url.rstrip("/")
    return root[:-3] if root.endswith("/v1") else root


def endpoint_url(base_url: str, endpoint: str) -> str:
    return f"{api_root(base_url)}/v1/{'chat/completions' if endpoint == 'chat' else 'completions'}"


async def first_model(client: httpx.AsyncClient, base_url: str) -> str:
    """The server's first listed model; raises RuntimeError with a readable reason."""
    url = f"{api_root(base_url)}/v1/models"
    try:
        response = await client.get(url)
    except httpx.HTTPError as error:
        raise RuntimeError(f"cannot reach {url}: {type(error).__name__}: {error}") from None
    if response.status_code != 200:
        raise RuntimeError(f"{url}: {error_message(response.status_code, response.content)}")
    try:
        return str(response.json()["data"][0]["id"])
    except (ValueError, KeyError, IndexError, TypeError):
        raise RuntimeError(f"{url}: no model listed ({response.text[:200]!r}); pass --model") from None


async def wait_for_model(client: httpx.AsyncClient, base_url: str, wait: float) -> str:
    """`first_model`, retried every half second for up to `wait` seconds (a server still loading)."""
    deadline = time.perf_counter() + wait
    while True:
        try:
            return await first_model(client, base_url)
        except RuntimeError:
            if time.perf_counter() >= deadline:
                raise
        await asyncio.sleep(0.5)
