"""Tenants from `--api-keys-file`: hashed keys, per-key models and priority class, token-bucket quotas.

The YAML file lists keys (`key`, or `key_sha256` so the file need not hold the secret) with a tenant
name and optional limits. Only SHA-256 digests are kept in memory. The ASGI gate authenticates every
protected route, refuses with 429 and OpenAI's `x-ratelimit-*` headers when a request or token bucket
is empty or `max_concurrent` requests are already running, and puts the tenant on the scope for the
handlers (model allow-list, priority class, token charges). The buckets live where the `Quota` says
(tenant_quota.py): in this process, or in Redis shared by every replica; `max_concurrent` is per replica.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from pathlib import Path
from typing import Any

import yaml
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from titan.server.errors import APIError, error_body
from titan.server.gateway_metrics import GatewayMetrics
from titan.server.tenant_quota import KINDS, BucketView, MemoryQuota, Quota, Refusal

SCOPE_KEY = "titan.tenant"
QUOTA_KEY = "titan.tenant_quota"
PRIORITY_CLASSES = ("interactive", "batch")
_FIELDS = {"key", "key_sha256", "tenant", "models", "priority", "requests_per_minute", "tokens_per_minute",
           "max_concurrent", "isolate_prefix_cache"}


class TenantsFileError(ValueError):
    pass


def key_digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True)
class TenantSpec:
    tenant: str
    key_sha256: str
    models: tuple[str, ...] | None = None  # None: every served model
    priority: str | None = None  # a floor: the tenant's requests never run above this class
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent: int | None = None
    # Its requests share prefix-cache blocks only among themselves: no other tenant can time a cache hit on
    # its prompts (nor it on theirs).
    isolate_prefix_cache: bool = False

    def __post_init__(self) -> None:
        if not self.tenant or not isinstance(self.tenant, str):
            raise TenantsFileError("every key needs a tenant name")
        if self.priority is not None and self.priority not in PRIORITY_CLASSES:
            raise TenantsFileError(f"tenant {self.tenant}: priority must be one of {', '.join(PRIORITY_CLASSES)}")
        for name in ("requests_per_minute", "tokens_per_minute", "max_concurrent"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise TenantsFileError(f"tenant {self.tenant}: {name} must be a positive integer, got {value!r}")
        if not isinstance(self.isolate_prefix_cache, bool):
            raise TenantsFileError(f"tenant {self.tenant}: isolate_prefix_cache must be true or false")
        if len(self.key_sha256) != 64 or any(c not in "0123456789abcdef" for c in self.key_sha256):
            raise TenantsFileError(f"tenant {self.tenant}: key_sha256 must be 64 lowercase hex digits")


def parse_tenants(document: Any) -> list[TenantSpec]:
    if not isinstance(document, dict) or not isinstance(document.get("keys"), list) or not document["keys"]:
        raise TenantsFileError("the file must hold a non-empty list under `keys`")
    specs: list[TenantSpec] = []
    for index, entry in enumerate(document["keys"]):
        if not isinstance(entry, dict):
            raise TenantsFileError(f"keys[{index}] must be a mapping")
        unknown = set(entry) - _FIELDS
        if unknown:
            raise TenantsFileError(f"keys[{index}]: unknown field(s) {', '.join(sorted(unknown))}")
        if ("key" in entry) == ("key_sha256" in entry):
            raise TenantsFileError(f"keys[{index}]: give exactly one of key and key_sha256")
        digest = key_digest(str(entry["key"])) if "key" in entry else str(entry["key_sha256"]).lower()
        models = entry.get("models")
        if models is not None and (not isinstance(models, list) or not all(isinstance(m, str) for m in models)):
            raise TenantsFileError(f"keys[{index}]: models must be a list of model names")
        specs.append(TenantSpec(str(entry.get("tenant") or ""), digest, tuple(models) if models is not None else None,
                                entry.get("priority"), entry.get("requests_per_minute"),
                                entry.get("tokens_per_minute"), entry.get("max_concurrent"),
                                entry.get("isolate_prefix_cache", False)))
    digests = [spec.key_sha256 for spec in specs]
    if len(set(digests)) != len(digests):
        raise TenantsFileError("the same key appears twice")
    return specs


def load_tenants(path: str | Path) -> list[TenantSpec]:
    try:
        return parse_tenants(yaml.safe_load(Path(path).read_text()))
    except yaml.YAMLError as error:
        raise TenantsFileError(f"not valid YAML: {error}") from error


class TokenBucket:
    """`capacity` tokens refilled at capacity per minute; `charge` may overdraw (tokens known only afterwards)."""

    def __init__(self, capacity: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.capacity = capacity
        self.rate = capacity / 60.0
        self.clock = clock
        self.level = float(capacity)
        self.updated = clock()

    def _refill(self) -> None:
        now = self.clock()
        self.level = min(float(self.capacity), self.level + (now - self.updated) * self.rate)
        self.updated = now

    def try_take(self, amount: float = 1.0) -> bool:
        self._refill()
        if self.level < amount:
            return False
        self.level -= amount
        return True

    def has_any(self) -> bool:
        self._refill()
        return self.level > 0

    def charge(self, amount: float) -> None:
        self._refill()
        self.level -= amount

    def remaining(self) -> int:
        self._refill()
        return max(0, math.floor(self.level))

    def level_now(self) -> float:
        self._refill()
        return self.level

    def seconds_until(self, level: float) -> float:
        self._refill()
        return max(0.0, (level - self.level) / self.rate)


def duration(seconds: float) -> str:
    """OpenAI's reset format: `1s`, `0.5s`, `6m0s`."""
    if seconds < 60:
        return f"{math.ceil(seconds * 1000) / 1000:g}s"
    minutes, rest = divmod(math.ceil(seconds), 60)
    return f"{minutes}m{rest}s"


