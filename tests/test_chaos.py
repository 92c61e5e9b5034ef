"""`titan chaos`: its fault-injecting proxy on real sockets, and a short subset of the scenarios end to end
(the full suite is a benchmark: `titan chaos`, table in the README)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
from pathlib import Path

from titan.chaos.cli import table
from titan.chaos.tcp_proxy import FaultProxy

REPO = Path(__file__).resolve().parents[1]


def echo_server() -> tuple[socket.socket, int]:
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                connection, _ = listener.accept()
            except OSError:
                return
            with connection:
                while data := connection.recv(4096):
                    connection.sendall(data)

    threading.Thread(target=serve, daemon=True).start()
    return listener, int(listener.getsockname()[1])


def test_fault_proxy_passes_drops_and_heals() -> None:
    listener, port = echo_server()
    proxy = FaultProxy("127.0.0.1", port).start()
    try:
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=30) as client:
            client.sendall(b"hello")
            assert client.recv(5) == b"hello"
        proxy.set_faults(drop=1.0)
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=30) as client:
            assert client.recv(5) == b""  # closed at once: a dropped connection
        proxy.set_faults(delay=0.01)
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=30) as client:
            client.sendall(b"again")
            assert client.recv(5) == b"again"
        assert proxy.dropped >= 1
    finally:
        proxy.stop()
        listener.close()


def test_table_has_the_verdict_columns() -> None:
    row = {"scenario": "x", "sent": 3, "completed": 2, "failed_before_first_byte": 1, "failed_mid_stream": 0,
           "lost": 0, "recovery_s": None, "p99_before_ms": 12.5, "p99_during_ms": None}
    text = table([row])
    assert "failed before first byte" in text and "lost" in text and "| x | 3 | 2 | 1 | 0 | 0 | — | 12.5 / — |" in text


def test_chaos_subset_loses_nothing(tmp_path: Path) -> None:
    output = tmp_path / "chaos.json"
    command = [sys.executable, "-m", "titan.entrypoints.cli", "chaos", "--scenario", "replica-freeze",
               "--scenario", "step-failure", "--requests", "9", "--output", str(output)]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = {row["scenario"]: row for row in json.loads(output.read_text())}
    assert set(rows) == {"replica-freeze", "step-failure"}
    for row in rows.values():
        assert row["lost"] == 0 and row["sent"] == 9 and row["ok"]
        assert row["completed"] + row["failed_before_first_byte"] + row["failed_mid_stream"] == 9
    assert rows["replica-freeze"]["recovery_s"] is not None  # the frozen backend came back into the pool
    assert "lost requests: 0" in done.stdout
