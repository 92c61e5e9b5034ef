"""Run the router under uvicorn.

SIGTERM (or Ctrl+C): uvicorn stops accepting connections and lets open requests (streams included)
finish for up to `drain_timeout` seconds, then closes the rest and the process exits 0. A second signal
stops at once. The router holds no state worth draining beyond that.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Iterator

import uvicorn

from titan.router.app import RouterApp
from titan.router.config import RouterConfig


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling, which re-raises the signal at exit (exit status -15)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def on_signal(server: _Server) -> None:
    if server.should_exit:
        server.force_exit = True
    server.should_exit = True


async def serve(server: _Server) -> None:
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, server)
    try:
        await server.serve()
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)


def run_router(config: RouterConfig) -> int:
    # httpx logs every backend request at INFO (health polls included): far too much for a router's log.
    for noisy in ("httpx", "httpcore"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, logging.getLogger().level))
    app = RouterApp(config)
    uvicorn_config = uvicorn.Config(
        app, host=config.host, port=config.port, log_config=None, access_log=config.access_log, lifespan="on",
        # The backend's own Date and Server headers pass through; uvicorn must not add a second pair.
        server_header=False, date_header=False, timeout_graceful_shutdown=max(1, round(config.drain_timeout)),
        # The peer as it is: uvicorn's X-Forwarded-For rewrite of the client (for 127.0.0.1 peers) made the
        # router append the last hop a second time and lose its real peer.
        proxy_headers=False,
    )
    server = _Server(uvicorn_config)
    names = ", ".join(f"{spec.name}={spec.url}" for spec in config.backends) or "none static"
    discovered = "".join(f", discovering {target} every {config.discover_interval:g} s"
                         for target in config.discover_dns)
    print(f"[titan] router on http://{config.host}:{config.port}, policy {config.policy}, backends: {names}"
          f"{discovered}", file=sys.stderr, flush=True)
    asyncio.run(serve(server))
    return 0 if server.started else 1
