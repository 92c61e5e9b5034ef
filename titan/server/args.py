"""`titan serve` flags (kept free of heavy imports: the CLI builds every subparser on each run)."""

from __future__ import annotations

import argparse

from titan.server.gateway_args import add_gateway_arguments
from titan.server.limits import (
    DEFAULT_DRAIN_TIMEOUT_SECONDS,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_HEADER_BYTES,
    DEFAULT_MAX_SEQUENCES_PER_REQUEST,
    METRICS_PREFIXES,
    TOOL_CALL_PARSERS,
)


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 for all)")
    group.add_argument("--port", type=int, default=8000)
    group.add_argument("--served-model-name", default=None,
                       help="the model name clients send and see (default: the model file's name)")
    group.add_argument("--api-key", default=None,
                       help="require 'Authorization: Bearer KEY' on /v1/* and /debug/*; prefer --api-key-file or "
                            "TITAN_API_KEY: a key on the command line is visible to every user in `ps`")
    group.add_argument("--api-key-file", default=None,
                       help="read the API key from this file (first line)")
    group.add_argument("--metrics-require-key", action="store_true",
                       help="require the API key on /metrics too (Prometheus then needs it as a bearer token)")
    group.add_argument("--metrics-prefix", default="titan", choices=METRICS_PREFIXES,
                       help="vllm: expose the metrics vLLM also has under vLLM's names and labels (vllm:..., "
                            "model_name and engine), so dashboards and gateways written for vLLM work unchanged; "
                            "Titan-only metrics keep titan:")
    group.add_argument("--drain-timeout", type=float, default=DEFAULT_DRAIN_TIMEOUT_SECONDS,
                       help="on SIGTERM, seconds to let in-flight requests finish before aborting them")
    group.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                       help="larger request bodies get 413")
    group.add_argument("--max-header-bytes", type=int, default=DEFAULT_MAX_HEADER_BYTES,
                       help="larger request headers (all together) get 431")
    group.add_argument("--max-sequences-per-request", type=int, default=DEFAULT_MAX_SEQUENCES_PER_REQUEST,
                       help="a request may fan out into at most this many engine sequences (prompts × n); more: 400")
    group.add_argument("--tool-call-parser", default="hermes", choices=TOOL_CALL_PARSERS,
                       help="how tool_choice auto reads tool calls from the model's output: hermes "
                            "(<tool_call>{json}</tool_call>, also the fallback prompt's format) or llama3_json")
    group.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                       help="drive the largest step shapes once before reporting ready")
    group.add_argument("--enable-log-requests", action="store_true",
                       help="log each generation request's size and sampling parameters (at INFO; never the prompt)")
    group.add_argument("--uvicorn-log-level", default="warning",
                       choices=["critical", "error", "warning", "info", "debug", "trace"],
                       help="uvicorn's own log level")
    add_gateway_arguments(parser)
    group.add_argument("--access-log", action=argparse.BooleanOptionalAction, default=False,
                       help="log every HTTP request (at INFO)")
    dashboard = parser.add_argument_group("live dashboard (GET /dashboard)")
    dashboard.add_argument("--dashboard-window", type=float, default=30.0, metavar="SECONDS",
                           help="seconds of observations behind each P50/P99 the dashboard shows")
    dashboard.add_argument("--dashboard-history", type=int, default=600, metavar="N",
                           help="metric snapshots kept for it (one per poll)")
    dashboard.add_argument("--dashboard-max-spikes", type=int, default=50, metavar="N",
                           help="latency spikes it remembers and lists")
