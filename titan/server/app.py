"""The ASGI app: OpenAI routes, health/readiness/metrics, API key and body-size limits.

Endpoints:
- `POST /v1/completions`, `POST /v1/chat/completions`, `POST /v1/responses`, `GET /v1/models`
- `GET /health`: liveness. 200 while the process serves (also while loading and draining); 503 only
  once the engine thread has died, so a liveness probe restarts a wedged server.
- `GET /ready`: readiness. 503 until the model is loaded and warmed up, 200 while serving, 503 again
  from the moment draining (SIGTERM) begins. The body says which: starting | ready | draining | failed.
- `GET /metrics` (Prometheus text), `GET /version`.
- `GET /dashboard`: the live dashboard page (static; its data, `GET /debug/dashboard`, needs the API key).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import asdict
from http import HTTPStatus
from typing import TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError

from titan.dashboard.routes import install_dashboard
from titan.dashboard.server_view import DashboardSettings, ServerDashboard
from titan.engine.step_observer import StepRecord
from titan.kernels import build as kernels
from titan.server.api_models import (
    ChatCompletionResponse,
    CompletionResponse,
    DetokenizeResponse,
    HealthFailure,
    ModelList,
    Readiness,
    StepList,
    TokenizeResponse,
    VersionInfo,
    answers,
)
from titan.server.async_engine import AsyncEngine
from titan.server.chat import create_chat_completion
from titan.server.chat_prompt import chat_prompt_ids, check_template_reads
from titan.server.chat_protocol import ChatCompletionRequest, DetokenizeRequest, TokenizeRequest, template_messages
from titan.server.coalesce import FlightRelease
from titan.server.completions import create_completion
from titan.server.errors import bad_request, install_error_handlers, validation_error
from titan.server.fields import check_extra_fields
from titan.server.gateway import Gateway
from titan.server.limits import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_SEQUENCES_PER_REQUEST
from titan.server.middleware import APIKeyCheck, BodySizeLimit, OpenResponseCount
from titan.server.openapi import DEBUG_ERRORS, ERROR_RESPONSES, install_openapi, json_body
from titan.server.protocol import CompletionRequest, check_model, check_token_ids
from titan.server.responses import create_response
from titan.server.responses_protocol import ResponsesRequest
from titan.server.serving import ServerState, tokenize
from titan.server.tenants import TenantGate, TenantRegistry
from titan.version import titan_version

Body = TypeVar("Body", bound=BaseModel)


async def parse_body(request: Request, schema: type[Body]) -> Body:
    """The JSON body whatever the Content-Type says (curl -d sends form encoding), validated by pydantic."""
    raw = await request.body()
    try:
        return schema.model_validate_json(raw)
    except ValidationError as error:
        raise validation_error(error.errors()) from error


def readiness(state: ServerState) -> str:
    engine = state.engine
    if engine.error is not None or engine.done.is_set():
        return "failed"
    if state.draining:
        return "draining"
    if not engine.ready.is_set():
        return "starting"
    return "ready"


def step_json(record: StepRecord, clock_offset: float) -> dict[str, object]:
    fields = asdict(record)
    fields["time"] = record.started + clock_offset
    return fields


def build_app(
    engine: AsyncEngine,
    served_model_name: str | None = None,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_sequences_per_request: int = DEFAULT_MAX_SEQUENCES_PER_REQUEST,
    metrics_require_key: bool = False,
    tool_call_parser: str = "hermes",
    log_requests: bool = False,
    gateway: Gateway | None = None,
    tenants: TenantRegistry | None = None,
    dashboard: DashboardSettings | None = None,
) -> FastAPI:
    """The app; its lifespan starts the engine thread (load + warm-up run in it) and stops it."""
    state = ServerState(engine, served_model_name, max_sequences_per_request, tool_call_parser, log_requests)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        if gateway is not None:
            gateway.start()
        yield
        await engine.stop()
        if gateway is not None:
            await gateway.close()

    app = FastAPI(title="Titan", version=titan_version(), lifespan=lifespan, docs_url="/docs", redoc_url=None)
    app.state.server = state
    app.state.gateway = gateway
    install_error_handlers(app)

    @app.get("/health", response_class=Response,
             responses={200: {"description": "alive (no body, as vLLM's)"},
                        503: {"model": HealthFailure, "description": "the engine thread died"}})
    async def health() -> Response:
        if engine.error is not None:
            return JSONResponse({"status": "failed", "error": str(engine.error)},
                                status_code=HTTPStatus.SERVICE_UNAVAILABLE)
        return Response(status_code=HTTPStatus.OK)

    @app.get("/ready", responses={**answers(Readiness, "ready"),
                                  503: {"model": Readiness, "description": "starting, draining or failed"}})
    async def ready() -> Response:
        status = readiness(state)
        code = HTTPStatus.OK if status == "ready" else HTTPStatus.SERVICE_UNAVAILABLE
        return JSONResponse({"status": status}, status_code=code)

    @app.get("/version", responses=answers(VersionInfo))
    async def version() -> dict[str, str]:
        # quantized_kernels: native-{avx512vnni,avx512,avx2,generic} | torch (fallback) | unused
        return {"version": titan_version(), "quantized_kernels": kernels.status()}

    @app.get("/metrics", responses={401: ERROR_RESPONSES[401], 200: {
        "description": "Prometheus text format", "content": {CONTENT_TYPE_LATEST.split(";")[0]: {}}}})
    async def metrics() -> Response:
        body = engine.metrics.render() if engine.metrics is not None else b""
        if gateway is not None:
            body += gateway.metrics.render()
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    @app.get("/debug/steps", responses={**answers(StepList), **DEBUG_ERRORS})
    async def debug_steps(limit: int = 512) -> dict[str, object]:
        """The most recent engine steps (time, duration, tokens, sequences, prefill tokens, preemptions,
        GC pause), oldest first, for attributing latency spikes."""
        records = await engine.recent_steps(limit)
        # Step times are monotonic; shift them onto the wall clock clients compare against.
        offset = time.time() - time.monotonic()
        # ready_time lets a client tell cold-start transients from later ones.
        return {"object": "list", "data": [step_json(record, offset) for record in records],
                "ready_time": engine.ready_time}

    @app.get("/v1/models", responses={**answers(ModelList), **ERROR_RESPONSES})
    async def models() -> dict[str, object]:
        loaded = state.serving_info() if not state.draining else engine.info
        assert loaded is not None
        card = {"id": state.model_name, "object": "model", "created": int(state.started), "owned_by": "titan",
                "root": loaded.model_name, "max_model_len": loaded.max_model_len}
        return {"object": "list", "data": [card]}

    @app.post("/tokenize", openapi_extra=json_body(TokenizeRequest),
              responses={**answers(TokenizeResponse), **ERROR_RESPONSES})
    async def tokenize_route(request: Request) -> dict[str, object]:
        body = await parse_body(request, TokenizeRequest)
        info = state.serving_info()
        check_model(body.model, [state.model_name])
        check_extra_fields(body.model_extra)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("give either prompt or messages", param="prompt")
        if body.messages is not None:
            body.check_template_fields()
            check_template_reads(info.tokenizer, body)
            messages = template_messages(body.messages)
            try:
                tokens = await asyncio.to_thread(chat_prompt_ids, info.tokenizer, messages, body)
            except ValueError as error:
                raise bad_request(f"Cannot apply the chat template: {error}", param="messages") from error
        else:
            tokens = await tokenize(info.tokenizer, body.prompt or "", body.add_special_tokens is not False)
        strings = [info.tokenizer.id_to_token(t) or "" for t in tokens] if body.return_token_strs else None
        return {"count": len(tokens), "max_model_len": info.max_model_len, "tokens": tokens, "token_strs": strings}

    @app.post("/detokenize", openapi_extra=json_body(DetokenizeRequest),
              responses={**answers(DetokenizeResponse), **ERROR_RESPONSES})
    async def detokenize_route(request: Request) -> dict[str, object]:
        body = await parse_body(request, DetokenizeRequest)
        info = state.serving_info()
        check_model(body.model, [state.model_name])
        check_token_ids(body.tokens, info.vocab_size, param="tokens")
        return {"prompt": info.tokenizer.decode(body.tokens, skip_special_tokens=False)}

    async def generate(request: Request, schema: type[Body], create: Callable[..., Awaitable[Response]]) -> Response:
        return await create(state, await parse_body(request, schema), request)

    @app.post("/v1/completions", openapi_extra=json_body(CompletionRequest),
              responses={**answers(CompletionResponse, streams=True), **ERROR_RESPONSES})
    async def completions(request: Request) -> Response:
        return await generate(request, CompletionRequest, create_completion)

    @app.post("/v1/chat/completions", openapi_extra=json_body(ChatCompletionRequest),
              responses={**answers(ChatCompletionResponse, streams=True), **ERROR_RESPONSES})
    async def chat_completions(request: Request) -> Response:
        return await generate(request, ChatCompletionRequest, create_chat_completion)

    @app.post("/v1/responses", openapi_extra=json_body(ResponsesRequest),
              responses={200: {"description": "a Response object, or its events as SSE with stream: true"},
                         **ERROR_RESPONSES})
    async def responses(request: Request) -> Response:
        return await generate(request, ResponsesRequest, create_response)

    install_dashboard(app, ServerDashboard(engine, dashboard or DashboardSettings()).data)
    install_openapi(app, [CompletionRequest, ChatCompletionRequest, ResponsesRequest, TokenizeRequest,
                          DetokenizeRequest])
    app.add_middleware(OpenResponseCount, counter=state.responses)
    app.add_middleware(BodySizeLimit, max_bytes=max_body_bytes)
    if gateway is not None and gateway.flights is not None:
        app.add_middleware(FlightRelease, flights=gateway.flights)
    if tenants is not None:
        app.add_middleware(TenantGate, registry=tenants, protect_metrics=metrics_require_key,
                           metrics=gateway.metrics if gateway is not None else None,
                           quota=gateway.quota if gateway is not None else None)
    elif api_key:
        app.add_middleware(APIKeyCheck, api_key=api_key, protect_metrics=metrics_require_key)
    return app
