"""What the completions and chat handlers share: engine access, fan-out, SSE framing, logprob text."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from http import HTTPStatus
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.background import BackgroundTask

from titan.engine.admission import AdmissionRejectedError
from titan.engine.llm_engine import EngineInfo
from titan.engine.outputs import RequestOutput
from titan.engine.sampling_params import SamplingParams
from titan.engine.scheduler_output import TokenLogprobs
from titan.server.async_engine import AsyncEngine, EngineFailed, EngineRequest, OutputStream, RequestRejected
from titan.server.errors import APIError, bad_request, error_body
from titan.server.limits import DEFAULT_MAX_SEQUENCES_PER_REQUEST, INLINE_TOKENIZE_CHARS
from titan.server.middleware import ResponseCounter
from titan.tokenizer import Tokenizer

T = TypeVar("T")

# A client that disconnected before the response: nginx's convention, never seen by anyone.
CLIENT_CLOSED_REQUEST = 499

SSE_DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@dataclass
class ServerState:
    engine: AsyncEngine
    served_model_name: str | None  # None: the engine's own model name
    # One request may not fan out into more engine sequences (prompts × n) than this.
    max_sequences_per_request: int = DEFAULT_MAX_SEQUENCES_PER_REQUEST
    tool_call_parser: str = "hermes"  # how tool_choice auto reads calls out of the model's text (tools.py)
    log_requests: bool = False  # log each generation request's shape and sampling parameters at INFO
    draining: bool = False
    # Generation responses from arrival to their last byte: a drain waits for these, not only for the
    # engine's requests (a stream's tail is still being written after its request finished).
    responses: ResponseCounter = field(default_factory=ResponseCounter)
    started: float = field(default_factory=time.time)

    @property
    def busy(self) -> bool:
        return self.responses.open > 0 or self.engine.num_in_flight > 0

    @property
    def model_name(self) -> str:
        info = self.engine.info
        return self.served_model_name or (info.model_name if info is not None else "unknown")

    def serving_info(self) -> EngineInfo:
        """The engine's info if requests can be taken now; otherwise a 503 saying why."""
        if self.draining:
            raise APIError(HTTPStatus.SERVICE_UNAVAILABLE, "The server is shutting down.",
                           code="shutting_down", headers={"Retry-After": "1"})
        info = self.engine.info
        if info is None or not self.engine.ready.is_set():
            raise APIError(HTTPStatus.SERVICE_UNAVAILABLE, "The model is still loading.", code="not_ready",
                           headers={"Retry-After": "5"})
        if not self.engine.alive:
            raise APIError(HTTPStatus.SERVICE_UNAVAILABLE, f"The engine has stopped: {self.engine.error}",
                           code="engine_dead")
        return info


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


async def tokenize(tokenizer: Tokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
    if len(text) <= INLINE_TOKENIZE_CHARS:
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)
    return await asyncio.to_thread(tokenizer.encode, text, add_special_tokens)


@dataclass
class Choice:
    """One engine request behind one `choices[index]` entry."""

    index: int
    prompt_index: int
    prompt_token_ids: list[int]
    params: SamplingParams


TIMELINE_HEADER = "x-titan-timeline"
DEGRADED_HEADER = "X-Titan-Degraded"


def wants_timeline(body_flag: bool, headers: Mapping[str, str]) -> bool:
    """`"titan_timeline": true` in the body, or the X-Titan-Timeline header set to true/1/yes."""
    return body_flag or headers.get(TIMELINE_HEADER, "").strip().lower() in ("1", "true", "yes")


def degraded_headers(stream: OutputStream) -> dict[str, str]:
    """`X-Titan-Degraded: max_tokens=64` when admission degraded any choice of the request."""
    applied = {f"{kind}={change['applied']}" for changes in stream.degradations.values()
               for kind, change in changes.items()}
    return {DEGRADED_HEADER: ", ".join(sorted(applied))} if applied else {}


PRIORITY_HEADER = "x-titan-priority"
PRIORITY_CLASSES = {"interactive": 0, "batch": 1}


def request_priority(body_priority: int | None, headers: Mapping[str, str]) -> int:
    """The body's `priority` (vLLM's extension) wins; else the class header; else 0 (interactive)."""
    if body_priority is not None:
        return body_priority
    value = headers.get(PRIORITY_HEADER)
    if value is None:
        return 0
    if value.strip().lower() not in PRIORITY_CLASSES:
        raise bad_request(f"{PRIORITY_HEADER} must be one of {', '.join(PRIORITY_CLASSES)}, not {value!r}",
                          param=PRIORITY_HEADER)
    return PRIORITY_CLASSES[value.strip().lower()]


