"""Plain ASGI middleware (Starlette's BaseHTTPMiddleware would buffer and slow every SSE stream)."""

from __future__ import annotations

import hmac
import json
from http import HTTPStatus

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from titan.server.errors import error_body


async def send_error(send: Send, status: int, message: str, code: str, headers: list[tuple[bytes, bytes]] = ()) -> None:
    body = json.dumps(error_body(message, "invalid_request_error", None, code)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})


class BodyTooLarge(HTTPException):
    def __init__(self, limit: int) -> None:
        super().__init__(HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                         f"The request body is larger than the limit of {limit} bytes.")


class BodySizeLimit:
    """413 for bodies over `max_bytes`: at once from Content-Length, else while a chunked body streams in."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope["headers"]:
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = 0
                if declared > self.max_bytes:
                    message = f"The request body is larger than the limit of {self.max_bytes} bytes."
                    # The unread body stays in the socket: close the connection instead of reusing it.
                    await send_error(send, HTTPStatus.REQUEST_ENTITY_TOO_LARGE, message, "request_too_large",
                                     [(b"connection", b"close")])
                    return
        received = 0

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    # Raised inside the body read, it reaches the app's HTTPException handler → 413.
                    raise BodyTooLarge(self.max_bytes)
            return message

        await self.app(scope, counting_receive, send)


class APIKeyCheck:
    """401 without `Authorization: Bearer <key>` on /v1/*, /tokenize, /detokenize and /debug/* (engine
    internals); /metrics too when
    `protect_metrics`. Health, readiness and version stay open for probes."""

    def __init__(self, app: ASGIApp, api_key: str, protect_metrics: bool = False) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        protected = ("/v1", "/debug", "/tokenize", "/detokenize")
        self.prefixes = (*protected, "/metrics") if protect_metrics else protected

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(self.prefixes) and scope["method"] != "OPTIONS":
            given = next((value for name, value in scope["headers"] if name == b"authorization"), b"")
            if not hmac.compare_digest(given, self.expected):
                message = "Missing API key." if not given else "Incorrect API key provided."
                await send_error(send, HTTPStatus.UNAUTHORIZED, message, "invalid_api_key",
                                 [(b"www-authenticate", b"Bearer")])
                return
        await self.app(scope, receive, send)


class OpenResponseCount:
    """Counts generation requests (`POST /v1/...`) from arrival until their last byte is handed to the
    transport: a streamed response outlives its engine request, so a drain that waited only for the
    engine would shut down with the stream's tail still unsent."""

    def __init__(self, app: ASGIApp, counter: ResponseCounter) -> None:
        self.app = app
        self.counter = counter

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        self.counter.open += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.counter.open -= 1


class ResponseCounter:
    """How many generation responses are open (one event loop: a plain int is enough)."""

    def __init__(self) -> None:
        self.open = 0
