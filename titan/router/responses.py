"""What goes back to the client: the router's own answers, and a backend's response passed through.

Also the one piece of protocol the router reads: whether a server-sent event carries output (see
proxy.py for why output-free leading events are held back before committing to a backend).
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Protocol

import httpx
from starlette.types import Send

from titan.router.backend import Backend
from titan.router.metrics import RouterMetrics

logger = logging.getLogger("titan.router")

# Per-connection headers (RFC 9110 §7.6.1): never passed on in either direction.
HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te",
                        b"trailer", b"transfer-encoding", b"upgrade", b"proxy-connection"})
BACKEND_HEADER = b"x-titan-router-backend"
# Output-free events held back before committing to a backend: far more than any role preamble.
HOLD_BACK_LIMIT = 64 * 1024
DELTA_OUTPUT_FIELDS = ("content", "tool_calls", "function_call", "reasoning_content", "refusal")


def carries_output(event: bytes) -> bool:
    """Whether a complete SSE event has output (or is anything but an output-free OpenAI chunk)."""
    payload = b"".join(line[5:].strip() for line in event.split(b"\n") if line.startswith(b"data:"))
    if not payload:
        return False  # a comment or keep-alive
    try:
        chunk = json.loads(payload)
    except ValueError:
        return True  # [DONE], or something this router does not understand: pass it on
    if not isinstance(chunk, dict) or not chunk.get("choices"):
        return True  # errors, usage-only chunks
    for choice in chunk["choices"]:
        if not isinstance(choice, dict) or choice.get("text") or choice.get("finish_reason"):
            return True
        delta = choice.get("delta")
        if isinstance(delta, dict) and any(delta.get(name) for name in DELTA_OUTPUT_FIELDS):
            return True
    return False


def is_plain_event_stream(headers: httpx.Headers) -> bool:
    """An SSE body the router can read (and append an error event to): not compressed."""
    return headers.get("content-type", "").startswith("text/event-stream") and "content-encoding" not in headers


def has_output(data: bytes) -> bool:
    events = data.replace(b"\r\n", b"\n").split(b"\n\n")
    return any(carries_output(event) for event in events[:-1])  # the last piece is incomplete (or empty)


def error_body(message: str, code: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": "server_error", "param": None, "code": code}}).encode()


class Outcome(Protocol):
    async def send_to(self, send: Send) -> None: ...

    async def close(self) -> None: ...


@dataclass
class PlainResponse:
    """A whole response in memory: the router's own errors, or a backend's error passed on."""

    status: int
    body: bytes
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)

    @classmethod
    def error(cls, status: int, message: str, code: str,
              extra: tuple[tuple[bytes, bytes], ...] = ()) -> PlainResponse:
        return cls(status, error_body(message, code), [(b"content-type", b"application/json"), *extra])

    async def send_to(self, send: Send) -> None:
        headers = [(name, value) for name, value in self.headers if name != b"content-length"]
        headers.append((b"content-length", str(len(self.body)).encode()))
        await send({"type": "http.response.start", "status": self.status, "headers": headers})
        await send({"type": "http.response.body", "body": self.body})

    async def close(self) -> None:
        pass


class PassThrough:
    """A backend's response whose first body byte has arrived: streamed on to the client as it comes."""

    def __init__(self, backend: Backend, response: httpx.Response, chunks: AsyncIterator[bytes], first: bytes,
                 finished: bool, started: float, metrics: RouterMetrics,
                 release: Callable[[Backend], None]) -> None:
        self.backend = backend
        self.response = response
        self.chunks = chunks
        self.first = first
        self.finished = finished  # the whole body was the first chunk
        self.started = started
        self.metrics = metrics
        self.release = release  # called once, when the response is over (the backend's outstanding count)
        self.completed = False
        self.closed = False
        self.extra_headers: list[tuple[bytes, bytes]] = []  # the router's own, e.g. x-titan-degraded

    async def send_to(self, send: Send) -> None:
        try:
            await self.pump(send)
        except OSError:  # the client went away mid-send (uvicorn raises ClientDisconnected)
            pass
        finally:
            await self.close()

    async def pump(self, send: Send) -> None:
        headers = [(name.lower(), value) for name, value in self.response.headers.raw
                   if name.lower() not in HOP_BY_HOP]
        headers.append((BACKEND_HEADER, self.backend.name.encode()))
        headers.extend(self.extra_headers)
        await send({"type": "http.response.start", "status": self.response.status_code, "headers": headers})
        await send({"type": "http.response.body", "body": self.first, "more_body": not self.finished})
        if self.finished:
            self.completed = True
            return
        last = self.first
        try:
            async for chunk in self.chunks:
                if chunk:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                    last = chunk
        except httpx.HTTPError as error:
            self.metrics.errors.labels(self.backend.name, "stream").inc()
            logger.warning("backend %s failed mid-response (nothing retried after the first byte): %s",
                           self.backend.name, error or type(error).__name__)
            if is_plain_event_stream(self.response.headers):
                # An error event for OpenAI clients, on a frame boundary of its own, then a clean end.
                boundary = b"" if last.endswith(b"\n\n") else b"\n\n"
                message = f"The backend {self.backend.name} failed while streaming: {type(error).__name__}"
                event = b"data: " + error_body(message, "backend_failed") + b"\n\n"
                await send({"type": "http.response.body", "body": boundary + event})
            # Any other body is left incomplete: the server closes the connection and the client sees it.
            return
        await send({"type": "http.response.body", "body": b""})
        self.completed = True

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            await close_response(self.response, self.chunks)
        finally:  # also when cancelled mid-close (the client's disconnect): the backend's count must not leak
            if self.completed:
                self.metrics.duration.labels(self.backend.name).observe(time.perf_counter() - self.started)
            self.release(self.backend)  # last: releasing a backend that left the pool drops its series


async def close_response(response: httpx.Response, chunks: AsyncIterator[bytes] | None) -> None:
    """Close the body iterator and the response (the backend sees its connection close if unfinished)."""
    with contextlib.suppress(Exception):
        close_chunks = getattr(chunks, "aclose", None)
        if close_chunks is not None:
            await close_chunks()
    with contextlib.suppress(Exception):
        await response.aclose()
