"""SIGTERM drains: readiness drops at once, accepted requests finish (or end with "abort" at the drain
timeout, never cut mid-stream), new ones get a clean 503, and the process exits 0."""

from __future__ import annotations

import json
import threading
import time

import httpx

from harness.server import ServerProcess

DRAIN_TIMEOUT = 8.0
# Outlasts the drain timeout by counts, not by speed: 7,000 tokens take over 20 s on any CPU we know of,
# and the 0.4 GiB cache (~9,000 tokens) holds them.
LONG_TOKENS = 7000
# Tiny step shapes keep warm-up short; this server only needs a few sequences.
SERVER_ARGS = ["--model", "default", "--max-num-batched-tokens", "64", "--max-num-seqs", "8",
               "--kv-cache-memory", "0.4", "--drain-timeout", str(DRAIN_TIMEOUT)]


class StreamReader(threading.Thread):
    """Streams one completion over SSE and records what arrived."""

    def __init__(self, url: str, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.body = {"prompt": "Tell me a story about a lighthouse.", "max_tokens": max_tokens, "stream": True,
                     "ignore_eos": True, "stream_options": {"include_usage": True}}
        self.first_token = threading.Event()
        self.text = ""
        self.finish_reason: str | None = None
        self.completion_tokens: int | None = None
        self.done = False  # saw data: [DONE]
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.url + "/v1/completions", json=self.body, timeout=120) as response:
                assert response.status_code == 200, response.read()
                for line in response.iter_lines():
                    if line == "data: [DONE]":
                        self.done = True
                    elif line.startswith("data: "):
                        chunk = json.loads(line[6:])
                        if chunk.get("usage"):
                            self.completion_tokens = chunk["usage"]["completion_tokens"]
                        for choice in chunk["choices"]:
                            self.text += choice["text"]
                            self.finish_reason = choice["finish_reason"] or self.finish_reason
                            if choice["text"]:
                                self.first_token.set()
        except BaseException as error:  # noqa: BLE001 - reported by the test
            self.error = error
            self.first_token.set()


def test_sigterm_drains_then_exits_zero() -> None:
    server = ServerProcess(SERVER_ARGS).start()
    try:
        short = [StreamReader(server.url, max_tokens=4) for _ in range(2)]
        long = StreamReader(server.url, max_tokens=LONG_TOKENS)
        readers = [*short, long]
        for reader in readers:
            reader.start()
        for reader in readers:
            assert reader.first_token.wait(60), "a stream never started"
            assert reader.error is None, reader.error

        signalled = time.monotonic()
        server.terminate()
        # Readiness drops at once; liveness holds while draining.
        polls = 0
        while server.get_status("/ready") != 503:  # bounded by count: a loaded machine answers slower
            polls += 1
            assert polls < 500, "/ready did not turn 503 after SIGTERM"
            time.sleep(0.02)
        assert server.get_status("/health") == 200
        # Newcomers are turned away cleanly (retryable), not dropped.
        rejected = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
        assert rejected.status_code == 503 and rejected.json()["error"]["code"] == "shutting_down"

        assert server.wait(DRAIN_TIMEOUT + 30) == 0
        exited = time.monotonic() - signalled
        for reader in readers:
            reader.join(10)
            assert reader.error is None, reader.error
            assert reader.done, "a stream was cut off before data: [DONE]"
        for reader in short:  # accepted before SIGTERM: finished in full
            assert reader.finish_reason == "length" and reader.completion_tokens == 4
        # Still running at the drain timeout: ended cleanly with finish_reason "abort".
        assert long.finish_reason == "abort" and 0 < long.completion_tokens < LONG_TOKENS
        # It waited for the drain timeout (never less: the long request was still running), then aborted.
        assert exited >= DRAIN_TIMEOUT - 0.5
        log = server.log()
        assert "draining" in log and "aborting 1 requests" in log
    finally:
        server.stop()
        if server.log_path is not None:
            server.log_path.unlink(missing_ok=True)
