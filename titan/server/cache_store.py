"""Where cached responses live: an in-process LRU bounded by bytes and TTL, or Redis shared by replicas.

Both stores speak bytes under string keys. The Redis store never lets a failure reach a request: an
error marks it down (`titan:cache_backend_up` 0, one log line), requests go on uncached, and it is tried
again after `retry_seconds`; the first success after that marks it up again (one more log line).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Protocol

from titan.server.gateway_metrics import GatewayMetrics

logger = logging.getLogger("titan.server")


class CacheStore(Protocol):
    name: str

    async def get(self, key: str) -> bytes | None: ...

    async def set(self, key: str, value: bytes, ttl_seconds: float) -> None: ...

    async def close(self) -> None: ...


class MemoryStore:
    """LRU over `max_bytes` of values (keys count too); entries older than their TTL are never returned."""

    name = "memory"

    def __init__(self, max_bytes: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_bytes = max_bytes
        self.clock = clock
        self.used = 0
        self.entries: OrderedDict[str, tuple[float, bytes]] = OrderedDict()

    def _drop(self, key: str) -> None:
        _, value = self.entries.pop(key)
        self.used -= len(key) + len(value)

    async def get(self, key: str) -> bytes | None:
        entry = self.entries.get(key)
        if entry is None:
            return None
        expires, value = entry
        if self.clock() >= expires:
            self._drop(key)
            return None
        self.entries.move_to_end(key)
        return value

    async def set(self, key: str, value: bytes, ttl_seconds: float) -> None:
        size = len(key) + len(value)
        if size > self.max_bytes:
            return  # larger than the whole cache: not worth evicting everything for
        if key in self.entries:
            self._drop(key)
        while self.used + size > self.max_bytes:
            self._drop(next(iter(self.entries)))
        self.entries[key] = (self.clock() + ttl_seconds, value)
        self.used += size

    async def close(self) -> None:
        self.entries.clear()


class BackendHealth:
    """Up/down state of one Redis use: a failure marks it down (gauge 0, one log line) for `retry_seconds`;
    the first success after that marks it up again (one more log line)."""

    def __init__(self, metrics: GatewayMetrics, cache: str, what: str, fallback: str, backend: str = "redis",
                 retry_seconds: float = 1.0) -> None:
        self.metrics = metrics
        self.backend = backend
        self.cache = cache  # the metrics label: result | semantic | tenant_quota
        self.what = what  # for the log: "the result cache", "tenant quotas"
        self.fallback = fallback  # what the server does meanwhile, for the log
        self.retry_seconds = retry_seconds
        self.down_until = 0.0
        self.up = True
        metrics.cache_backend_up.labels(backend, cache).set(1)

    def available(self) -> bool:
        return self.up or time.monotonic() >= self.down_until

    def failed(self, error: Exception) -> None:
        self.metrics.cache_backend_errors.labels(self.backend, self.cache).inc()
        self.down_until = time.monotonic() + self.retry_seconds
        if self.up:
            self.up = False
            self.metrics.cache_backend_up.labels(self.backend, self.cache).set(0)
            logger.warning("cache backend %s unavailable for %s (%s): %s", self.backend, self.what, error,
                           self.fallback)

    def succeeded(self) -> None:
        if not self.up:
            self.up = True
            self.metrics.cache_backend_up.labels(self.backend, self.cache).set(1)
            logger.warning("cache backend %s is back for %s", self.backend, self.what)


def connect_redis(url: str, timeout_seconds: float) -> tuple[Any, tuple[type[BaseException], ...]]:
    """An asyncio client for `url` (no connection yet) and the errors its calls raise. redis is imported
    here, not with the module: it is ~0.1 s of every cold start, and most servers use no Redis."""
    import redis.asyncio as aioredis
    from redis.exceptions import RedisError

    client = aioredis.from_url(url, socket_timeout=timeout_seconds, socket_connect_timeout=timeout_seconds,
                               retry_on_timeout=False)
    return client, (RedisError, OSError)


class RedisStore:
    """Redis (`--cache-url redis://...`): SET with PX for the TTL; the memory bound is Redis's `maxmemory`."""

    name = "redis"

    def __init__(self, url: str, metrics: GatewayMetrics, cache: str = "result", prefix: str = "titan:cache:",
                 timeout_seconds: float = 0.25, retry_seconds: float = 1.0) -> None:
        self.cache = cache  # which cache this store serves (result | semantic): a metrics label
        self.client, self.errors = connect_redis(url, timeout_seconds)
        self.url = url
        self.prefix = prefix
        self.health = BackendHealth(metrics, cache, f"the {cache} cache", "serving without it", self.name,
                                    retry_seconds)

    def _available(self) -> bool:
        return self.health.available()

    def _failed(self, error: Exception) -> None:
        self.health.failed(error)

    def _succeeded(self) -> None:
        self.health.succeeded()

    async def get(self, key: str) -> bytes | None:
        if not self._available():
            return None
        try:
            value = await self.client.get(self.prefix + key)
        except self.errors as error:
            self._failed(error)
            return None
        self._succeeded()
        return value

    async def set(self, key: str, value: bytes, ttl_seconds: float) -> None:
        if not self._available():
            return
        try:
            await self.client.set(self.prefix + key, value, px=max(1, int(ttl_seconds * 1000)))
        except self.errors as error:
            self._failed(error)
            return
        self._succeeded()

    async def close(self) -> None:
        try:
            await self.client.aclose()
        except self.errors:
            pass
