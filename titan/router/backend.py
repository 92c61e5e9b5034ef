"""One backend's routing state, and the pool that hands a request to a policy.

Everything here runs on the router's one event loop, so plain attributes need no locks.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from dataclasses import dataclass, field

from titan.router.config import BackendSpec
from titan.router.policies import Policy
from titan.router.request_key import RoutingInfo


def say(message: str) -> None:
    """Pool changes are printed whatever the log level: operators need them (as `titan serve` does)."""
    print(f"[titan] router: {message}", file=sys.stderr, flush=True)


@dataclass(eq=False)
class Backend:
    url: str
    name: str
    index: int  # position in the configured list (round-robin order)
    ready: bool = False  # no requests until the first poll says so
    outstanding: int = 0  # requests this router has open on it (sent, response not finished)
    waiting: float | None = None  # scraped num_requests_waiting (None: not scraped / not exposed)
    kv_cache_usage: float | None = None  # scraped kv_cache_usage_perc, 0 to 1
    models: frozenset[str] | None = None  # model ids from /v1/models (None: unknown, may serve anything)
    readiness_path: str = "/ready"  # Titan's; "/health" once a backend answers 404 to /ready
    not_ready_reason: str = field(default="not polled yet")

    def serves(self, model: str | None) -> bool:
        return model is None or self.models is None or model in self.models


class BackendPool:
    def __init__(self, specs: Iterable[BackendSpec], policy: Policy) -> None:
        self.backends = [Backend(spec.url, spec.name, index) for index, spec in enumerate(specs)]
        self.policy = policy

    @property
    def ready(self) -> list[Backend]:
        return [backend for backend in self.backends if backend.ready]

    def set_ready(self, backend: Backend, ready: bool, reason: str = "") -> None:
        if ready != backend.ready:
            if ready:
                say(f"backend {backend.name} ({backend.url}) joined the pool")
            else:
                say(f"backend {backend.name} ({backend.url}) left the pool: {reason}")
        backend.ready = ready
        backend.not_ready_reason = "" if ready else reason

    def candidates(self, model: str | None, exclude: set[str]) -> list[Backend]:
        """Ready backends not yet tried; those known to serve `model` when any does (else all: the
        backend will answer an unknown model with its own 404)."""
        ready = [backend for backend in self.backends if backend.ready and backend.name not in exclude]
        serving = [backend for backend in ready if backend.serves(model)]
        return serving or ready

    def choose(self, info: RoutingInfo, exclude: set[str]) -> Backend | None:
        candidates = self.candidates(info.model, exclude)
        if not candidates:
            return None
        return self.policy.choose(candidates, info.key)
