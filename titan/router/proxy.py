"""Forwarding one request: pick a backend, retry once elsewhere if it fails before its first byte, then
pass the response through chunk by chunk as it arrives.

The router commits to a backend only when the first byte of the response body has arrived: until then
nothing has reached the client and the request can go elsewhere (a refused connection, a dropped one,
a 502/503/504 — Titan's 503 while loading or draining). For an event stream, "first byte" means the first
event that carries output: chat servers send an empty `{"role": "assistant"}` delta as soon as they accept
a request, and holding that back until the first token keeps a request that dies in a backend's queue or
prefill retryable, at no cost to the client (nothing it could show arrives any later). After that, bytes go
out as they come in and nothing is retried; if the backend fails mid-way, an event stream ends with an
OpenAI error event (no `[DONE]`) and any other body is cut short (the connection is closed), so the
client always sees it.

A client that hangs up is noticed at once (its `http.disconnect`), and the backend connection is closed
so the backend aborts the request instead of generating for no one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, TypeVar

import httpx
from starlette.types import Message, Receive, Scope, Send

from titan.router.backend import Backend, BackendPool
from titan.router.config import RouterConfig
from titan.router.degrade import DEGRADED_HEADER, Degrader
from titan.router.health import HealthChecker
from titan.router.metrics import RouterMetrics
from titan.router.request_key import routing_info
from titan.router.responses import (
    BACKEND_HEADER,
    HOLD_BACK_LIMIT,
    HOP_BY_HOP,
    Outcome,
    PassThrough,
    PlainResponse,
    close_response,
    has_output,
    is_plain_event_stream,
)

logger = logging.getLogger("titan.router")

T = TypeVar("T")

# Answers that mean "not here, try another": bad gateway, unavailable (loading, draining), gateway timeout.
RETRY_STATUSES = frozenset({HTTPStatus.BAD_GATEWAY, HTTPStatus.SERVICE_UNAVAILABLE, HTTPStatus.GATEWAY_TIMEOUT})
# Request headers not passed on: per-connection ones, and those httpx sets itself.
NOT_FORWARDED = HOP_BY_HOP | {b"host", b"content-length", b"expect"}


@dataclass
class Failure:
    backend: Backend
    reason: str  # errors_total's label
    detail: str
    answer: PlainResponse | None = None  # the backend's own answer (a 503), passed on if nobody else can
    # False once the backend may be generating: a read timeout, where another backend would run it all again
    retryable: bool = True


class ClientGone(Exception):
    """The client disconnected; there is nobody to answer."""


class BodyTooLarge(Exception):
    pass


class ClientWatch:
    """Notices the client's disconnect while the request is routed and streamed."""

    def __init__(self, receive: Receive) -> None:
        self.gone = asyncio.Event()
        self.task = asyncio.create_task(self.watch(receive))

    async def watch(self, receive: Receive) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self.gone.set()
                return

    async def until_gone(self, work: Coroutine[Any, Any, T]) -> T:
        """`work`'s result, or ClientGone after cancelling it if the client leaves first."""
        task = asyncio.ensure_future(work)
        waiter = asyncio.ensure_future(self.gone.wait())
        try:
            await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            task.cancel()
            raise
        finally:
            waiter.cancel()
        if task.done():
            return task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        raise ClientGone

    def close(self) -> None:
        self.task.cancel()


