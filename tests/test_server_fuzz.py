"""schemathesis against the server's own OpenAPI document: generated requests to every route, bounded in
count, never a 5xx, and every response matches what the document declares for it. The context is short
(`--max-model-len 96`) so no generated request runs long."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from harness.server import ServerProcess

# No 5xx, and every response is one the document declares: its status, its content type, its schema.
CHECKS = "not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance"


def test_generated_requests_never_get_a_server_error(tmp_path: Path) -> None:
    cli = shutil.which("schemathesis") or str(Path(sys.executable).with_name("schemathesis"))
    if not Path(cli).exists():
        pytest.skip("schemathesis is not installed (make test installs it)")
    with ServerProcess(["--max-model-len", "96", "--max-num-seqs", "8", "--kv-cache-memory", "0.05",
                        "--no-warmup"]) as server:
        result = subprocess.run(
            [cli, "run", server.url + "/openapi.json", "--max-examples", "25", "--checks", CHECKS,
             "--phases", "examples,fuzzing", "--generation-deterministic", "--request-timeout", "120",
             "--report", "junit", "--report-dir", str(tmp_path)],
            capture_output=True, text=True, timeout=900)
        assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
        assert "Server error" not in result.stdout
        assert "Traceback" not in server.log()  # nothing unhandled reached the logs either
