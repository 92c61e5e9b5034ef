"""Where tenants' token buckets live: in this process, or in Redis so that every replica draws on one.

`MemoryQuota` keeps each tenant's buckets in the replica (behind a router with N replicas a tenant gets
N times its limits). `RedisQuota` (`--cache-url` with `--api-keys-file`) keeps them in Redis: one Lua
script per request refills the buckets by Redis's own clock, checks them and takes the request, atomically,
in one round trip; a token charge is one more. Bucket keys expire once the bucket would be full again, so
Redis holds only tenants that used their quota recently. When Redis fails, the replica falls back to its
own buckets (metric `titan:cache_backend_up{cache="tenant_quota"}` 0, one log line) and returns to Redis
when it answers again.

`max_concurrent` stays per replica on purpose: it protects a replica's batch slots, which are per replica.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from titan.server.cache_store import BackendHealth, connect_redis
from titan.server.gateway_metrics import GatewayMetrics

if TYPE_CHECKING:
    from titan.server.tenants import Tenant

KINDS = ("requests", "tokens")


@dataclass(frozen=True)
class BucketView:
    """One bucket as a request saw it: what the x-ratelimit-* headers report."""

    capacity: int
    level: float

    def remaining(self) -> int:
        return max(0, math.floor(self.level))

    def seconds_until(self, level: float) -> float:
        return max(0.0, (level - self.level) / (self.capacity / 60.0))

    def taken(self, amount: float) -> BucketView:
        return BucketView(self.capacity, self.level - amount)


Refusal = tuple[str, str, float]  # (code, message, seconds to wait)


@dataclass
class Admission:
    refusal: Refusal | None
    views: dict[str, BucketView] = field(default_factory=dict)  # by kind: requests, tokens


def capacities(tenant: Tenant) -> dict[str, int]:
    spec = tenant.spec
    found = {"requests": spec.requests_per_minute, "tokens": spec.tokens_per_minute}
    return {kind: value for kind, value in found.items() if value}


def refusal_for(tenant: Tenant, kind: str, view: BucketView) -> Refusal:
    per = "requests per minute" if kind == "requests" else "tokens per minute"
    return ("rate_limit_exceeded", f"Rate limit reached for tenant {tenant.name} on {per} "
            f"(limit {view.capacity}).", view.seconds_until(1.0))


class Quota(Protocol):
    async def admit(self, tenant: Tenant, generation: bool) -> Admission: ...

    async def charge(self, tenant: Tenant, amount: int) -> dict[str, BucketView]: ...

    def last_views(self, tenant: Tenant) -> dict[str, BucketView]:
        """The levels last seen, without asking anyone (for a refusal that took nothing)."""
        ...

    async def close(self) -> None: ...


class MemoryQuota:
    """The tenant's own buckets, in this process."""

    async def admit(self, tenant: Tenant, generation: bool) -> Admission:
        if generation and tenant.tokens is not None and not tenant.tokens.has_any():
            return Admission(refusal_for(tenant, "tokens", self.views(tenant)["tokens"]), self.views(tenant))
        if tenant.requests is not None and not tenant.requests.try_take():
            return Admission(refusal_for(tenant, "requests", self.views(tenant)["requests"]), self.views(tenant))
        return Admission(None, self.views(tenant))

    async def charge(self, tenant: Tenant, amount: int) -> dict[str, BucketView]:
        tenant.charge_tokens(amount)
        return self.views(tenant)

    def last_views(self, tenant: Tenant) -> dict[str, BucketView]:
        return self.views(tenant)

    def views(self, tenant: Tenant) -> dict[str, BucketView]:
        views = {}
        for kind, bucket in (("requests", tenant.requests), ("tokens", tenant.tokens)):
            if bucket is not None:
                views[kind] = BucketView(bucket.capacity, bucket.level_now())
        return views

    async def close(self) -> None:
        pass


