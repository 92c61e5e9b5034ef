"""Run `titan serve` in a child process on a free local port (tests and benchmarks use it)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

# `python -m titan...` must find this checkout whatever the caller's working directory.
REPO_ROOT = Path(__file__).resolve().parents[1]


# Ports free_port has handed out in this process. A server binds its port only when it starts, so two
# chosen before either started could be the same one (the kernel may hand a just-released port out again):
# a fleet of three then had two servers on one URL, and the router refused the duplicate backend.
_HANDED_OUT: set[int] = set()


def free_port(attempts: int = 1000) -> int:
    """A local port nothing listens on now and that this process has not handed out before."""
    for _ in range(attempts):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind(("127.0.0.1", 0))
            port = int(probe.getsockname()[1])
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port
    raise RuntimeError(f"no local port this process has not used after {attempts} tries")


class ServerProcess:
    """`with ServerProcess(["--model", "default"]) as server:` starts, waits for /ready, then stops."""

    def __init__(self, args: list[str], ready_timeout: float = 300.0, env: dict[str, str] | None = None) -> None:
        self.args = args
        self.ready_timeout = ready_timeout
        self.env = {**os.environ, **(env or {})}
        self.port = free_port()
        self.host = "127.0.0.1"
        self.process: subprocess.Popen[bytes] | None = None
        self.log_path: Path | None = None
        self.ready_seconds = 0.0  # spawn → /ready 200, measured from outside
        # (/ready, /health) statuses seen while waiting: the listener is up before the model is ready.
        self.startup_statuses: set[tuple[int | None, int | None]] = set()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> ServerProcess:
        log = tempfile.NamedTemporaryFile(prefix="titan-serve-", suffix=".log", delete=False)  # noqa: SIM115
        self.log_path = Path(log.name)
        command = [sys.executable, "-m", "titan.entrypoints.cli", "serve", "--host", self.host,
                   "--port", str(self.port), *self.args]
        started = time.perf_counter()
        self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=self.env, cwd=REPO_ROOT)
        log.close()
        deadline = started + self.ready_timeout
        while time.perf_counter() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"titan serve exited with {self.process.returncode}:\n{self.log()}")
            ready = self.get_status("/ready")
            if ready == 200:
                self.ready_seconds = time.perf_counter() - started
                return self
            if ready is not None:
                self.startup_statuses.add((ready, self.get_status("/health")))
            time.sleep(0.1)
        self.stop()
        raise TimeoutError(f"titan serve was not ready after {self.ready_timeout} s:\n{self.log()}")

    def get_status(self, path: str) -> int | None:
        try:
            with urllib.request.urlopen(self.url + path, timeout=2) as response:
                return int(response.status)
        except urllib.error.HTTPError as error:
            return int(error.code)
        except OSError:
            return None

    def metric_samples(self, name: str) -> list[Sample]:
        """Every sample of the metric `name` (e.g. `titan:admission_rejections_total`) on /metrics now."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as response:
            text = response.read().decode()
        return [sample for family in text_string_to_metric_families(text) for sample in family.samples
                if sample.name == name]

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path and self.log_path.exists() else ""

    def terminate(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)

    def wait(self, timeout: float) -> int:
        assert self.process is not None
        return self.process.wait(timeout)

    def stop(self, timeout: float = 30.0) -> int | None:
        if self.process is None:
            return None
        self.terminate()
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()

    def rss_bytes(self) -> int:
        """Resident memory of the server process (Linux)."""
        assert self.process is not None
        with open(f"/proc/{self.process.pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        return 0

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
        if self.log_path is not None:
            self.log_path.unlink(missing_ok=True)
