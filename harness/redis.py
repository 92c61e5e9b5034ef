"""A private `redis-server` on a free 127.0.0.1 port (Debian's package), for tests and benchmarks."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time

from harness.server import free_port


def redis_available() -> bool:
    return shutil.which("redis-server") is not None


class RedisProcess:
    """`with RedisProcess() as redis:` → `redis.url`; no persistence, LRU within `maxmemory`."""

    def __init__(self, maxmemory: str = "64mb") -> None:
        self.port = free_port()
        self.maxmemory = maxmemory
        self.process: subprocess.Popen[bytes] | None = None
        self.dir = tempfile.mkdtemp(prefix="titan-redis-")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisProcess:
        self.process = subprocess.Popen(
            ["redis-server", "--bind", "127.0.0.1", "--port", str(self.port), "--save", "", "--appendonly", "no",
             "--maxmemory", self.maxmemory, "--maxmemory-policy", "allkeys-lru", "--dir", self.dir],
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.process.returncode}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1) as conn:
                    conn.sendall(b"PING\r\n")
                    if conn.recv(16).startswith(b"+PONG"):
                        return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise TimeoutError("redis-server did not answer PING")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> RedisProcess:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