# A bucket is a hash {level, at} (at: Redis TIME in seconds); absent means full. KEYS: the requests and
# tokens buckets; ARGV: their capacities (0: no such limit), 1 when the request generates (it needs a
# positive token bucket). Returns {refused kind or "", requests level, tokens level}.
ADMIT = """
if redis.replicate_commands then redis.replicate_commands() end  -- Redis < 5: TIME, then writes
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local function level(key, capacity)
  local v = redis.call('HMGET', key, 'level', 'at')
  if not v[1] then return capacity end
  return math.min(capacity, tonumber(v[1]) + (now - tonumber(v[2])) * capacity / 60)
end
local function save(key, capacity, value)
  redis.call('HSET', key, 'level', string.format('%.6f', value), 'at', string.format('%.6f', now))
  redis.call('PEXPIRE', key, math.ceil((capacity - value) * 60000 / capacity) + 1000)
end
local requests_cap, tokens_cap = tonumber(ARGV[1]), tonumber(ARGV[2])
local requests = requests_cap > 0 and level(KEYS[1], requests_cap) or 0
local tokens = tokens_cap > 0 and level(KEYS[2], tokens_cap) or 0
if ARGV[3] == '1' and tokens_cap > 0 and tokens <= 0 then
  return {'tokens', tostring(requests), tostring(tokens)}
end
if requests_cap > 0 then
  if requests < 1 then return {'requests', tostring(requests), tostring(tokens)} end
  requests = requests - 1
  save(KEYS[1], requests_cap, requests)
end
return {'', tostring(requests), tostring(tokens)}
"""
# KEYS: the tokens bucket; ARGV: its capacity, the tokens to take (it may go below zero). Returns the level.
CHARGE = """
if redis.replicate_commands then redis.replicate_commands() end  -- Redis < 5: TIME, then writes
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local capacity, amount = tonumber(ARGV[1]), tonumber(ARGV[2])
local v = redis.call('HMGET', KEYS[1], 'level', 'at')
local value = capacity
if v[1] then value = math.min(capacity, tonumber(v[1]) + (now - tonumber(v[2])) * capacity / 60) end
value = value - amount
redis.call('HSET', KEYS[1], 'level', string.format('%.6f', value), 'at', string.format('%.6f', now))
redis.call('PEXPIRE', KEYS[1], math.ceil((capacity - value) * 60000 / capacity) + 1000)
return tostring(value)
"""


class RedisQuota:
    """Every replica's buckets in one Redis; this replica's own buckets while Redis does not answer."""

    def __init__(self, url: str, metrics: GatewayMetrics, timeout_seconds: float = 0.25,
                 retry_seconds: float = 1.0, prefix: str = "titan:tenant:") -> None:
        self.client, self.errors = connect_redis(url, timeout_seconds)
        self.prefix = prefix
        self.fallback = MemoryQuota()
        self.health = BackendHealth(metrics, "tenant_quota", "tenant quotas",
                                    "each replica enforces them on its own until it is back",
                                    retry_seconds=retry_seconds)
        self._admit = self.client.register_script(ADMIT)
        self._charge = self.client.register_script(CHARGE)
        self.seen: dict[str, dict[str, BucketView]] = {}  # by tenant: bounded by the keys file

    def last_views(self, tenant: Tenant) -> dict[str, BucketView]:
        if not self.health.up:
            return self.fallback.views(tenant)
        return self.seen.get(tenant.name) or {kind: BucketView(capacity, float(capacity))
                                              for kind, capacity in capacities(tenant).items()}

    def key(self, tenant: Tenant, kind: str) -> str:
        return f"{self.prefix}{tenant.name}:{kind}"

    async def admit(self, tenant: Tenant, generation: bool) -> Admission:
        caps = capacities(tenant)
        if not caps:
            return Admission(None)
        if not self.health.available():
            return await self.fallback.admit(tenant, generation)
        try:
            refused, requests, tokens = await self._admit(
                keys=[self.key(tenant, "requests"), self.key(tenant, "tokens")],
                args=[caps.get("requests", 0), caps.get("tokens", 0), int(generation)])
        except self.errors as error:  # TimeoutError is an OSError
            self.health.failed(error)
            return await self.fallback.admit(tenant, generation)
        self.health.succeeded()
        levels = {"requests": float(requests), "tokens": float(tokens)}
        views = {kind: BucketView(capacity, levels[kind]) for kind, capacity in caps.items()}
        self.seen[tenant.name] = views
        kind = refused.decode() if isinstance(refused, bytes) else str(refused)
        return Admission(refusal_for(tenant, kind, views[kind]) if kind else None, views)

    async def charge(self, tenant: Tenant, amount: int) -> dict[str, BucketView]:
        capacity = tenant.spec.tokens_per_minute
        if not capacity:
            return {}
        if not self.health.available():
            return await self.fallback.charge(tenant, amount)
        try:
            level = await self._charge(keys=[self.key(tenant, "tokens")], args=[capacity, amount])
        except self.errors as error:  # TimeoutError is an OSError
            self.health.failed(error)
            return await self.fallback.charge(tenant, amount)
        self.health.succeeded()
        views = {"tokens": BucketView(capacity, float(level))}
        self.seen[tenant.name] = self.seen.get(tenant.name, {}) | views
        return views

    async def close(self) -> None:
        try:
            await self.client.aclose()
        except self.errors:
            pass
