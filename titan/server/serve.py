"""`titan serve`: uvicorn on one event loop, the engine in its own thread, a draining shutdown.

Startup: the HTTP listener comes up first (so /health answers and /ready says 503 while the model
loads), the engine thread loads and warms up the model, then /ready turns 200 and the cold start
(process start → ready) is logged and exported as `titan:startup_seconds`.

SIGTERM (or the first Ctrl+C): /ready turns 503 at once and new generation requests get a 503 that
clients can retry elsewhere; everything already accepted runs to its end. Requests still running
after `--drain-timeout` are aborted (their streams end with finish_reason "abort", nothing is cut
mid-frame); then uvicorn closes the listener and idle connections and the process exits 0.
A second signal stops at once.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import uvicorn

from titan.dashboard.server_view import DashboardSettings
from titan.engine.llm_engine import LLMEngine
from titan.loader import ModelNotFoundError, resolve_model_path
from titan.server.app import build_app
from titan.server.async_engine import AsyncEngine, metrics_factory
from titan.server.gateway_setup import GatewaySetupError, build_gateway
from titan.server.http_protocol import JSONErrorH11Protocol
from titan.server.serving import ServerState

logger = logging.getLogger("titan.server")

# After the drain, uvicorn waits this long for responses still being written before closing.
GRACEFUL_CLOSE_SECONDS = 5.0


def process_start_time() -> float:
    """When this process was started (wall clock), from /proc where there is one."""
    try:
        with open("/proc/self/stat") as stat_file:
            # Field 22 (starttime, clock ticks after boot); the command name before it may hold spaces.
            fields = stat_file.read().rsplit(")", 1)[1].split()
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - int(fields[19]) / os.sysconf("SC_CLK_TCK")
        return time.time() - age
    except (OSError, ValueError, IndexError, AttributeError):
        return _IMPORTED_AT


_IMPORTED_AT = time.time()


def say(message: str) -> None:
    """Lifecycle lines are printed whatever the log level: operators need them."""
    print(f"[titan] {message}", file=sys.stderr, flush=True)


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: ours drains first (and does not re-raise the signal)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class Lifecycle:
    def __init__(self, server: _Server, state: ServerState, drain_timeout: float, started: float) -> None:
        self.server = server
        self.state = state
        self.drain_timeout = drain_timeout
        self.started = started
        self.exit_code = 0
        self.drain_task: asyncio.Task[None] | None = None

    def on_signal(self, signum: int) -> None:
        if self.drain_task is None:
            say(f"{signal.Signals(signum).name}: draining ({self.state.engine.num_in_flight} requests in flight, "
                f"at most {self.drain_timeout:g} s)")
            self.drain_task = asyncio.get_running_loop().create_task(self.drain())
        else:
            say("second signal: stopping now")
            self.state.engine.abort_all()
            self.server.should_exit = True
            self.server.force_exit = True

    async def drain(self) -> None:
        state, engine = self.state, self.state.engine
        state.draining = True  # /ready → 503, new generation requests → 503
        deadline = time.monotonic() + self.drain_timeout
        while state.busy and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        if state.busy:
            say(f"drain timeout: aborting {engine.num_in_flight} requests")
            engine.abort_all()
            abort_deadline = time.monotonic() + GRACEFUL_CLOSE_SECONDS
            # Only the engine's requests now (they end at once): a response stuck on a client that stopped
            # reading is left to uvicorn's graceful close, so the drain stays within the pod's budget.
            while engine.num_in_flight and time.monotonic() < abort_deadline:
                await asyncio.sleep(0.02)
        say("drained; shutting down")
        self.server.should_exit = True

    async def watch_engine(self) -> None:
        """Report the cold start once ready; stop the server (exit 1) if the engine dies."""
        engine = self.state.engine
        ready = asyncio.create_task(engine.ready.wait())
        done = asyncio.create_task(engine.done.wait())
        await asyncio.wait({ready, done}, return_when=asyncio.FIRST_COMPLETED)
        if engine.ready.is_set():
            cold_start = time.time() - self.started
            if engine.metrics is not None:
                engine.metrics.startup_seconds.set(cold_start)
            say(f"ready: model {self.state.model_name} loaded in {engine.load_seconds:.2f} s, warmed up in "
                f"{engine.warmup_seconds:.2f} s; cold start {cold_start:.2f} s")
            await done
        ready.cancel()
        if not self.server.should_exit:
            say(f"the engine stopped: {engine.error}")
            self.exit_code = 1
            self.server.should_exit = True


async def serve_app(server: _Server, lifecycle: Lifecycle) -> int:
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, lifecycle.on_signal, signum)
    watcher = loop.create_task(lifecycle.watch_engine())
    try:
        await server.serve()
    finally:
        watcher.cancel()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)
    if not server.started:
        return 1  # e.g. the port was taken
    return lifecycle.exit_code


def read_api_key(flag: str | None, path: str | None) -> str | None:
    """The key from --api-key, else the first line of --api-key-file, else $TITAN_API_KEY; None: no key."""
    if flag:
        return flag
    if path:
        return Path(path).read_text().splitlines()[0].strip() or None
    return os.environ.get("TITAN_API_KEY") or None


def dashboard_settings(args: argparse.Namespace) -> DashboardSettings:
    return DashboardSettings(args.dashboard_window, args.dashboard_history, args.dashboard_max_spikes)


def run_server(args: argparse.Namespace) -> int:
    started = process_start_time()
    try:
        resolve_model_path(args.model)  # fail fast on a typo, before anything listens
    except ModelNotFoundError as error:
        say(str(error))
        return 2
    config = args.engine_config
    try:
        api_key = read_api_key(args.api_key, args.api_key_file)
    except OSError as error:
        say(f"cannot read --api-key-file: {error}")
        return 2
    try:
        gateway, tenants = build_gateway(args)
    except GatewaySetupError as error:
        say(str(error))
        return 2
    engine = AsyncEngine(lambda: LLMEngine(config), warmup=args.warmup,
                         metrics_factory=metrics_factory(args.metrics_prefix))
    app = build_app(engine, args.served_model_name, api_key, args.max_request_body_bytes,
                    args.max_sequences_per_request, args.metrics_require_key, args.tool_call_parser,
                    args.enable_log_requests, gateway, tenants, dashboard_settings(args))
    uvicorn_config = uvicorn.Config(
        app, host=args.host, port=args.port, log_config=None, access_log=args.access_log,
        timeout_graceful_shutdown=GRACEFUL_CLOSE_SECONDS, lifespan="on",
        # h11 with OpenAI-shaped protocol errors; the header limit is h11's incomplete-event limit.
        http=JSONErrorH11Protocol, h11_max_incomplete_event_size=args.max_header_bytes,
    )
    logging.getLogger("uvicorn").setLevel(args.uvicorn_log_level.upper().replace("TRACE", "DEBUG"))
    if args.enable_log_requests:
        logging.getLogger("titan.requests").setLevel(logging.INFO)
    server = _Server(uvicorn_config)
    lifecycle = Lifecycle(server, app.state.server, args.drain_timeout, started)
    say(f"serving {args.model} on http://{args.host}:{args.port} (ready once /ready answers 200)")
    exit_code = asyncio.run(serve_app(server, lifecycle))
    say(f"exit {exit_code}")
    return exit_code
