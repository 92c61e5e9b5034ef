"""Polls every backend: readiness, its model list, and (for least-load) its queue and KV cache usage.

Readiness is `GET /ready` (Titan: 503 while loading or draining, 200 when serving); a backend that
answers 404 there is some other server and is judged by `GET /health` from then on. One failed poll
takes a backend out of the pool and one good poll brings it back. The proxy also takes a backend out
at once when it refuses a connection or answers 503, without waiting for the next poll.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from http import HTTPStatus

import httpx

from titan.bench.metrics_scraper import parse_prometheus_text, read_lines
from titan.router.backend import Backend, BackendPool
from titan.router.metrics import RouterMetrics
from titan.router.step_cost import StepCost, step_totals

logger = logging.getLogger("titan.router")

# Scraped load gauges under Titan's and vLLM's names (older vLLM calls KV usage gpu_cache_usage_perc).
WAITING_NAMES = ("titan:num_requests_waiting", "vllm:num_requests_waiting")
KV_USAGE_NAMES = ("titan:kv_cache_usage_perc", "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
# A ready backend's model list is re-read this often (and whenever it rejoins: it may have changed).
MODELS_REFRESH_SECONDS = 60.0


def load_gauges(text: str) -> tuple[float | None, float | None]:
    """(requests waiting summed over label sets, highest KV cache usage) from Prometheus text."""
    waiting: dict[str, float] = {}
    usage: dict[str, float] = {}
    for sample in parse_prometheus_text(read_lines(text, WAITING_NAMES + KV_USAGE_NAMES)):
        if sample.name in WAITING_NAMES:
            waiting[sample.name] = waiting.get(sample.name, 0.0) + sample.value
        elif sample.name in KV_USAGE_NAMES:
            usage[sample.name] = max(usage.get(sample.name, 0.0), sample.value)
    first_waiting = next((waiting[name] for name in WAITING_NAMES if name in waiting), None)
    first_usage = next((usage[name] for name in KV_USAGE_NAMES if name in usage), None)
    return first_waiting, first_usage


class HealthChecker:
    def __init__(self, pool: BackendPool, client: httpx.AsyncClient, metrics: RouterMetrics, interval: float,
                 timeout: float, scrape_load: bool) -> None:
        self.pool = pool
        self.client = client
        self.metrics = metrics
        self.interval = interval
        self.timeout = timeout
        self.scrape_load = scrape_load
        self.tasks: dict[str, asyncio.Task[None]] = {}  # one poller per pool member, by name
        self.models_read_at: dict[str, float] = {}
        self.step_costs: dict[str, StepCost] = {}  # per backend, from its scraped step metrics
        self.ejections: dict[str, int] = {}  # per backend: bumped by `eject`, so a poll in flight is stale

    def start(self) -> None:
        for backend in self.pool.backends:
            self.add(backend)

    def add(self, backend: Backend) -> None:
        """Poll a new member; it joins the pool on its first good poll."""
        self.tasks[backend.name] = asyncio.create_task(self.watch(backend))

    def remove(self, backend: Backend) -> None:
        """Stop polling a member that left; a poll in flight is cancelled before it can report."""
        task = self.tasks.pop(backend.name, None)
        if task is not None:
            task.cancel()
        self.models_read_at.pop(backend.name, None)
        self.step_costs.pop(backend.name, None)
        self.ejections.pop(backend.name, None)

    async def stop(self) -> None:
        tasks = list(self.tasks.values())
        self.tasks.clear()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def eject(self, backend: Backend, reason: str) -> None:
        """Out of the pool now (the proxy saw it fail); the next good poll brings it back."""
        if backend.retired:
            return  # already out for good, with no poller to bring it back
        self.ejections[backend.name] = self.ejections.get(backend.name, 0) + 1
        self.pool.set_ready(backend, False, reason)
        self.metrics.ready.labels(backend.name).set(0)

    async def watch(self, backend: Backend) -> None:
        while True:
            started = time.monotonic()
            try:
                await self.poll(backend)
            except Exception:  # a poller must never die: the backend would be frozen in its last state
                logger.exception("polling %s failed", backend.name)
            await asyncio.sleep(max(0.0, self.interval - (time.monotonic() - started)))

    async def poll(self, backend: Backend) -> None:
        ejections = self.ejections.get(backend.name, 0)
        ready, reason = await self.check(backend)
        if ready:
            rejoining = not backend.ready
            last_read = self.models_read_at.get(backend.name)
            if rejoining or last_read is None or time.monotonic() - last_read > MODELS_REFRESH_SECONDS:
                await self.read_models(backend)
            if self.scrape_load:
                await self.read_load(backend)
            if self.ejections.get(backend.name, 0) != ejections:
                return  # ejected while this poll ran: its "ready" is older than that failure
        self.pool.set_ready(backend, ready, reason)
        self.metrics.ready.labels(backend.name).set(1 if ready else 0)

    async def check(self, backend: Backend) -> tuple[bool, str]:
        path = backend.readiness_path
        try:
            response = await self.client.get(backend.url + path, timeout=self.timeout)
        except httpx.HTTPError as error:
            return False, f"{path}: {type(error).__name__} {error}".strip()
        if response.status_code in (HTTPStatus.NOT_FOUND, HTTPStatus.METHOD_NOT_ALLOWED) and path == "/ready":
            logger.info("backend %s has no /ready; judging it by /health", backend.name)
            backend.readiness_path = "/health"
            return await self.check(backend)
        if response.status_code == HTTPStatus.OK:
            return True, ""
        detail = ""
        with contextlib.suppress(ValueError, AttributeError):
            detail = f" ({response.json()['status']})"
        return False, f"{path} answered {response.status_code}{detail}"

    async def read_models(self, backend: Backend) -> None:
        """Unknown (None) when the list cannot be read, e.g. behind an API key: then it may serve anything."""
        try:
            response = await self.client.get(backend.url + "/v1/models", timeout=self.timeout)
            response.raise_for_status()
            backend.models = frozenset(str(card["id"]) for card in response.json()["data"])
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            backend.models = None
        self.models_read_at[backend.name] = time.monotonic()

    async def read_load(self, backend: Backend) -> None:
        try:
            response = await self.client.get(backend.url + "/metrics", timeout=self.timeout)
            response.raise_for_status()
            backend.waiting, backend.kv_cache_usage = load_gauges(response.text)
            cost = self.step_costs.setdefault(backend.name, StepCost())
            cost.update(step_totals(response.text))
            backend.step_overhead, backend.seconds_per_token = cost.overhead, cost.per_token
        except httpx.HTTPError:
            backend.waiting = backend.kv_cache_usage = None
        for gauge, value in ((self.metrics.waiting, backend.waiting),
                             (self.metrics.kv_cache_usage, backend.kv_cache_usage)):
            gauge.labels(backend.name).set(value if value is not None else float("nan"))
