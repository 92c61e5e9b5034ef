"""The chaos suite's bounded client: `clients` closed-loop workers send streamed completions until
`requests` went out, and every request ends in exactly one outcome.

- completed: the stream ended with `[DONE]` and no error event
- failed before first byte: an HTTP error status, or the connection failed before any event arrived
- failed mid-stream: an OpenAI error event arrived (the client was told)
- lost: anything else — the stream ended or broke without `[DONE]` or an error event, or the client's own
  ceiling (`timeout`, far above any healthy request) ran out. Must be 0.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

OUTCOMES = ("completed", "failed_before_first_byte", "failed_mid_stream", "lost")


@dataclass
class RequestRecord:
    number: int
    started: float
    ended: float = 0.0
    ttft: float | None = None
    outcome: str = "lost"
    detail: str = ""


@dataclass
class LoadResult:
    records: list[RequestRecord] = field(default_factory=list)

    def count(self, outcome: str) -> int:
        return sum(1 for record in self.records if record.outcome == outcome)


def one_request(client: httpx.Client, url: str, number: int, max_tokens: int, timeout: float) -> RequestRecord:
    record = RequestRecord(number, time.monotonic())
    body = {"prompt": f"Request {number}: tell me about the sea.", "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True}
    got_event = False
    try:
        with client.stream("POST", url + "/v1/completions", json=body, timeout=timeout) as reply:
            if reply.status_code != 200:
                reply.read()
                record.outcome, record.detail = "failed_before_first_byte", f"HTTP {reply.status_code}"
                return record
            for line in reply.iter_lines():
                if not line.startswith("data: "):
                    continue
                got_event = True
                if line == "data: [DONE]":
                    record.outcome = "completed"
                    break
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    record.outcome, record.detail = "failed_mid_stream", str(chunk["error"].get("message"))[:200]
                    break
                if record.ttft is None and chunk.get("choices") and chunk["choices"][0].get("text"):
                    record.ttft = time.monotonic() - record.started
    except httpx.TimeoutException as error:
        record.outcome, record.detail = "lost", f"client ceiling reached: {error!r}"
    except httpx.HTTPError as error:
        record.outcome = "lost" if got_event else "failed_before_first_byte"
        record.detail = repr(error)[:200]
    finally:
        record.ended = time.monotonic()
    return record


def run_load(url: str, requests: int, clients: int, max_tokens: int | Callable[[int], int],
             on_sent: Callable[[int], None] | None = None, timeout: float = 120.0) -> LoadResult:
    """Send `requests` requests from `clients` workers; `on_sent(n)` is called as request n goes out (the
    scenarios inject and heal faults at request counts, not at times)."""
    result = LoadResult()
    lock = threading.Lock()
    next_number = [0]

    def worker() -> None:
        with httpx.Client(trust_env=False) as client:
            while True:
                with lock:
                    number = next_number[0]
                    if number >= requests:
                        return
                    next_number[0] += 1
                if on_sent is not None:
                    on_sent(number)
                tokens = max_tokens(number) if callable(max_tokens) else max_tokens
                record = one_request(client, url, number, tokens, timeout)
                with lock:
                    result.records.append(record)

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    result.records.sort(key=lambda record: record.number)
    return result