@dataclass
class Tenant:
    spec: TenantSpec
    clock: Callable[[], float] = time.monotonic
    requests: TokenBucket | None = None
    tokens: TokenBucket | None = None
    in_flight: int = 0
    label: str = ""  # its metrics label (bounded: see TenantRegistry)

    def __post_init__(self) -> None:
        if self.spec.requests_per_minute:
            self.requests = TokenBucket(self.spec.requests_per_minute, self.clock)
        if self.spec.tokens_per_minute:
            self.tokens = TokenBucket(self.spec.tokens_per_minute, self.clock)

    @property
    def name(self) -> str:
        return self.spec.tenant

    def check_model(self, model: str) -> None:
        if self.spec.models is not None and model not in self.spec.models:
            raise APIError(HTTPStatus.FORBIDDEN, f"This key may not use the model {model!r}.", param="model",
                           code="model_not_allowed")

    def charge_tokens(self, count: int) -> None:
        if self.tokens is not None:
            self.tokens.charge(count)

@dataclass
class TenantRegistry:
    specs: list[TenantSpec]
    max_labels: int = 64  # tenants beyond this share the metrics label "other"
    clock: Callable[[], float] = time.monotonic
    by_digest: dict[str, Tenant] = field(default_factory=dict)

    def __post_init__(self) -> None:
        names: dict[str, Tenant] = {}
        for spec in self.specs:
            # Keys of one tenant share its buckets and its concurrency count.
            tenant = names.get(spec.tenant)
            if tenant is None:
                tenant = names[spec.tenant] = Tenant(spec, self.clock)
                tenant.label = spec.tenant if len(names) <= self.max_labels else "other"
            self.by_digest[spec.key_sha256] = tenant

    def authenticate(self, key: str) -> Tenant | None:
        return self.by_digest.get(key_digest(key))


def rate_headers(views: dict[str, BucketView]) -> list[tuple[bytes, bytes]]:
    """OpenAI's x-ratelimit-* triples for the buckets the tenant has, as the request saw them."""
    out: list[tuple[bytes, bytes]] = []
    for kind in KINDS:
        view = views.get(kind)
        if view is None:
            continue
        out += [(f"x-ratelimit-limit-{kind}".encode(), str(view.capacity).encode()),
                (f"x-ratelimit-remaining-{kind}".encode(), str(view.remaining()).encode()),
                (f"x-ratelimit-reset-{kind}".encode(), duration(view.seconds_until(view.capacity)).encode())]
    return out