async def run_to_completion(stream: OutputStream) -> dict[int, RequestOutput]:
    """Wait for every choice of a submitted request (non-streaming responses): choice index → final."""
    finals: dict[int, RequestOutput] = {}
    try:
        async for output in stream:
            if output.finished:
                finals[choice_index(output.request_id)] = output
    except EngineFailed as error:
        raise engine_failure(error) from error
    finally:
        stream.abort()
    return finals


async def submit(state: ServerState, request_id: str, choices: list[Choice], priority: int,
                 arrival_time: float, cache_salt: str | None = None) -> OutputStream:
    """Hand the choices to the engine; `arrival_time` (time.monotonic()) is when the HTTP request came in."""
    requests = [EngineRequest(f"{request_id}-{choice.index}", choice.prompt_token_ids, choice.params, priority,
                              arrival_time, choice.prompt_index, cache_salt) for choice in choices]
    try:
        return await state.engine.submit(requests)
    except RequestRejected as error:
        raise bad_request(str(error), param=error.param) from error
    except AdmissionRejectedError as error:
        raise APIError(HTTPStatus.TOO_MANY_REQUESTS, str(error), code="overloaded",
                       headers={"Retry-After": str(int(error.retry_after_seconds))}) from error
    except EngineFailed as error:
        raise engine_failure(error) from error


def sse_response(body: AsyncIterator[bytes], stream: OutputStream) -> StreamingResponse:
    # The generator's own `finally` aborts on disconnect, but a client gone before the first chunk
    # cancels the response before the generator ever starts; the background task covers that case.
    return StreamingResponse(body, media_type="text/event-stream", headers=SSE_HEADERS | degraded_headers(stream),
                             background=BackgroundTask(stream.abort))


def choice_index(request_id: str) -> int:
    return int(request_id.rsplit("-", 1)[1])


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict[str, Any]:
    """OpenAI's usage object; `cached_tokens` (prompt tokens read from the prefix cache) when known."""
    used: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                            "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:
        used["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return used


def cached_prompt_tokens(choices: list[Choice], finals: Mapping[int, RequestOutput]) -> int:
    """Prompt tokens the prefix cache supplied, each prompt counted once (as its tokens are in `usage`): its
    first finished choice's hit."""
    hits: dict[int, int] = {}
    for choice in sorted(choices, key=lambda c: c.index):
        output = finals.get(choice.index)
        if output is not None:
            hits.setdefault(choice.prompt_index, output.num_cached_tokens)
    return sum(hits.values())


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def sse_error(error: Exception) -> bytes:
    """An error after the 200 went out can only travel inside the stream (as vLLM does)."""
    status = HTTPStatus.INTERNAL_SERVER_ERROR
    return sse(error_body(str(error), "server_error", None, "engine_error") | {"status": int(status)})


def engine_failure(error: EngineFailed) -> APIError:
    return APIError(HTTPStatus.INTERNAL_SERVER_ERROR, str(error), code="engine_error")


async def until_disconnect(request: Request, work: Awaitable[T]) -> T | Response:
    """Run `work` unless the client hangs up first; then cancel it (its requests get aborted)."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                task.cancel()
                return

    watcher = asyncio.create_task(watch())
    try:
        return await task
    except asyncio.CancelledError:
        if watcher.done():
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        raise
    finally:
        watcher.cancel()


class TokenTexts:
    """Token id → its text and UTF-8 bytes, for logprobs (cached: the same ids recur constantly)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.text: Callable[[int], str] = lru_cache(maxsize=65536)(self._text)

    def _text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def bytes(self, token_id: int) -> list[int]:
        return list(self.tokenizer.token_bytes(token_id))


class TokenIdTexts(TokenTexts):
    """vLLM's return_tokens_as_token_ids: logprob entries name each token `token_id:N`, which stays exact
    where a token's text alone is not (part of a character, or the same text as another token)."""

    def _text(self, token_id: int) -> str:
        return f"token_id:{token_id}"

    def bytes(self, token_id: int) -> list[int]:  # vLLM's: the bytes of that name
        return list(self.text(token_id).encode("utf-8"))


def prompt_logprobs_field(texts: TokenTexts, asked: int | None, output: RequestOutput) -> dict[str, Any]:
    """vLLM's `prompt_logprobs` entry of a choice: per prompt position, token id → logprob, rank, text."""
    if asked is None:
        return {}
    decode = texts.text

    def entry(item: TokenLogprobs | None) -> dict[str, Any] | None:
        if item is None:
            return None
        ranked = [(item.token_id, item.logprob, item.rank)]
        ranked += [(token_id, logprob, rank) for rank, (token_id, logprob) in enumerate(item.top, start=1)]
        values: dict[str, Any] = {}
        for token_id, logprob, rank in ranked:
            values.setdefault(str(token_id), {"logprob": logprob, "rank": rank, "decoded_token": decode(token_id)})
        return values

    return {"prompt_logprobs": [entry(item) for item in output.prompt_logprobs or []]}
