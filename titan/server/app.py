"""The ASGI app: OpenAI routes, health/readiness/metrics, API key and body-size limits.

Endpoints:
- `POST /v1/completions`, `POST /v1/chat/completions`, `GET /v1/models`
- `GET /health`: liveness. 200 while the process serves (also while loading and draining); 503 only
  once the engine thread has died, so a liveness probe restarts a wedged server.
- `GET /ready`: readiness. 503 until the model is loaded and warmed up, 200 while serving, 503 again
  from the moment draining (SIGTERM) begins. The body says which: starting | ready | draining | failed.
- `GET /metrics` (Prometheus text), `GET /version`.
"""

from __future__ import annotations

import importlib.metadata
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

from titan.engine.llm_engine import StepRecord
from titan.kernels import build as kernels
from titan.server.async_engine import AsyncEngine
from titan.server.chat import create_chat_completion
from titan.server.completions import create_completion
from titan.server.errors import install_error_handlers, validation_error
from titan.server.limits import DEFAULT_MAX_BODY_BYTES
from titan.server.middleware import APIKeyCheck, BodySizeLimit
from titan.server.protocol import ChatCompletionRequest, CompletionRequest
from titan.server.serving import ServerState

Body = TypeVar("Body", bound=BaseModel)


async def parse_body(request: Request, schema: type[Body]) -> Body:
    """The JSON body whatever the Content-Type says (curl -d sends form encoding), validated by pydantic."""
    raw = await request.body()
    try:
        return schema.model_validate_json(raw)
    except ValidationError as error:
        raise validation_error(error.errors()) from error


def titan_version() -> str:
    try:
        return importlib.metadata.version("titan")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


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
) -> FastAPI:
    """The app; its lifespan starts the engine thread (load + warm-up run in it) and stops it."""
    state = ServerState(engine, served_model_name)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        yield
        await engine.stop()

    app = FastAPI(title="Titan", version=titan_version(), lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.server = state
    install_error_handlers(app)

    @app.get("/health")
    async def health() -> Response:
        if engine.error is not None:
            return JSONResponse({"status": "failed", "error": str(engine.error)},
                                status_code=HTTPStatus.SERVICE_UNAVAILABLE)
        return Response(status_code=HTTPStatus.OK)

    @app.get("/ready")
    async def ready() -> Response:
        status = readiness(state)
        code = HTTPStatus.OK if status == "ready" else HTTPStatus.SERVICE_UNAVAILABLE
        return JSONResponse({"status": status}, status_code=code)

    @app.get("/version")
    async def version() -> dict[str, str]:
        # quantized_kernels: native-avx512 | native-avx2 | native-generic | torch (fallback) | unused
        return {"version": titan_version(), "quantized_kernels": kernels.status()}

    @app.get("/metrics")
    async def metrics() -> Response:
        body = engine.metrics.render() if engine.metrics is not None else b""
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    @app.get("/debug/steps")
    async def debug_steps(limit: int = 512) -> dict[str, object]:
        """The most recent engine steps (time, duration, tokens, sequences, prefill tokens, preemptions,
        GC pause), oldest first, for attributing latency spikes."""
        loaded = engine.engine
        records = tuple(loaded.steps)[-max(limit, 0):] if loaded is not None and limit > 0 else ()
        # Step times are monotonic; shift them onto the wall clock clients compare against.
        offset = time.time() - time.monotonic()
        # ready_time lets a client tell cold-start transients from later ones.
        return {"object": "list", "data": [step_json(record, offset) for record in records],
                "ready_time": engine.ready_time}

    @app.get("/v1/models")
    async def models() -> dict[str, object]:
        loaded = state.serving_engine() if not state.draining else engine.engine
        assert loaded is not None
        card = {"id": state.model_name, "object": "model", "created": int(state.started), "owned_by": "titan",
                "root": loaded.model_name, "max_model_len": loaded.max_model_len}
        return {"object": "list", "data": [card]}

    # `state.handling` counts handlers between arrival and their requests reaching the engine, so a
    # drain that waits for it and for the engine's in-flight count never misses one in between.
    async def generate(request: Request, schema: type[Body], create: Callable[..., Awaitable[Response]]) -> Response:
        state.handling += 1
        try:
            return await create(state, await parse_body(request, schema), request)
        finally:
            state.handling -= 1

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(request, CompletionRequest, create_completion)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generate(request, ChatCompletionRequest, create_chat_completion)

    app.add_middleware(BodySizeLimit, max_bytes=max_body_bytes)
    if api_key:
        app.add_middleware(APIKeyCheck, api_key=api_key)
    return app
