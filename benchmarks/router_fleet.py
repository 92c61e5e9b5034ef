"""The replicas the router benchmarks start: the default model, small step shapes, one torch thread each
(`OMP_NUM_THREADS=1`: replicas share this machine's cores)."""

from __future__ import annotations

import threading

from harness.server import ServerProcess

SERVER_ARGS = ["--model", "default", "--max-num-batched-tokens", "64", "--max-num-seqs", "16",
               "--kv-cache-memory", "0.2", "--drain-timeout", "10"]
SERVER_ENV = {"OMP_NUM_THREADS": "1"}
ROUTER_ARGS = ["--health-interval", "0.25"]


def server_args(kv_cache_gib: float | None = None) -> list[str]:
    """The replicas' flags; `kv_cache_gib` replaces the fleet's KV cache size."""
    args = list(SERVER_ARGS)
    if kv_cache_gib is not None:
        args[args.index("--kv-cache-memory") + 1] = f"{kv_cache_gib:g}"
    return args


def start_servers(count: int, kv_cache_gib: float | None = None) -> list[ServerProcess]:
    """`count` replicas with `server_args(kv_cache_gib)`."""
    servers = [ServerProcess(server_args(kv_cache_gib), env=SERVER_ENV) for _ in range(count)]
    threads = [threading.Thread(target=server.start) for server in servers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return servers


def stop_servers(servers: list[ServerProcess]) -> None:
    for server in servers:
        server.stop()
        if server.log_path is not None:
            server.log_path.unlink(missing_ok=True)
