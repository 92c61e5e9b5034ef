"""`titan serve` flags of tenants, caches and guardrails (no heavy imports: the CLI builds every parser)."""

from __future__ import annotations

import argparse


def add_gateway_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("tenants, caches and guardrails")
    group.add_argument("--api-keys-file", default=None,
                       help="YAML list of keys with tenants, model allow-lists, priority classes and quotas "
                            "(replaces --api-key)")
    group.add_argument("--max-tenant-labels", type=int, default=64,
                       help="tenants beyond this many share the metrics label 'other'")
    group.add_argument("--result-cache", action="store_true",
                       help="replay the stored response for a repeated deterministic request (greedy or seeded)")
    group.add_argument("--result-cache-memory", type=int, default=64 * 1024 * 1024,
                       help="bytes of responses the in-process result cache keeps (LRU)")
    group.add_argument("--result-cache-ttl", type=float, default=300.0, help="seconds a cached response lives")
    group.add_argument("--result-cache-coalesce", type=int, default=16,
                       help="identical cacheable requests that may wait for one already running instead of "
                            "computing it again (0: off)")
    group.add_argument("--result-cache-shared", action="store_true",
                       help="share cached responses across tenants (default: each tenant has its own)")
    group.add_argument("--cache-url", default=None,
                       help="redis://HOST:PORT/DB: keep both caches, and the tenants' token buckets, in Redis, "
                            "shared by replicas; bound its memory with Redis's maxmemory (allkeys-lru)")
    group.add_argument("--cache-timeout-ms", type=float, default=250.0,
                       help="a Redis operation slower than this counts as a failure (the request goes on uncached)")
    group.add_argument("--semantic-cache", action="store_true",
                       help="answer requests that opt in (titan_semantic_cache: true) from a cached response "
                            "to a prompt of similar meaning")
    group.add_argument("--semantic-cache-threshold", type=float, default=0.9,
                       help="cosine similarity a cached prompt needs to answer a new one")
    group.add_argument("--semantic-cache-entries", type=int, default=10000,
                       help="prompts the semantic index holds (oldest evicted first)")
    group.add_argument("--guardrails", default=None, help="YAML file of input and output filters")
