"""Turn `titan serve`'s gateway flags into a `Gateway` and a `TenantRegistry` (errors: a usage message)."""

from __future__ import annotations

import argparse

from titan.server.cache_store import CacheStore, MemoryStore, RedisStore
from titan.server.coalesce import Flights
from titan.server.gateway import Gateway
from titan.server.gateway_metrics import GatewayMetrics
from titan.server.guardrails import GuardrailsConfigError, load_guardrails
from titan.server.tenant_quota import Quota, RedisQuota
from titan.server.tenants import TenantRegistry, TenantsFileError, load_tenants


class GatewaySetupError(ValueError):
    pass


def build_gateway(args: argparse.Namespace) -> tuple[Gateway | None, TenantRegistry | None]:
    metrics = GatewayMetrics()
    tenants = None
    if args.api_keys_file:
        if args.api_key or args.api_key_file:
            raise GatewaySetupError("give --api-keys-file or --api-key/--api-key-file, not both")
        try:
            tenants = TenantRegistry(load_tenants(args.api_keys_file), max_labels=args.max_tenant_labels)
        except (OSError, TenantsFileError) as error:
            raise GatewaySetupError(f"--api-keys-file: {error}") from error
    for name in ("result_cache_memory", "result_cache_ttl", "cache_timeout_ms", "semantic_cache_entries",
                 "max_tenant_labels"):
        if getattr(args, name) <= 0:
            raise GatewaySetupError(f"--{name.replace('_', '-')} must be positive")
    if args.result_cache_coalesce < 0:
        raise GatewaySetupError("--result-cache-coalesce must be 0 (off) or positive")
    if not 0.0 < args.semantic_cache_threshold <= 1.0:
        raise GatewaySetupError("--semantic-cache-threshold must be in (0, 1]")
    if args.cache_url and not args.cache_url.startswith(("redis://", "rediss://", "unix://")):
        raise GatewaySetupError("--cache-url must be a redis://, rediss:// or unix:// URL")
    guardrails = None
    if args.guardrails:
        try:
            guardrails = load_guardrails(args.guardrails)
        except (OSError, GuardrailsConfigError) as error:
            raise GatewaySetupError(f"--guardrails: {error}") from error

    def new_store(cache: str) -> CacheStore:
        if args.cache_url:
            return RedisStore(args.cache_url, metrics, cache, prefix=f"titan:{cache}:",
                              timeout_seconds=args.cache_timeout_ms / 1000)
        return MemoryStore(args.result_cache_memory)

    store = new_store("result") if args.result_cache else None
    flights = Flights(args.result_cache_coalesce, metrics.cache_coalesce_waiting) if store is not None else None
    semantic = None
    if args.semantic_cache:
        from titan.server.semantic_cache import SemanticCache  # loads the embedding model's libraries

        semantic = SemanticCache(metrics, new_store("semantic"), args.semantic_cache_threshold,
                                 args.semantic_cache_entries, args.result_cache_ttl, redis_url=args.cache_url)
    if tenants is None and store is None and guardrails is None and semantic is None:
        return None, None  # nothing on: requests take the plain path
    quota: Quota | None = None
    if tenants is not None and args.cache_url:  # every replica draws on the same buckets
        quota = RedisQuota(args.cache_url, metrics, timeout_seconds=args.cache_timeout_ms / 1000)
    gateway = Gateway(metrics, store, args.result_cache_ttl, args.result_cache_shared, guardrails, semantic, quota,
                      flights)
    return gateway, tenants
