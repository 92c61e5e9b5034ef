"""`titan router` flags and handler (argparse only at import; the handler loads the rest).

Every flag defaults to None so that a `--config` file's value stands unless the flag is given.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from titan.router.config import ADDRESS_FAMILIES, DEFAULT_PORT, POLICIES, RouterConfig

DEFAULTS = RouterConfig()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = ("OpenAI-compatible gateway in front of several Titan (or other OpenAI-compatible) "
                          "servers: health-checked pool, load- or prefix-aware routing, one retry before the "
                          "first byte, streaming passed through.")
    parser.add_argument("--config", default=None, help="YAML file of settings (the flags' names with "
                        "underscores, plus 'backends'); flags override it")
    parser.add_argument("--backend", action="append", default=None, dest="backends", metavar="URL",
                        help="a backend's root URL, e.g. http://10.0.0.5:8000 (repeatable)")
    parser.add_argument("--host", default=None, help=f"address to listen on (default {DEFAULTS.host})")
    parser.add_argument("--port", type=int, default=None, help=f"(default {DEFAULT_PORT})")
    parser.add_argument("--policy", choices=POLICIES, default=None, help=f"(default {DEFAULTS.policy})")
    discovery = parser.add_argument_group("discovery (e.g. an autoscaled Deployment's pods behind a headless Service)")
    discovery.add_argument("--discover-dns", action="append", default=None, dest="discover_dns",
                           metavar="[POOL=]HOST:PORT",
                           help="a DNS name whose A/AAAA records are backends (plain http on PORT), re-resolved "
                                "periodically: addresses join and leave the pool as they come and go "
                                "(repeatable; combines with --backend); with model pools, POOL (primary or "
                                "fallback, default primary) is the one its backends join")
    discovery.add_argument("--discover-interval", type=float, default=None, metavar="SECONDS",
                           help=f"seconds between resolutions (default {DEFAULTS.discover_interval:g})")
    discovery.add_argument("--discover-family", choices=ADDRESS_FAMILIES, default=None,
                           help="which addresses to take, e.g. ipv4 for servers listening on 0.0.0.0 "
                                f"(default {DEFAULTS.discover_family})")
    score = parser.add_argument_group("score (the default policy: expected prefix-cache hit and load)")
    for name, what in (("prefix", "expected prefix-cache hit (share of the prompt's blocks recently sent there)"),
                       ("ttft", "predicted TTFT (queued prefill + this prompt's uncached part, at the scraped "
                                "step cost), relative to the best candidate's"),
                       ("queue", "load: outstanding + scraped waiting, relative to the busiest candidate"),
                       ("kv", "free KV cache (scraped)")):
        score.add_argument(f"--score-{name}-weight", type=float, default=None,
                           help=f"weight of the {what} (default {getattr(DEFAULTS, f'score_{name}_weight'):g})")
    score.add_argument("--score-prefix-chars", type=int, default=None,
                       help="prompt characters hashed into --chunk-chars blocks (default "
                            f"{DEFAULTS.score_prefix_chars})")
    score.add_argument("--score-blocks-per-backend", type=int, default=None,
                       help="block hashes remembered per backend, least recently sent dropped first "
                            f"(default {DEFAULTS.score_blocks_per_backend})")
    affinity = parser.add_argument_group("prefix-affinity")
    affinity.add_argument("--prefix-chars", type=int, default=None,
                          help=f"characters of the prompt that make its key (default {DEFAULTS.prefix_chars}); "
                               "at most the length of your shared prompt prefix")
    affinity.add_argument("--chunk-chars", type=int, default=None,
                          help=f"the key covers whole chunks of this many characters (default "
                               f"{DEFAULTS.chunk_chars})")
    affinity.add_argument("--load-factor", type=float, default=None,
                          help="a backend takes its keys until it holds this multiple of the mean outstanding "
                               f"requests (default {DEFAULTS.load_factor})")
    affinity.add_argument("--min-load", type=int, default=None,
                          help="... or fewer than this many, whichever is more (default "
                               f"{DEFAULTS.min_load})")
    health = parser.add_argument_group("health and timeouts")
    health.add_argument("--health-interval", type=float, default=None,
                        help=f"seconds between polls of each backend (default {DEFAULTS.health_interval:g})")
    health.add_argument("--health-timeout", type=float, default=None,
                        help=f"(default {DEFAULTS.health_timeout:g})")
    health.add_argument("--connect-timeout", type=float, default=None,
                        help=f"(default {DEFAULTS.connect_timeout:g})")
    health.add_argument("--read-timeout", type=float, default=None,
                        help="longest silence from a backend, e.g. a whole non-streamed generation "
                             f"(default {DEFAULTS.read_timeout:g})")
    health.add_argument("--retries", type=int, default=None,
                        help=f"other backends tried after a failure before the first byte (default "
                             f"{DEFAULTS.retries})")
    dashboard = parser.add_argument_group("live dashboard (GET /dashboard)")
    dashboard.add_argument("--debug-api-key-file", default=None, metavar="PATH",
                           help="require 'Authorization: Bearer KEY' (the file's first line) on /debug/*, the "
                                "dashboard's data (default: $TITAN_ROUTER_DEBUG_KEY if set, else open)")
    dashboard.add_argument("--dashboard-window", type=float, default=None, metavar="SECONDS",
                           help=f"seconds behind each P50/P99 (default {DEFAULTS.dashboard_window:g})")
    dashboard.add_argument("--dashboard-history", type=int, default=None, metavar="N",
                           help=f"metric snapshots kept, one per poll (default {DEFAULTS.dashboard_history})")
    dashboard.add_argument("--dashboard-max-spikes", type=int, default=None, metavar="N",
                           help=f"spikes remembered (default {DEFAULTS.dashboard_max_spikes})")
    pools = parser.add_argument_group("model pools: degrade to a faster model under load")
    pools.add_argument("--pool", action="append", default=None, dest="pools", metavar="NAME=URL[,URL...]",
                       help="backends of the primary or the fallback pool (repeatable; --backend URLs join "
                            "primary; --discover-dns fallback=HOST:PORT discovers a pool's backends); batch requests, "
                            "and interactive ones sending 'X-Titan-Allow-Degrade: true', "
                            "go to the fallback when the primary's predicted TTFT is over their SLO")
    pools.add_argument("--interactive-ttft-slo-ms", type=float, default=None,
                       help=f"(default {DEFAULTS.interactive_ttft_slo_ms:g})")
    pools.add_argument("--batch-ttft-slo-ms", type=float, default=None,
                       help="for requests sent with 'X-Titan-Priority: batch' (default "
                            f"{DEFAULTS.batch_ttft_slo_ms:g})")
    server = parser.add_argument_group("server")
    server.add_argument("--max-request-body-bytes", type=int, default=None)
    server.add_argument("--drain-timeout", type=float, default=None,
                        help=f"on SIGTERM, seconds open requests get to finish (default {DEFAULTS.drain_timeout:g})")
    server.add_argument("--access-log", action=argparse.BooleanOptionalAction, default=None)
    parser.set_defaults(handler=run_command)


def flag_settings(args: argparse.Namespace) -> dict[str, Any]:
    skip = {"config", "handler", "command", "log_level"}
    return {name: value for name, value in vars(args).items() if name not in skip}


def run_command(args: argparse.Namespace) -> int:
    from titan.router.config import ConfigError, build_config, load_yaml

    try:
        file_settings = load_yaml(args.config) if args.config else {}
        config = build_config(file_settings, flag_settings(args))
    except ConfigError as error:
        print(f"titan router: {error}", file=sys.stderr)
        return 2
    from titan.router.serve import run_router

    return run_router(config)
