"""The router's ASGI app (plain ASGI: a framework's middleware would sit between the two streams).

Endpoints:
- `POST /v1/completions`, `POST /v1/chat/completions`, and any other `/v1/*` request: forwarded to a
  backend picked by the policy (only completions and chat carry an affinity key). The response carries
  `x-titan-router-backend: <name>`.
- `GET /v1/models`: the union of the ready backends' lists (by id, first seen wins), fetched with the
  client's own Authorization header.
- `GET /health`: 200 while the router runs. `GET /ready`: 200 while at least one backend is in the
  pool, else 503; the body lists every backend's state (and those that left but still finish requests).
- `GET /metrics`: `titan_router:*` (metrics.py).
- `GET /dashboard`: the live dashboard, per backend (titan/dashboard); its data is `GET /debug/dashboard`.
"""

from __future__ import annotations

import asyncio
import json
import logging
from http import HTTPStatus
from typing import Any

import httpx
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.types import Receive, Scope, Send

from titan.dashboard.router_routes import DashboardRoutes
from titan.router.backend import BackendPool
from titan.router.config import BackendSpec, RouterConfig
from titan.router.degrade import Degrader
from titan.router.discovery import DnsDiscovery, Resolver, dns_resolver
from titan.router.health import HealthChecker
from titan.router.metrics import RouterMetrics
from titan.router.policies import make_policy
from titan.router.proxy import Proxy, forwarded_headers
from titan.router.responses import PlainResponse
from titan.router.scoring import score_policy

logger = logging.getLogger("titan.router")


def json_response(payload: Any, status: int = HTTPStatus.OK) -> PlainResponse:
    return PlainResponse(status, json.dumps(payload).encode(), [(b"content-type", b"application/json")])


