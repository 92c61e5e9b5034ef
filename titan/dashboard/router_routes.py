"""The dashboard on the router's plain ASGI app: the page, its assets and `/debug/dashboard` (behind the
router's debug key when it has one, as Titan's /debug/* is behind its API key)."""

from __future__ import annotations

import hmac
import json
import os
from http import HTTPStatus
from pathlib import Path
from typing import TYPE_CHECKING

from starlette.types import Scope

from titan.dashboard.page import PAGE, STATIC_PREFIX, asset
from titan.dashboard.router_view import RouterDashboard
from titan.dashboard.server_view import DashboardSettings
from titan.router.responses import PlainResponse

if TYPE_CHECKING:
    from titan.router.app import RouterApp

DATA_PATH = "/debug/dashboard"
KEY_ENV = "TITAN_ROUTER_DEBUG_KEY"


def debug_key(path: str | None) -> str | None:
    if path:
        return Path(path).read_text().splitlines()[0].strip() or None
    return os.environ.get(KEY_ENV) or None


class DashboardRoutes:
    def __init__(self, app: RouterApp) -> None:
        config = app.config
        self.view = RouterDashboard(app, DashboardSettings(config.dashboard_window, config.dashboard_history,
                                                           config.dashboard_max_spikes))
        key = debug_key(config.debug_api_key_file)
        self.expected = f"Bearer {key}".encode() if key else None

    def handles(self, path: str) -> bool:
        return path == "/dashboard" or path.startswith(STATIC_PREFIX) or path.startswith("/debug/")

    async def answer(self, scope: Scope) -> PlainResponse:
        path = scope["path"]
        if scope["method"] not in ("GET", "HEAD"):
            return PlainResponse.error(HTTPStatus.METHOD_NOT_ALLOWED, "Method Not Allowed", "method_not_allowed")
        if path.startswith("/debug/"):
            if self.expected is not None:
                given = next((value for name, value in scope["headers"] if name == b"authorization"), b"")
                if not hmac.compare_digest(given, self.expected):
                    return PlainResponse.error(HTTPStatus.UNAUTHORIZED, "Missing or incorrect debug API key.",
                                               "invalid_api_key", ((b"www-authenticate", b"Bearer"),))
            if path != DATA_PATH:
                return PlainResponse.error(HTTPStatus.NOT_FOUND, "Not Found", "not_found")
            body = json.dumps(await self.view.data()).encode()
            return PlainResponse(HTTPStatus.OK, body, [(b"content-type", b"application/json")])
        found = asset(PAGE if path == "/dashboard" else path[len(STATIC_PREFIX):])
        if found is None:
            return PlainResponse.error(HTTPStatus.NOT_FOUND, "Not Found", "not_found")
        return PlainResponse(HTTPStatus.OK, found[0], [(b"content-type", found[1].encode()),
                                                       (b"cache-control", b"no-cache")])
