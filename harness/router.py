"""Run `titan router` in a child process on a free local port (tests and benchmarks use it)."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from harness.server import REPO_ROOT, free_port


class RouterProcess:
    """`with RouterProcess([url, ...], ["--policy", "round-robin"]) as router:` starts it, waits until it has
    `min_ready` backends in its pool, and stops it on exit."""

    def __init__(self, backends: list[str], args: list[str] | None = None, min_ready: int | None = None,
                 ready_timeout: float = 60.0) -> None:
        self.backends = backends
        self.args = args or []
        self.min_ready = len(backends) if min_ready is None else min_ready
        self.ready_timeout = ready_timeout
        self.host = "127.0.0.1"
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None
        self.log_path: Path | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> RouterProcess:
        log = tempfile.NamedTemporaryFile(prefix="titan-router-", suffix=".log", delete=False)  # noqa: SIM115
        self.log_path = Path(log.name)
        command = [sys.executable, "-m", "titan.entrypoints.cli", "--log-level", "INFO", "router",
                   "--host", self.host, "--port", str(self.port), *self.args]
        for backend in self.backends:
            command += ["--backend", backend]
        self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT)
        log.close()
        deadline = time.monotonic() + self.ready_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"titan router exited with {self.process.returncode}:\n{self.log()}")
            if self.num_ready() >= self.min_ready:
                return self
            time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"titan router had not {self.min_ready} ready backends after {self.ready_timeout} s:"
                           f"\n{self.log()}")

    def num_ready(self) -> int:
        import json

        try:
            with urllib.request.urlopen(self.url + "/ready", timeout=2) as response:
                body = response.read()
        except urllib.error.HTTPError as error:
            body = error.read()
        except OSError:
            return 0
        try:
            return sum(1 for backend in json.loads(body)["backends"] if backend["ready"])
        except (ValueError, KeyError, TypeError):
            return 0

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path and self.log_path.exists() else ""

    def stop(self, timeout: float = 15.0) -> int | None:
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.terminate()
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()

    def __enter__(self) -> RouterProcess:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
        if self.log_path is not None:
            self.log_path.unlink(missing_ok=True)
