"""The API key from a file protects /v1/* and /debug/*, and /metrics with --metrics-require-key."""

from __future__ import annotations

from pathlib import Path

import httpx

from harness.server import ServerProcess

KEY = "sk-from-a-file"


def test_key_file_and_metrics_require_key(tmp_path: Path) -> None:
    key_file = tmp_path / "key"
    key_file.write_text(KEY + "\n")
    defaults = tmp_path / "generation_config.json"
    defaults.write_text('{"temperature": 0.0, "top_k": 1, "max_new_tokens": 99}')
    args = ["--api-key-file", str(key_file), "--metrics-require-key", "--max-num-seqs", "4",
            "--kv-cache-memory", "0.05", "--no-warmup", "--enable-log-requests", "--generation-config", str(defaults)]
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
        # --generation-config: a request without temperature gets the file's (greedy); one with it, its own.
        def text(**fields: object) -> str:
            body = {"prompt": "Once upon a time", "max_tokens": 8, "ignore_eos": True, **fields}
            return httpx.post(server.url + "/v1/completions", headers=authorized, json=body,
                              timeout=120).json()["choices"][0]["text"]

        greedy = text(temperature=0)
        assert text() == text() == greedy
        sampled = {text(temperature=1.5, top_k=0, seed=seed) for seed in range(4)}
        assert len(sampled) > 1


def test_sampling_defaults_sources(tmp_path: Path) -> None:
    from titan.engine.llm_engine import sampling_defaults

    (tmp_path / "generation_config.json").write_text('{"temperature": 0.6, "top_p": 0.9, "eos_token_id": 2}')
    assert sampling_defaults("auto", tmp_path) == {"temperature": 0.6, "top_p": 0.9}
    assert sampling_defaults("none", tmp_path) == {}
    assert sampling_defaults("auto", tmp_path / "elsewhere") == {}
