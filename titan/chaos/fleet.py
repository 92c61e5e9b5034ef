"""Local processes for the chaos suite: `titan serve` replicas and a `titan router`, all on 127.0.0.1."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class Proc:
    """One child process of the titan CLI; `ready` is the path that answers 200 once it serves."""

    def __init__(self, command: list[str], env: dict[str, str] | None = None, ready_path: str = "/ready",
                 port: int | None = None) -> None:
        self.port = port or free_port()
        self.command = command
        self.env = {**os.environ, **(env or {})}
        self.ready_path = ready_path
        self.process: subprocess.Popen[bytes] | None = None
        self.log_path: Path | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def spawn(self) -> Proc:
        log = tempfile.NamedTemporaryFile(prefix="titan-chaos-", suffix=".log", delete=False)  # noqa: SIM115
        self.log_path = Path(log.name)
        argv = [sys.executable, "-m", "titan.entrypoints.cli", *self.command, "--host", "127.0.0.1",
                "--port", str(self.port)]
        self.process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=self.env)
        log.close()
        return self

    def wait_ready(self, timeout: float = 300.0, check: str | None = None) -> float:
        """Seconds until `ready_path` answered 200 (and `check`, if given, is in its body)."""
        started = time.monotonic()
        while time.monotonic() - started < timeout:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"{self.command[0]} exited with {self.process.returncode}:\n{self.log()}")
            try:
                reply = httpx.get(self.url + self.ready_path, timeout=2)
                if reply.status_code == 200 and (check is None or check in reply.text):
                    return time.monotonic() - started
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"{self.command[0]} not ready after {timeout} s:\n{self.log()}")

    def signal(self, signum: int) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signum)

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        if self.process is not None:
            self.process.wait(30)

    def stop(self) -> None:
        if self.process is None:
            return
        self.signal(signal.SIGCONT)  # a frozen process cannot handle SIGTERM
        self.signal(signal.SIGTERM)
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.kill()
        if self.log_path is not None:
            self.log_path.unlink(missing_ok=True)

    def rss_bytes(self) -> int:
        assert self.process is not None
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return 0

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-20000:] if self.log_path and self.log_path.exists() else ""


def replica(server_args: list[str], env: dict[str, str] | None = None, port: int | None = None) -> Proc:
    return Proc(["serve", "--model", "default", *server_args], {"OMP_NUM_THREADS": "1", **(env or {})}, port=port)


def router(backend_urls: list[str], router_args: list[str]) -> Proc:
    command = ["router", *router_args]
    for url in backend_urls:
        command += ["--backend", url]
    return Proc(command, ready_path="/ready")