class RouterApp:
    def __init__(self, config: RouterConfig, resolver: Resolver | None = None) -> None:
        """`resolver`: how `discover_dns` names are resolved (default: the system's, through the event loop)."""
        self.config = config.validate()
        self.resolver = resolver or dns_resolver(config.discover_family)
        names = [spec.name for spec in config.backends]
        self.metrics = RouterMetrics(names)
        policy = (score_policy(config) if config.policy == "score"
                  else make_policy(config.policy, names, config.load_factor, config.min_load, config.seed))
        self.pool = BackendPool(config.backends, policy)
        self.client: httpx.AsyncClient | None = None
        self.health: HealthChecker | None = None
        self.proxy: Proxy | None = None
        self.discovery: DnsDiscovery | None = None
        self.dashboard = DashboardRoutes(self)
        self.degrader = (Degrader(self.pool, self.metrics.registry, config.interactive_ttft_slo_ms / 1000,
                                  config.batch_ttft_slo_ms / 1000)
                         if any(source.pool for source in [*config.backends, *config.discover_dns]) else None)

    # ---- lifespan ------------------------------------------------------------------------------
    async def startup(self) -> None:
        config = self.config
        # Unlimited connections (the backends bound concurrency themselves); idle ones are dropped before
        # uvicorn's 5 s keep-alive timeout would close them under a request.
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(connect=config.connect_timeout, read=config.read_timeout,
                                  write=config.read_timeout, pool=config.connect_timeout),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256, keepalive_expiry=4.0),
            trust_env=False,  # an HTTP(S)_PROXY meant for the internet must not catch backend traffic
        )
        self.health = HealthChecker(self.pool, self.client, self.metrics, config.health_interval,
                                    config.health_timeout, scrape_load=True)
        self.proxy = Proxy(config, self.pool, self.client, self.metrics, self.health)
        self.proxy.degrader = self.degrader
        self.health.start()
        if config.discover_dns:
            self.discovery = DnsDiscovery(config.discover_dns, self, config.discover_interval, self.resolver,
                                          config.backends)
            await self.discovery.start()

    async def shutdown(self) -> None:
        if self.discovery is not None:
            await self.discovery.stop()
        if self.health is not None:
            await self.health.stop()
        if self.client is not None:
            await self.client.aclose()

    async def lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self.startup()
                except Exception as error:  # noqa: BLE001 - reported to the server, which exits
                    await send({"type": "lifespan.startup.failed", "message": str(error)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return

    # ---- membership (discovery.py) -------------------------------------------------------------------
    def add_backend(self, spec: BackendSpec) -> None:
        assert self.health is not None, "the lifespan did not start"
        backend = self.pool.add(spec)
        self.metrics.add_backend(spec.name)
        self.metrics.outstanding.labels(spec.name).set(backend.outstanding)  # a retiring one coming back
        self.health.add(backend)

    def remove_backend(self, name: str, reason: str) -> None:
        assert self.health is not None, "the lifespan did not start"
        backend = self.pool.remove(name, reason)
        if backend is None:
            return
        self.health.remove(backend)
        if backend.outstanding == 0:
            self.metrics.forget_backend(name)
        else:  # its series go when its last request ends (Proxy.release)
            self.metrics.ready.labels(name).set(0)

    # ---- requests ------------------------------------------------------------------------------
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self.lifespan(receive, send)
            return
        if scope["type"] != "http":
            return  # websockets: not served (uvicorn answers 403)
        path, method = scope["path"], scope["method"]
        if path.startswith("/v1/") and not (path == "/v1/models" and method in ("GET", "HEAD")):
            assert self.proxy is not None, "the lifespan did not start"
            await self.proxy.handle(scope, receive, send)
            return
        if self.dashboard.handles(path):
            response = await self.dashboard.answer(scope)
        elif method not in ("GET", "HEAD"):
            response = PlainResponse.error(HTTPStatus.METHOD_NOT_ALLOWED, "Method Not Allowed", "method_not_allowed")
        elif path == "/health":
            response = json_response({"status": "ok"})
        elif path == "/ready":
            response = self.readiness()
        elif path == "/metrics":
            response = PlainResponse(HTTPStatus.OK, self.metrics.render(),
                                     [(b"content-type", CONTENT_TYPE_LATEST.encode())])
        elif path == "/v1/models":
            response = await self.models(scope)
        else:
            response = PlainResponse.error(HTTPStatus.NOT_FOUND, "Not Found", "not_found")
        await response.send_to(send)

    def readiness(self) -> PlainResponse:
        backends = [{"name": backend.name, "ready": backend.ready, "outstanding": backend.outstanding,
                     **({} if backend.ready else {"reason": backend.not_ready_reason})}
                    for backend in [*self.pool.backends, *self.pool.retiring.values()]]
        ready = any(backend.ready for backend in self.pool.backends)
        return json_response({"status": "ready" if ready else "no_backend", "policy": self.config.policy,
                              "backends": backends}, HTTPStatus.OK if ready else HTTPStatus.SERVICE_UNAVAILABLE)

    async def models(self, scope: Scope) -> PlainResponse:
        assert self.client is not None
        ready = self.pool.ready
        if not ready:
            return PlainResponse.error(HTTPStatus.SERVICE_UNAVAILABLE, "No backend is ready.", "no_backend")
        headers = [(name, value) for name, value in forwarded_headers(scope) if name != b"accept-encoding"]
        answers = await asyncio.gather(
            *(self.client.get(backend.url + "/v1/models", headers=headers, timeout=self.config.health_timeout)
              for backend in ready),
            return_exceptions=True)
        cards: dict[str, Any] = {}
        first_error: httpx.Response | None = None
        for answer in answers:
            if isinstance(answer, BaseException):
                continue
            if answer.status_code != HTTPStatus.OK:
                first_error = first_error or answer
                continue
            try:
                for card in answer.json()["data"]:
                    cards.setdefault(str(card["id"]), card)
            except (ValueError, KeyError, TypeError):
                continue
        if not cards and first_error is not None:  # e.g. every backend wants an API key this client lacks
            return PlainResponse(first_error.status_code, first_error.content,
                                 [(b"content-type", b"application/json")])
        return json_response({"object": "list", "data": list(cards.values())})
