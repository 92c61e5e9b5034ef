"""A fault-injecting TCP proxy on 127.0.0.1 (the slow-link scenario): added latency and dropped connections
between the router and one backend, switchable while traffic flows.

It runs its own event loop in a daemon thread. `delay` is added before each chunk is passed on, in both
directions; `drop` is the share of new connections closed at once, and of open ones cut after their next
chunk (a link that fails mid-stream). Its own open connections are bounded by `max_connections`.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import threading
from dataclasses import dataclass


@dataclass
class LinkFaults:
    delay: float = 0.0  # seconds added per chunk
    drop: float = 0.0  # 0..1


class FaultProxy:
    def __init__(self, target_host: str, target_port: int, max_connections: int = 256, seed: int = 0) -> None:
        self.target = (target_host, target_port)
        self.faults = LinkFaults()
        self.max_connections = max_connections
        self.random = random.Random(seed)
        self.open_connections = 0
        self.dropped = 0
        self.loop = asyncio.new_event_loop()
        self.server: asyncio.Server | None = None
        probe = socket.socket()
        probe.bind(("127.0.0.1", 0))
        self.port = int(probe.getsockname()[1])
        probe.close()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="fault-proxy")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> FaultProxy:
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self.listen(), self.loop).result(10)
        return self

    def set_faults(self, delay: float = 0.0, drop: float = 0.0) -> None:
        self.loop.call_soon_threadsafe(setattr, self, "faults", LinkFaults(delay, drop))

    async def listen(self) -> None:
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", self.port)

    def should_drop(self) -> bool:
        return self.faults.drop > 0 and self.random.random() < self.faults.drop

    async def handle(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        if self.open_connections >= self.max_connections or self.should_drop():
            self.dropped += 1
            client_writer.close()
            return
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(*self.target)
        except OSError:
            client_writer.close()
            return
        self.open_connections += 1
        try:
            await asyncio.gather(self.pipe(client_reader, upstream_writer), self.pipe(upstream_reader, client_writer))
        finally:
            self.open_connections -= 1
            for writer in (client_writer, upstream_writer):
                writer.close()

    async def pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while chunk := await reader.read(65536):
                if self.faults.delay:
                    await asyncio.sleep(self.faults.delay)
                if self.should_drop():
                    self.dropped += 1
                    break
                writer.write(chunk)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            with contextlib.suppress(ConnectionError, OSError, RuntimeError):
                writer.close()

    def stop(self) -> None:
        async def close() -> None:
            if self.server is not None:
                self.server.close()

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(close(), self.loop).result(5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
