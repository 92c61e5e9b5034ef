"""Metrics of the HTTP-side features (tenants, caches, guardrails), in their own registry.

They live on the event loop, never on the engine thread; `/metrics` appends this registry's text to the
engine's. Label values are bounded: tenants come from the keys file (capped by `--max-tenant-labels`),
filters from the guardrails file, results and stages from fixed sets.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

PREFIX = "titan:"
LOOKUP_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.tenant_requests = Counter(PREFIX + "tenant_requests_total", "Authenticated requests by tenant.",
                                       ["tenant"], registry=r)
        self.tenant_tokens = Counter(PREFIX + "tenant_tokens_total", "Tokens charged to each tenant, by kind.",
                                     ["tenant", "kind"], registry=r)
        self.tenant_limited = Counter(PREFIX + "tenant_rate_limited_total",
                                      "Requests refused with 429 by a tenant limit, by code.", ["tenant", "code"],
                                      registry=r)
        self.cache_requests = Counter(PREFIX + "cache_requests_total",
                                      "Cache lookups, by cache and result (hit, coalesced, miss, skip).",
                                      ["cache", "result"], registry=r)
        self.cache_tokens_saved = Counter(PREFIX + "cache_tokens_saved_total",
                                          "Engine tokens (prompt + completion) not computed thanks to a hit.",
                                          ["cache"], registry=r)
        self.cache_lookup = Histogram(PREFIX + "cache_lookup_seconds", "Time of one cache lookup.", ["cache"],
                                      buckets=LOOKUP_BUCKETS, registry=r)
        self.cache_coalesce_waiting = Gauge(PREFIX + "cache_coalesce_waiting",
                                            "Requests waiting for an identical request in flight to finish.",
                                            registry=r)
        self.cache_backend_up = Gauge(PREFIX + "cache_backend_up",
                                      "1 while the cache backend answers, 0 while the server runs without it.",
                                      ["backend", "cache"], registry=r)
        self.cache_backend_errors = Counter(PREFIX + "cache_backend_errors_total",
                                            "Cache backend operations that failed (the request went on uncached).",
                                            ["backend", "cache"], registry=r)
        self.guardrail_matches = Counter(PREFIX + "guardrail_matches_total",
                                         "Guardrail filter matches, by filter, stage (input/output) and action.",
                                         ["filter", "stage", "action"], registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
