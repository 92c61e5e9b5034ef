"""The API key from a file protects /v1/* and /debug/*, and /metrics with --metrics-require-key."""

from __future__ import annotations

from pathlib import Path

import httpx

from harness.server import ServerProcess

KEY = "sk-from-a-file"


def test_key_file_and_metrics_require_key(tmp_path: Path) -> None:
    key_file = tmp_path / "key"
    key_file.write_text(KEY + "\n")
    args = ["--api-key-file", str(key_file), "--metrics-require-key", "--max-num-seqs", "4",
            "--kv-cache-memory", "0.05", "--no-warmup", "--enable-log-requests"]
    with ServerProcess(args) as server:
        assert KEY not in " ".join(server.args)  # nothing on the command line shows the key
        authorized = {"Authorization": f"Bearer {KEY}"}
        for path in ("/v1/models", "/debug/steps", "/metrics"):
            assert httpx.get(server.url + path, timeout=30).status_code == 401, path
            assert httpx.get(server.url + path, headers=authorized, timeout=30).status_code == 200, path
        for path in ("/health", "/ready", "/version"):  # probes need no key
            assert httpx.get(server.url + path, timeout=30).status_code == 200, path
        wrong = httpx.get(server.url + "/metrics", headers={"Authorization": "Bearer nope"}, timeout=30)
        assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
        secret_prompt = "my secret prompt"
        reply = httpx.post(server.url + "/v1/completions", headers=authorized, timeout=120,
                           json={"prompt": secret_prompt, "max_tokens": 2, "temperature": 0})
        assert reply.status_code == 200
        # --enable-log-requests: the request's shape is logged, its text never.
        log = server.log()
        assert f"request {reply.json()['id']}: 1 choice(s)" in log and "max_tokens=2" in log
        assert secret_prompt not in log
