"""The dashboard's three routes on a FastAPI app (`titan serve`); the router serves the same by hand."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from titan.dashboard.page import PAGE, asset
from titan.server.errors import error_body


def install_dashboard(app: FastAPI, data: Callable[[], Awaitable[dict[str, Any]]]) -> None:
    @app.get("/dashboard", include_in_schema=False)
    async def dashboard_page() -> Response:
        found = asset(PAGE)
        assert found is not None
        return Response(found[0], media_type=found[1], headers={"cache-control": "no-cache"})

    @app.get("/dashboard/static/{name}", include_in_schema=False)
    async def dashboard_asset(name: str) -> Response:
        found = asset(name)
        if found is None:
            return JSONResponse(error_body("Not Found", "invalid_request_error", None, "not_found"),
                                status_code=HTTPStatus.NOT_FOUND)
        return Response(found[0], media_type=found[1])

    @app.get("/debug/dashboard")
    async def dashboard_data() -> dict[str, Any]:
        """The live dashboard's figures now: sliding-window TTFT/ITL P50/P99, queue, running, KV usage,
        token and error rates, GC, and recent latency spikes with their attributed causes."""
        return await data()