async def read_body(receive: Receive, limit: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while True:
        message: Message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def forwarded_headers(scope: Scope) -> list[tuple[bytes, bytes]]:
    headers = [(name, value) for name, value in scope["headers"] if name not in NOT_FORWARDED]
    client = scope.get("client")
    if client:
        previous = next((value for name, value in headers if name == b"x-forwarded-for"), None)
        headers = [(name, value) for name, value in headers if name != b"x-forwarded-for"]
        address = client[0].encode()
        headers.append((b"x-forwarded-for", previous + b", " + address if previous else address))
    return headers


class Proxy:
    def __init__(self, config: RouterConfig, pool: BackendPool, client: httpx.AsyncClient, metrics: RouterMetrics,
                 health: HealthChecker) -> None:
        self.config = config
        self.pool = pool
        self.client = client
        self.degrader: Degrader | None = None  # set by the app when pools are configured
        self.metrics = metrics
        self.health = health

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        declared = next((value for name, value in scope["headers"] if name == b"content-length"), None)
        limit = self.config.max_request_body_bytes
        try:
            if declared is not None and declared.isdigit() and int(declared) > limit:
                raise BodyTooLarge
            body = await read_body(receive, limit)
        except BodyTooLarge:
            # The unread body stays in the socket: close the connection rather than reuse it.
            await PlainResponse.error(HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                                      f"The request body is larger than the limit of {limit} bytes.",
                                      "request_too_large", ((b"connection", b"close"),)).send_to(send)
            return
        except ClientGone:
            return
        watch = ClientWatch(receive)
        outcome: Outcome | None = None
        try:
            outcome = await watch.until_gone(self.route(scope, body))
            await watch.until_gone(outcome.send_to(send))
        except ClientGone:
            logger.debug("client left %s before its response ended", scope["path"])
        finally:
            watch.close()
            if outcome is not None:
                await outcome.close()

    async def route(self, scope: Scope, body: bytes) -> Outcome:
        info = routing_info(scope["path"], body, self.config.prefix_chars, self.config.chunk_chars,
                            self.config.score_prefix_chars if self.config.policy == "score" else 0)
        target = scope.get("raw_path") or scope["path"].encode()
        if scope.get("query_string"):
            target += b"?" + scope["query_string"]
        headers = forwarded_headers(scope)
        decision = self.degrader.decide(info, headers, body) if self.degrader is not None else None
        if decision is not None:
            info, body = decision.info, decision.body
        excluded = decision.exclude if decision is not None else frozenset()
        tried: set[str] = set()
        failure: Failure | None = None
        answer: PlainResponse | None = None  # the last backend answer (e.g. Titan's 503 while draining)
        for _ in range(1 + self.config.retries):
            backend = self.pool.choose(info, tried | excluded)
            if backend is None:
                break
            if failure is not None:
                self.metrics.retries.labels(failure.backend.name).inc()
                logger.info("retrying on %s after %s failed before its first byte: %s", backend.name,
                            failure.backend.name, failure.detail)
            tried.add(backend.name)
            predicted = getattr(self.pool.policy, "last_prediction", None)  # the score policy's, for this choice
            result = await self.attempt(backend, scope["method"], target.decode("latin-1"), headers, body, predicted)
            if isinstance(result, PassThrough):
                if decision is not None and decision.degraded_model is not None:
                    result.extra_headers.append((DEGRADED_HEADER, f"model={decision.degraded_model}".encode()))
                return result
            failure = result
            answer = result.answer or answer
            if not failure.retryable:
                break
        if failure is None:
            self.metrics.unrouted.labels("no_backend").inc()
            return PlainResponse.error(HTTPStatus.SERVICE_UNAVAILABLE, "No backend is ready to take the request.",
                                       "no_backend", ((b"retry-after", b"1"),))
        self.metrics.unrouted.labels("failed").inc()
        if answer is not None:  # a backend's own "try again" says more than a generic 502
            return answer
        if not failure.retryable:
            return PlainResponse.error(HTTPStatus.GATEWAY_TIMEOUT,
                                       f"The backend {failure.backend.name} sent nothing within --read-timeout: "
                                       f"{failure.detail}", "backend_timeout")
        return PlainResponse.error(HTTPStatus.BAD_GATEWAY,
                                   f"The backend {failure.backend.name} failed before responding: {failure.detail}",
                                   "backend_failed")

    def release(self, backend: Backend) -> None:
        gone = self.pool.release(backend)
        self.metrics.outstanding.labels(backend.name).set(backend.outstanding)
        if gone:  # the last open request on a backend that left the pool: its series go with it
            self.metrics.forget_backend(backend.name)

    def fail(self, backend: Backend, reason: str, error: Exception | str,
             answer: PlainResponse | None = None) -> Failure:
        detail = error if isinstance(error, str) else f"{type(error).__name__} {error}".strip()
        self.metrics.errors.labels(backend.name, reason).inc()
        # A read timeout: the request reached the backend, which may be generating it still. Sent again, a
        # slow generation ran twice (both aborted) and the client got a 502 after twice the timeout.
        return Failure(backend, reason, detail, answer, retryable=not isinstance(error, httpx.ReadTimeout))

    async def attempt(self, backend: Backend, method: str, target: str, headers: list[tuple[bytes, bytes]],
                      body: bytes, predicted_ttft: float | None = None) -> PassThrough | Failure:
        started = time.perf_counter()
        backend.outstanding += 1
        self.metrics.outstanding.labels(backend.name).set(backend.outstanding)
        self.metrics.requests.labels(backend.name).inc()
        response: httpx.Response | None = None
        chunks: AsyncIterator[bytes] | None = None
        handed_over = False
        try:
            request = self.client.build_request(method, backend.url + target, headers=headers, content=body)
            try:
                response = await self.client.send(request, stream=True)
            except (httpx.ConnectError, httpx.ConnectTimeout) as error:
                self.health.eject(backend, f"connection failed: {type(error).__name__}")
                return self.fail(backend, "connect", error)
            except httpx.TimeoutException as error:
                return self.fail(backend, "timeout", error)
            except httpx.HTTPError as error:  # e.g. closed before any response (killed, or a stale keep-alive)
                return self.fail(backend, "disconnect", error)
            if response.status_code in RETRY_STATUSES:
                try:
                    content = await response.aread()
                except httpx.HTTPError:
                    content = b""
                if response.status_code == HTTPStatus.SERVICE_UNAVAILABLE:
                    self.health.eject(backend, "answered 503")
                # aread() decoded the body: a Content-Encoding passed on would have the client decode it again.
                answer_headers = [(name.lower(), value) for name, value in response.headers.raw
                                  if name.lower() not in HOP_BY_HOP and name.lower() != b"content-encoding"]
                answer = PlainResponse(response.status_code, content,
                                       [*answer_headers, (BACKEND_HEADER, backend.name.encode())])
                return self.fail(backend, f"http_{response.status_code}", f"answered {response.status_code}", answer)
            chunks = response.aiter_raw()
            event_stream = is_plain_event_stream(response.headers)
            first, finished = b"", False
            try:
                while True:
                    first += await anext(chunks)
                    if not event_stream or has_output(first) or len(first) > HOLD_BACK_LIMIT:
                        break
            except StopAsyncIteration:
                finished = True
            except httpx.TimeoutException as error:
                return self.fail(backend, "timeout", error)
            except httpx.HTTPError as error:
                return self.fail(backend, "disconnect", error)
            elapsed = time.perf_counter() - started
            self.metrics.first_byte.labels(backend.name).observe(elapsed)
            if predicted_ttft is not None and event_stream and has_output(first):
                backend.first_token(predicted_ttft, elapsed)  # a whole JSON answer would include its decode
            handed_over = True
            return PassThrough(backend, response, chunks, first, finished, started, self.metrics, self.release)
        finally:
            if not handed_over:
                if response is not None:
                    await close_response(response, chunks)
                self.release(backend)