@dataclass
class RequestQuota:
    """One admitted request's tenant and quota: its token charge, and the bucket levels its headers report."""

    tenant: Tenant
    quota: Quota
    views: dict[str, BucketView]
    pending: set[asyncio.Task[None]] = field(default_factory=set)

    async def charge(self, amount: int) -> None:
        self.views = self.views | await self.quota.charge(self.tenant, amount)

    def charge_later(self, amount: int) -> None:
        """From code that cannot wait (a stream's cleanup, a cache replay): the charge runs as a task."""
        if "tokens" in self.views:  # shown in this request's headers at once; stored when the task runs
            self.views = self.views | {"tokens": self.views["tokens"].taken(amount)}
        task = asyncio.get_running_loop().create_task(self.charge(amount))
        self.pending.add(task)  # at most one per request: bounded by the requests in flight
        task.add_done_callback(self.pending.discard)

    def headers(self) -> list[tuple[bytes, bytes]]:
        return rate_headers(self.views)


def tenant_of(scope: Scope) -> Tenant | None:
    return scope.get("state", {}).get(SCOPE_KEY)


def quota_of(scope: Scope) -> RequestQuota | None:
    return scope.get("state", {}).get(QUOTA_KEY)


class TenantGate:
    """401 without a known key on the protected routes; 429 with OpenAI's headers when over a limit."""

    def __init__(self, app: ASGIApp, registry: TenantRegistry, protect_metrics: bool = False,
                 metrics: GatewayMetrics | None = None, quota: Quota | None = None) -> None:
        self.app = app
        self.registry = registry
        protected = ("/v1", "/debug", "/tokenize", "/detokenize")
        self.prefixes = (*protected, "/metrics") if protect_metrics else protected
        self.metrics = metrics
        self.quota: Quota = quota if quota is not None else MemoryQuota()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(self.prefixes) or scope["method"] == "OPTIONS":
            await self.app(scope, receive, send)
            return
        given = next((value for name, value in scope["headers"] if name == b"authorization"), b"").decode("latin-1")
        tenant = self.registry.authenticate(given[7:]) if given.startswith("Bearer ") else None
        if tenant is None:
            message = "Missing API key." if not given else "Incorrect API key provided."
            await respond(send, HTTPStatus.UNAUTHORIZED, message, "invalid_api_key", [(b"www-authenticate", b"Bearer")])
            return
        generation = scope["method"] == "POST" and scope["path"].startswith("/v1/")
        spec = tenant.spec
        # max_concurrent counts this replica's requests (it guards this replica's batch slots): no round trip.
        if generation and spec.max_concurrent is not None and tenant.in_flight >= spec.max_concurrent:
            refusal: Refusal = (
                "concurrency_limit_exceeded", f"Tenant {tenant.name} already has {tenant.in_flight} requests "
                f"running (max_concurrent {spec.max_concurrent}).", 1.0)
            await self.refuse(send, tenant, refusal, self.quota.last_views(tenant))
            return
        # The slot is taken before the quota's round trip (Redis): requests arriving during it see it taken.
        # Taken after it, every request of a burst passed the check above while the first one awaited Redis.
        if generation:
            tenant.in_flight += 1
        try:
            admission = await self.quota.admit(tenant, generation)
            if admission.refusal is not None:
                await self.refuse(send, tenant, admission.refusal, admission.views)
                return
            request_quota = RequestQuota(tenant, self.quota, admission.views)
            state = scope.setdefault("state", {})
            state[SCOPE_KEY], state[QUOTA_KEY] = tenant, request_quota
            if self.metrics is not None:
                self.metrics.tenant_requests.labels(tenant.label).inc()

            async def with_headers(message: Message) -> None:
                if message["type"] == "http.response.start":
                    message = {**message, "headers": [*message.get("headers", []), *request_quota.headers()]}
                await send(message)

            await self.app(scope, receive, with_headers)
        finally:
            if generation:
                tenant.in_flight -= 1

    async def refuse(self, send: Send, tenant: Tenant, refusal: Refusal, views: dict[str, BucketView]) -> None:
        """A 429 naming the limit, with the tenant's rate headers and how long to wait."""
        code, message, wait = refusal
        if self.metrics is not None:
            self.metrics.tenant_limited.labels(tenant.label, code).inc()
        headers = [*rate_headers(views), (b"retry-after", str(max(1, math.ceil(wait))).encode())]
        await respond(send, HTTPStatus.TOO_MANY_REQUESTS, message, code, headers)


async def respond(send: Send, status: int, message: str, code: str, headers: list[tuple[bytes, bytes]]) -> None:
    error_type = "requests" if status == HTTPStatus.TOO_MANY_REQUESTS else "invalid_request_error"
    body = json.dumps(error_body(message, error_type, None, code)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})
