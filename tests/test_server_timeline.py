"""Attribution and degradation over HTTP: `titan_timeline` on request, `titan_degraded` when applied."""

from __future__ import annotations

import json

import httpx
import pytest

from harness.server import ServerProcess

# A 32-token budget splits prompts into chunks; every request counts as slow, so each is logged.
SERVER_ARGS = ["--max-num-batched-tokens", "32", "--max-num-seqs", "8", "--kv-cache-memory", "0.25",
               "--degrade-batch-max-tokens", "2", "--slow-request-ms", "1"]
PROMPT = "Write a detailed story about a lighthouse keeper who finds a message in a bottle on the shore."


@pytest.fixture(scope="module")
def server() -> ServerProcess:
    with ServerProcess(SERVER_ARGS) as process:
        yield process


def check_timeline(timeline: dict, prompt_tokens: int, completion_tokens: int) -> None:
    assert timeline["prompt_tokens"] == prompt_tokens and timeline["output_tokens"] == completion_tokens
    chunks = timeline["prefill_chunks"]
    assert sum(chunk["tokens"] for chunk in chunks) == prompt_tokens - timeline["cached_prompt_tokens"]
    assert all(chunk["tokens"] <= 32 for chunk in chunks)
    # Times count from the HTTP request's arrival, so queueing before the engine is included.
    assert 0 <= timeline["queued_ms"] <= chunks[0]["start_ms"] + 5.0
    assert chunks[-1]["start_ms"] <= timeline["ttft_ms"] <= timeline["e2e_ms"]
    assert timeline["decode_steps"] == completion_tokens - 1
    if completion_tokens > 1:
        assert timeline["longest_stall"]["cause"] in ("decode", "gc", "queueing", "prefill_interference",
                                                      "preemption")


def test_timeline_on_request_by_body_or_header(server: ServerProcess) -> None:
    body = {"prompt": PROMPT, "max_tokens": 5, "ignore_eos": True}
    plain = httpx.post(server.url + "/v1/completions", json=body, timeout=120).json()
    assert "titan_timeline" not in plain["choices"][0]
    asked = httpx.post(server.url + "/v1/completions", json={**body, "titan_timeline": True}, timeout=120).json()
    usage = asked["usage"]
    check_timeline(asked["choices"][0]["titan_timeline"], usage["prompt_tokens"], usage["completion_tokens"])
    assert len(asked["choices"][0]["titan_timeline"]["prefill_chunks"]) >= 1

    chat = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=chat, headers={"X-Titan-Timeline": "true"},
                      timeout=120) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    final = [event for event in events if event["choices"] and event["choices"][0]["finish_reason"]]
    assert len(final) == 1
    timeline = final[0]["choices"][0]["titan_timeline"]
    assert len(timeline["prefill_chunks"]) >= 2  # the chat template makes the prompt longer than 32 tokens
    check_timeline(timeline, events[-1]["usage"]["prompt_tokens"], events[-1]["usage"]["completion_tokens"])
    assert all("titan_timeline" not in event["choices"][0] for event in events if event not in final and
               event["choices"])
    # Slow requests are logged with their timeline.
    assert "slow request" in server.log() and '"longest_stall"' in server.log()


def test_batch_degradation_is_visible_and_counted(server: ServerProcess) -> None:
    # n=3 choices enter the engine together: the first finds the queue empty, the other two do not.
    body = {"prompt": PROMPT, "max_tokens": 6, "ignore_eos": True, "n": 3}
    response = httpx.post(server.url + "/v1/completions", json=body, headers={"X-Titan-Priority": "batch"},
                          timeout=120)
    assert response.status_code == 200 and response.headers["X-Titan-Degraded"] == "max_tokens=2"
    choices = sorted(response.json()["choices"], key=lambda choice: choice["index"])
    assert "titan_degraded" not in choices[0]
    for choice in choices[1:]:
        assert choice["titan_degraded"] == {"max_tokens": {"requested": 6, "applied": 2}}
        assert choice["finish_reason"] == "length"
    assert response.json()["usage"]["completion_tokens"] == 6 + 2 + 2
    # Interactive requests are never degraded.
    interactive = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
    assert "X-Titan-Degraded" not in interactive.headers and interactive.json()["usage"]["completion_tokens"] == 18
    # Streaming announces it in a header before the first byte, and in the finishing chunk.
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True, "priority": 1},
                      timeout=120) as stream:
        assert stream.headers["X-Titan-Degraded"] == "max_tokens=2"
        events = [json.loads(line[6:]) for line in stream.iter_lines() if line.startswith("data: {")]
    degraded = [event["choices"][0] for event in events if "titan_degraded" in event["choices"][0]]
    assert len(degraded) == 2 and all(choice["finish_reason"] == "length" for choice in degraded)
    counted = server.metric_samples("titan:degraded_requests_total")
    assert all(sample.labels["kind"] == "max_tokens" for sample in counted)
    assert sum(sample.value for sample in counted) == 4


def test_cache_salt_keeps_prefix_cache_hits_within_a_salt(server: ServerProcess) -> None:
    prompt = "A salted prompt, long enough for several full blocks of the prefix cache: " + "tide and wind " * 12

    def cached(**fields: object) -> int:
        body = {"prompt": prompt, "max_tokens": 1, "titan_timeline": True} | fields
        reply = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
        assert reply.status_code == 200, reply.text
        hit = reply.json()["choices"][0]["titan_timeline"]["cached_prompt_tokens"]
        assert reply.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": hit}  # OpenAI's field
        return hit

    assert cached(cache_salt="tenant-a") == 0
    assert cached(cache_salt="tenant-a") >= 32  # the same salt shares the blocks it published
    assert cached(cache_salt="tenant-b") == 0  # another salt never sees them
    assert cached() == 0  # nor does an unsalted request
    assert cached() >= 32
    # Streamed, the usage chunk carries it too; with n = 2 the prompt (and its hit) counts once.
    streamed = httpx.post(server.url + "/v1/completions", timeout=120, json={
        "prompt": prompt, "max_tokens": 1, "n": 2, "stream": True, "stream_options": {"include_usage": True}})
    last = json.loads([line for line in streamed.text.splitlines() if line.startswith("data: {")][-1][6:])
    assert last["usage"]["prompt_tokens_details"]["cached_tokens"] >= 32
    assert last["usage"]["prompt_tokens_details"]["cached_tokens"] < last["usage"]["prompt_tokens"]
    empty = httpx.post(server.url + "/v1/completions", json={"prompt": prompt, "cache_salt": ""}, timeout=30)
    assert empty.status_code == 400 and empty.json()["error"]["param"] == "cache_salt"
