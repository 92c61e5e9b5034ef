"""The OpenAI-compatible server end to end: one real `titan serve` process on the default model.

Driven by the official `openai` client (sync and async, streamed and not, completions and chat) and
by raw HTTP (httpx) for the error cases. One server for the whole module keeps the suite fast.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
import subprocess
import time
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from harness.server import ServerProcess, free_port

API_KEY = "sk-titan-test"
# Small pools keep warm-up (largest step shapes) short; 64 sequences cover the 32-stream test.
SERVER_ARGS = ["--model", "default", "--api-key", API_KEY, "--max-num-batched-tokens", "256",
               "--max-num-seqs", "64", "--kv-cache-memory", "0.125"]


@pytest.fixture(scope="module")
def server() -> ServerProcess:
    with ServerProcess(SERVER_ARGS) as process:
        yield process


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model_name(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def http(server: ServerProcess) -> httpx.Client:
    return httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120)


def scrape(server: ServerProcess) -> dict[str, float]:
    """Every sample of /metrics as name{labels} → value (labels sorted, model_name dropped)."""
    text = httpx.get(server.url + "/metrics", timeout=10).text
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k != "model_name")
            samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return samples


# ---- basics ------------------------------------------------------------------------------------
def test_health_ready_version_models(server: ServerProcess, client: openai.OpenAI, model_name: str) -> None:
    # While the model loaded and warmed up, the process was live but not ready.
    assert (503, 200) in server.startup_statuses
    assert httpx.get(server.url + "/health").status_code == 200
    ready = httpx.get(server.url + "/ready")
    assert ready.status_code == 200 and ready.json() == {"status": "ready"}
    assert httpx.get(server.url + "/version").json()["version"]
    assert model_name == "SmolLM2-135M-Instruct.Q4_1"
    assert scrape(server)["titan:startup_seconds"] > 0


def test_completion_sync(client: openai.OpenAI, model_name: str) -> None:
    before = time.time()
    result = client.completions.create(model=model_name, prompt="The capital of France is", max_tokens=5,
                                       temperature=0, extra_body={"ignore_eos": True})
    assert result.id.startswith("cmpl-") and result.object == "text_completion"
    assert result.model == model_name and before - 1 <= result.created <= time.time() + 1
    assert len(result.choices) == 1 and result.choices[0].finish_reason == "length"
    assert result.choices[0].text.strip()
    assert result.usage.completion_tokens == 5 and result.usage.prompt_tokens > 0
    assert result.usage.total_tokens == result.usage.prompt_tokens + 5


def test_completion_stream_sync(client: openai.OpenAI, model_name: str) -> None:
    chunks = list(client.completions.create(model=model_name, prompt="Once upon a time", max_tokens=6,
                                            temperature=0, stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    *content, finish, usage = chunks
    assert {chunk.id for chunk in chunks} == {chunks[0].id} and chunks[0].id.startswith("cmpl-")
    assert all(chunk.choices[0].finish_reason is None for chunk in content)
    assert all(chunk.choices[0].text for chunk in content)
    assert finish.choices[0].finish_reason == "length" and finish.choices[0].text == ""
    assert usage.choices == [] and usage.usage.completion_tokens == 6
    whole = client.completions.create(model=model_name, prompt="Once upon a time", max_tokens=6, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert "".join(chunk.choices[0].text for chunk in content) == whole.choices[0].text


def test_chat_sync_and_stream(client: openai.OpenAI, model_name: str) -> None:
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello."}]
    whole = client.chat.completions.create(model=model_name, messages=messages, max_completion_tokens=8,
                                           temperature=0)
    assert whole.id.startswith("chatcmpl-") and whole.object == "chat.completion"
    message = whole.choices[0].message
    assert message.role == "assistant" and message.content
    assert whole.choices[0].finish_reason in ("stop", "length")
    assert 1 <= whole.usage.completion_tokens <= 8

    chunks = list(client.chat.completions.create(model=model_name, messages=messages, max_tokens=8, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    first, *content, finish, usage = chunks
    assert first.object == "chat.completion.chunk" and first.choices[0].delta.role == "assistant"
    assert all(chunk.choices[0].delta.content for chunk in content)
    assert finish.choices[0].finish_reason == whole.choices[0].finish_reason
    assert finish.choices[0].delta.content is None
    assert usage.usage.completion_tokens == whole.usage.completion_tokens
    assert usage.usage.prompt_tokens == whole.usage.prompt_tokens
    assert "".join(chunk.choices[0].delta.content for chunk in content) == message.content


def test_async_client_completions_and_chat(server: ServerProcess, model_name: str) -> None:
    async def run() -> None:
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
        completion = await client.completions.create(model=model_name, prompt="Hello", max_tokens=3,
                                                     extra_body={"ignore_eos": True})
        assert completion.usage.completion_tokens == 3
        stream = await client.chat.completions.create(model=model_name, max_tokens=3, stream=True,
                                                      messages=[{"role": "user", "content": "Hi"}])
        reasons = [chunk.choices[0].finish_reason async for chunk in stream if chunk.choices]
        assert reasons[-1] in ("stop", "length") and all(reason is None for reason in reasons[:-1])
        chat = await client.chat.completions.create(
            model=model_name, max_tokens=3, seed=7, temperature=1.0,
            messages=[{"role": "user", "content": [{"type": "text", "text": "Tell me a joke"}]}])
        again = await client.chat.completions.create(
            model=model_name, max_tokens=3, seed=7, temperature=1.0,
            messages=[{"role": "user", "content": [{"type": "text", "text": "Tell me a joke"}]}])
        assert chat.choices[0].message.content == again.choices[0].message.content  # seeded
        await client.close()

    asyncio.run(run())


def test_prompt_forms_n_echo_stop_logprobs(client: openai.OpenAI, model_name: str) -> None:
    token_ids = [504, 3575, 282, 4649, 314]  # "The capital of France is"
    by_ids = client.completions.create(model=model_name, prompt=token_ids, max_tokens=4, temperature=0)
    by_text = client.completions.create(model=model_name, prompt="The capital of France is", max_tokens=4,
                                        temperature=0)
    assert by_ids.usage.prompt_tokens == 5
    batch = client.completions.create(model=model_name, prompt=[token_ids, [504, 3575]], max_tokens=2, n=2,
                                      temperature=0, extra_body={"ignore_eos": True})
    assert [choice.index for choice in batch.choices] == [0, 1, 2, 3]
    assert batch.choices[0].text == batch.choices[1].text == by_ids.choices[0].text[: len(batch.choices[0].text)]
    assert batch.usage.prompt_tokens == 7 and batch.usage.completion_tokens == 8
    echo = client.completions.create(model=model_name, prompt="The capital of France is", max_tokens=4,
                                     temperature=0, echo=True)
    assert echo.choices[0].text == "The capital of France is" + by_text.choices[0].text
    streamed_echo = list(client.completions.create(model=model_name, prompt="The capital of France is",
                                                   max_tokens=4, temperature=0, echo=True, stream=True))
    assert streamed_echo[0].choices[0].text == "The capital of France is"
    assert "".join(chunk.choices[0].text for chunk in streamed_echo) == echo.choices[0].text
    chat_chunks = list(client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "Hi"}],
                                                      max_tokens=3, n=2, stream=True, seed=1))
    assert [c.choices[0].delta.role for c in chat_chunks[:2]] == ["assistant", "assistant"]
    finishes = sorted(c.choices[0].index for c in chat_chunks if c.choices[0].finish_reason)
    assert finishes == [0, 1]
    stopped = client.completions.create(model=model_name, prompt="The capital of France is", max_tokens=8,
                                        temperature=0, stop=["."])
    assert stopped.choices[0].finish_reason == "stop" and "." not in stopped.choices[0].text
    with_logprobs = client.completions.create(model=model_name, prompt="Hello", max_tokens=3, logprobs=2,
                                              temperature=0, extra_body={"ignore_eos": True})
    logprobs = with_logprobs.choices[0].logprobs
    assert len(logprobs.tokens) == 3 and "".join(logprobs.tokens) == with_logprobs.choices[0].text
    assert all(value <= 0 for value in logprobs.token_logprobs)
    assert all(len(top) >= 2 for top in logprobs.top_logprobs)
    chat = client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=3, logprobs=True, top_logprobs=3, temperature=0)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and len(content[0].top_logprobs) == 3
    assert content[0].logprob == pytest.approx(content[0].top_logprobs[0].logprob)  # greedy: the top one


def test_greedy_http_equals_offline(client: openai.OpenAI, model_name: str) -> None:
    from titan.engine.sampling_params import SamplingParams
    from titan.entrypoints.llm import LLM

    prompts = ["The three primary colors are", "def fibonacci(n):", "Water boils at"]
    conversation = [{"role": "user", "content": "What is the capital of Germany?"}]
    http_texts = [client.completions.create(model=model_name, prompt=p, max_tokens=8, temperature=0)
                  .choices[0].text for p in prompts]
    http_chat = client.chat.completions.create(model=model_name, messages=conversation, max_tokens=8,
                                               temperature=0).choices[0].message.content
    llm = LLM("default", max_num_batched_tokens=256, kv_cache_memory=0.25)
    params = SamplingParams(max_tokens=8, temperature=0)
    offline = [llm.generate(prompt, params)[0].text for prompt in prompts]
    assert http_texts == offline
    assert http_chat == llm.chat(conversation, params).text
    # A reply begun for the model, continued the same way online and offline.
    begun = conversation + [{"role": "assistant", "content": "The capital of Germany is"}]
    http_continued = client.chat.completions.create(
        model=model_name, messages=begun, max_tokens=8, temperature=0,
        extra_body={"add_generation_prompt": False, "continue_final_message": True})
    offline_continued = llm.chat(begun, params, add_generation_prompt=False, continue_final_message=True)
    assert http_continued.choices[0].message.content == offline_continued.text
    assert len(offline_continued.prompt_token_ids) == http_continued.usage.prompt_tokens


# ---- errors -------------------------------------------------------------------------------------
ERROR_CASES = [
    (b'{"prompt": ', 400, None, "invalid_json"),
    (b'{"prompt": "x", "max_tokens": -1}', 400, "max_tokens", None),
    (b'{"prompt": "x", "top_p": 1.5}', 400, "top_p", None),
    (b'{"prompt": "x", "n": 0}', 400, "n", None),
    (b'{"prompt": "x", "temperature": -1}', 400, "temperature", None),
    (b'{"prompt": "x", "temperature": "hot"}', 400, "temperature", "invalid_type"),
    (b'{"prompt": 12}', 400, "prompt", "invalid_type"),
    (b'{"max_tokens": 4}', 400, "prompt", "missing_required_parameter"),
    (b'{"prompt": [1, 2, 10000000]}', 400, "prompt", None),
    (b'{"prompt": "x", "model": "gpt-nothing"}', 404, "model", "model_not_found"),
    (b'{"prompt": "x", "max_tokens": 9000}', 400, "max_tokens", "context_length_exceeded"),
    (b'{"prompt": "x", "stream_options": {"include_usage": true}}', 400, "stream_options", None),
    # Numbers the engine cannot honour: non-finite floats, integers beyond what it holds.
    (b'{"prompt": "x", "temperature": Infinity}', 400, "temperature", "invalid_value"),
    (b'{"prompt": "x", "temperature": "Infinity"}', 400, "temperature", "invalid_value"),
    (b'{"prompt": "x", "top_p": NaN}', 400, "top_p", "invalid_value"),
    (b'{"prompt": "x", "repetition_penalty": 1e308}', 400, "repetition_penalty", None),
    (b'{"prompt": "x", "priority": 1180591620717411303424}', 400, "priority", "invalid_value"),
    (b'{"prompt": "x", "seed": 1180591620717411303424}', 400, "seed", "invalid_value"),
    (b'{"prompt": "x", "stop_token_ids": [1180591620717411303424]}', 400, "stop_token_ids", None),
    (b'{"prompt": "x", "top_k": 1180591620717411303424}', 400, "top_k", "invalid_value"),
    # Fan-out: prompts x n over --max-sequences-per-request (256) is refused before any tokenization.
    (json.dumps({"prompt": ["hi"] * 200, "n": 50, "max_tokens": 1}).encode(), 400, "n", None),
    (json.dumps({"prompt": ["hi"] * 257, "max_tokens": 1}).encode(), 400, "prompt", None),
]


@pytest.mark.parametrize(("body", "status", "param", "code"), ERROR_CASES)
def test_completion_errors(server: ServerProcess, body: bytes, status: int, param: str | None,
                           code: str | None) -> None:
    with http(server) as session:
        response = session.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    if code is not None:
        assert error["code"] == code


def test_context_errors_name_token_counts(server: ServerProcess) -> None:
    with http(server) as session:
        long_prompt = session.post("/v1/completions", json={"prompt": [1] * 8192, "max_tokens": 1})
        too_many = session.post("/v1/completions", json={"prompt": "Hi there", "max_tokens": 8191})
        # Fits the context but not this server's small KV pool: the engine's rejection, also a 400.
        too_big = session.post("/v1/completions", json={"prompt": "Hi there", "max_tokens": 8000})
        chat = session.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                          "max_completion_tokens": 9000})
    assert long_prompt.status_code == 400 and "8192" in long_prompt.json()["error"]["message"]
    message = too_many.json()["error"]["message"]
    assert too_many.status_code == 400 and "8193" in message and "2 in the prompt" in message
    assert too_big.status_code == 400 and too_big.json()["error"]["param"] == "max_tokens"
    with http(server) as session:  # a streamed request is refused before any SSE goes out
        streamed = session.post("/v1/completions", json={"prompt": "Hi there", "max_tokens": 8000, "stream": True})
    assert streamed.status_code == 400 and streamed.headers["content-type"] == "application/json"
    assert "KV cache" in too_big.json()["error"]["message"]
    assert chat.status_code == 400 and chat.json()["error"]["code"] == "context_length_exceeded"


def test_chat_errors(server: ServerProcess) -> None:
    with http(server) as session:
        cases = [
            ({"messages": []}, "messages"),
            ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
            ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]}, None),
            ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
            ({"messages": [{"role": "user", "content": "x"}], "n": -1}, "n"),
        ]
        for body, param in cases:
            response = session.post("/v1/chat/completions", json=body)
            assert response.status_code == 400, (body, response.text)
            if param is not None:
                assert response.json()["error"]["param"] == param


def test_auth_body_size_and_routes(server: ServerProcess) -> None:
    body = {"prompt": "x", "max_tokens": 1}
    missing = httpx.post(server.url + "/v1/completions", json=body)
    wrong = httpx.post(server.url + "/v1/completions", json=body, headers={"Authorization": "Bearer nope"})
    for response in (missing, wrong):
        assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server.url + "/metrics").status_code == 200  # open without a key
    # Engine internals are not: /debug/steps needs the key like /v1/*.
    assert httpx.get(server.url + "/debug/steps").status_code == 401
    # Headers over the limit never reach the app; they still get an OpenAI-shaped error.
    huge = httpx.get(server.url + "/v1/models", headers={"X-Padding": "a" * 200_000}, timeout=30)
    assert huge.status_code == 431 and huge.json()["error"]["code"] == "request_header_fields_too_large"
    with http(server) as session:
        declared = session.post("/v1/completions", content=b"x" * (9 * 2**20))
        assert declared.status_code == 413 and declared.json()["error"]["code"] == "request_too_large"

    def chunks():
        for _ in range(9):
            yield b" " * 2**20

    with http(server) as session:
        streamed = session.post("/v1/completions", content=chunks())
        assert streamed.status_code == 413
        assert session.get("/v1/nowhere").status_code == 404
        assert session.get("/v1/completions").status_code == 405
        # After all of it, the server still serves.
        assert session.post("/v1/completions", json=body).status_code == 200


# ---- load, disconnects, metrics ----------------------------------------------------------------
def test_32_concurrent_streams(server: ServerProcess, model_name: str) -> None:
    async def one(client: openai.AsyncOpenAI, index: int) -> tuple[int, str, int, str]:
        stream = await client.completions.create(
            model=model_name, prompt=f"Request {index}: count to ten.", max_tokens=8, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}, temperature=0.8, seed=index)
        text, reason, tokens = "", None, -1
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
                reason = chunk.choices[0].finish_reason or reason
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        return index, text, tokens, reason

    async def run() -> list[tuple[int, str, int, str]]:
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=300)
        try:
            return await asyncio.gather(*(one(client, index) for index in range(32)))
        finally:
            await client.close()

    before = scrape(server)
    results = asyncio.run(run())
    assert [index for index, *_ in results] == list(range(32))
    assert all(tokens == 8 and reason == "length" and text for _, text, tokens, reason in results)
    after = scrape(server)
    assert after["titan:generation_tokens_total"] - before["titan:generation_tokens_total"] >= 32 * 8
    finished = "titan:request_success_total{finished_reason=length}"
    assert after[finished] - before[finished] >= 32


def wait_for_idle(server: ServerProcess, timeout: float = 10.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        samples = scrape(server)
        idle = samples["titan:num_requests_running"] == 0 and samples["titan:num_requests_waiting"] == 0
        if (idle and samples["titan:kv_cache_usage_perc"] == 0) or time.monotonic() > deadline:
            return samples
        time.sleep(0.05)


def test_disconnect_aborts_and_frees_kv(server: ServerProcess, model_name: str) -> None:
    before = scrape(server)
    body = {"model": model_name, "prompt": "Write a very long story about a dragon.", "max_tokens": 2000,
            "stream": True, "ignore_eos": True}

    async def drop_after_first_token(client: httpx.AsyncClient) -> None:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["text"]:
                    return  # leaving the block closes the connection mid-stream

    async def run() -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=60,
                                     headers={"Authorization": f"Bearer {API_KEY}"}) as client:
            await asyncio.gather(*(drop_after_first_token(client) for _ in range(6)))

    asyncio.run(run())
    during = scrape(server)
    samples = wait_for_idle(server)
    assert samples["titan:num_requests_running"] == 0 and samples["titan:kv_cache_usage_perc"] == 0
    aborted = "titan:request_success_total{finished_reason=abort}"
    assert samples[aborted] - before[aborted] == 6
    # Each stopped soon after its client left, far from the 2000 it asked for. Bounded by a share of those
    # tokens, not by steps: how many steps pass before the server sees the closed socket depends on how
    # fast the machine decodes and how loaded it is.
    generated = samples["titan:generation_tokens_total"] - before["titan:generation_tokens_total"]
    assert generated < 6 * 200, (generated, during)


def test_non_streaming_disconnect_aborts(server: ServerProcess, model_name: str) -> None:
    before = scrape(server)
    body = json.dumps({"model": model_name, "prompt": "Tell me everything.", "max_tokens": 2000,
                       "ignore_eos": True}).encode()
    request = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {API_KEY}\r\n"
               f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body
    with socket.create_connection((server.host, server.port)) as connection:
        connection.sendall(request)
        deadline = time.monotonic() + 30
        while scrape(server)["titan:num_requests_running"] < 1:  # wait until it really runs
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.05)
    samples = wait_for_idle(server)
    assert samples["titan:num_requests_running"] == 0 and samples["titan:kv_cache_usage_perc"] == 0
    aborted = "titan:request_success_total{finished_reason=abort}"
    assert samples[aborted] - before[aborted] == 1


def test_metrics_parse_and_move(server: ServerProcess, client: openai.OpenAI, model_name: str) -> None:
    text = httpx.get(server.url + "/metrics").text
    families = {family.name: family for family in text_string_to_metric_families(text)}
    expected = {
        "gauge": ["num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "startup_seconds"],
        "counter": ["prompt_tokens", "generation_tokens", "request_success", "num_preemptions",
                    "prefix_cache_queries", "prefix_cache_hits"],
        "histogram": ["time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
                      "request_queue_time_seconds", "request_prefill_time_seconds",
                      "request_decode_time_seconds", "request_prompt_tokens", "request_generation_tokens",
                      "iteration_tokens_total", "engine_step_seconds"],
    }
    for kind, names in expected.items():
        for name in names:
            family = families["titan:" + name]
            assert family.type == kind, name
            assert all(sample.labels.get("model_name") == model_name for sample in family.samples)
    itl_buckets = {s.labels["le"] for s in families["titan:inter_token_latency_seconds"].samples if "le" in s.labels}
    assert {"0.004", "0.005", "0.006"} <= itl_buckets
    ttft_buckets = {s.labels["le"] for s in families["titan:time_to_first_token_seconds"].samples
                    if "le" in s.labels}
    assert {"0.08", "0.09", "0.1", "0.11"} <= ttft_buckets

    before = scrape(server)
    shared = "You are a helpful assistant. " * 8
    for question in ("What is 2+2?", "What is 3+3?"):
        client.completions.create(model=model_name, prompt=shared + question, max_tokens=4,
                                  extra_body={"ignore_eos": True})
    after = scrape(server)
    for name in ("titan:prompt_tokens_total", "titan:prefix_cache_queries_total", "titan:prefix_cache_hits_total",
                 "titan:time_to_first_token_seconds_count", "titan:e2e_request_latency_seconds_count",
                 "titan:request_queue_time_seconds_count", "titan:request_prefill_time_seconds_count",
                 "titan:request_decode_time_seconds_count", "titan:iteration_tokens_total_count",
                 "titan:engine_step_seconds_count", "titan:request_prompt_tokens_count"):
        assert after[name] > before[name], name
    assert after["titan:generation_tokens_total"] - before["titan:generation_tokens_total"] == 8
    assert after["titan:inter_token_latency_seconds_count"] - before["titan:inter_token_latency_seconds_count"] == 6
    assert after["titan:request_generation_tokens_sum"] - before["titan:request_generation_tokens_sum"] == 8


def test_real_prometheus_scrape(server: ServerProcess, client: openai.OpenAI, model_name: str,
                                tmp_path: Path) -> None:
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("the prometheus binary is not installed (apt-get install --no-install-recommends prometheus)")
    port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n"
        "scrape_configs:\n  - job_name: titan\n    static_configs:\n"
        f"      - targets: ['127.0.0.1:{server.port}']\n"
    )
    log = (tmp_path / "prometheus.log").open("wb")
    process = subprocess.Popen([binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
                                f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=log)
    api = f"http://127.0.0.1:{port}/api/v1/query"
    try:
        client.completions.create(model=model_name, prompt="Scrape me", max_tokens=2)

        def query(expression: str) -> list[dict]:
            try:
                response = httpx.get(api, params={"query": expression}, timeout=5)
            except httpx.TransportError:
                return []  # not listening yet
            return response.json()["data"]["result"] if response.status_code == 200 else []

        deadline = time.monotonic() + 60
        tokens: list[dict] = []
        while time.monotonic() < deadline:
            tokens = query("titan:generation_tokens_total")
            if tokens and float(tokens[0]["value"][1]) > 0:
                break
            time.sleep(0.5)
        assert tokens, f"Prometheus never scraped the server:\n{(tmp_path / 'prometheus.log').read_text()}"
        assert tokens[0]["metric"]["model_name"] == model_name
        assert query('up{job="titan"}')[0]["value"][1] == "1"
        buckets = query('titan:inter_token_latency_seconds_bucket{le="0.005"}')
        assert buckets and buckets[0]["metric"]["model_name"] == model_name
    finally:
        process.terminate()
        process.wait(timeout=30)
        log.close()


def test_debug_steps_and_priority_header(server: ServerProcess, model_name: str) -> None:
    with http(server) as session:
        body = {"model": model_name, "prompt": "Hello there", "max_tokens": 4, "temperature": 0}
        bad = session.post("/v1/completions", json=body, headers={"X-Titan-Priority": "urgent"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "x-titan-priority"
        for priority_class in ("batch", "interactive"):
            ok = session.post("/v1/completions", json=body, headers={"X-Titan-Priority": priority_class})
            assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
        steps = session.get("/debug/steps", params={"limit": 5}).json()["data"]
    assert 0 < len(steps) <= 5
    now = time.time()
    for record in steps:
        assert now - 600 < record["time"] <= now and record["duration"] > 0
        assert record["num_prefill_tokens"] + record["num_decodes"] <= record["num_tokens"]
        assert record["gc_pause"] >= 0
    assert [r["time"] for r in steps] == sorted(r["time"] for r in steps)
    assert steps[-1]["num_decodes"] == 1  # the last step decoded the final token of the last request
    # Warm-up ends with one full collection before the collector is frozen: it is measured.
    assert scrape(server)["titan:gc_pause_seconds_count{generation=2}"] >= 1


def test_openapi_declares_request_bodies_and_error_responses(server: ServerProcess) -> None:
    document = httpx.get(server.url + "/openapi.json", timeout=30).json()
    schemas = document["components"]["schemas"]
    for path, model in (("/v1/completions", "CompletionRequest"), ("/v1/chat/completions", "ChatCompletionRequest"),
                        ("/tokenize", "TokenizeRequest"), ("/detokenize", "DetokenizeRequest")):
        post = document["paths"][path]["post"]
        assert post["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/" + model)
        assert {"400", "401", "429", "503"} <= set(post["responses"])
    assert "prompt" in schemas["CompletionRequest"]["properties"]
    assert "messages" in schemas["ChatCompletionRequest"]["properties"]

    def refs(node: object) -> list[str]:
        if isinstance(node, dict):
            return [node["$ref"]] if "$ref" in node else [r for value in node.values() for r in refs(value)]
        return [r for value in node for r in refs(value)] if isinstance(node, list) else []

    assert all(ref.rsplit("/", 1)[1] in schemas for ref in refs(document))  # every reference resolves
    docs = httpx.get(server.url + "/docs", timeout=30)
    assert docs.status_code == 200 and "swagger" in docs.text.lower()


def test_logprob_offsets_echo_and_bytes_follow_the_text(client: openai.OpenAI, model_name: str) -> None:
    """Three ways the logprobs and echo once disagreed with the text: streamed offsets moved with the released
    text (a held-back stop string, a character split over tokens) where the whole response's follow the tokens;
    echo dropped a text prompt's special tokens; chat `bytes` of a token holding part of a character were the
    replacement character's."""
    cases = [{"prompt": "Translate to Chinese: good morning. 中文:"},
             {"prompt": "The capital of France is", "stop": ["Paris is"]}]
    for case in cases:
        body = {"model": model_name, "max_tokens": 8, "temperature": 0, "logprobs": 1, **case}
        whole = client.completions.create(**body).choices[0].logprobs.text_offset
        streamed = [offset for chunk in client.completions.create(**body, stream=True) if chunk.choices
                    and chunk.choices[0].logprobs for offset in chunk.choices[0].logprobs.text_offset]
        assert streamed == whole, case
    prompt = "<|im_start|>user\nCafé 日本<|im_end|>\n"
    echoed = client.completions.create(model=model_name, prompt=prompt, max_tokens=1, temperature=0, echo=True)
    assert echoed.choices[0].text.startswith(prompt)
    chat = client.chat.completions.create(model=model_name, messages=[
        {"role": "user", "content": "Say 中国 in Chinese only."}], max_tokens=8, temperature=0, logprobs=True)
    content = chat.choices[0].logprobs.content
    assert b"".join(bytes(entry.bytes) for entry in content) == chat.choices[0].message.content.encode()
