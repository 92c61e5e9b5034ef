"""The router's forwarding rules against small OpenAI-style backends run in this process (real HTTP over
127.0.0.1, each behaviour on demand): unbuffered streaming, one retry before the first byte and none
after, 503 and refused connections, health-based leave/rejoin, /v1/models, disconnects, limits."""

from __future__ import annotations

import asyncio
import gzip
import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
import uvicorn

from harness.router import RouterProcess
from harness.server import free_port
from titan.bench.metrics_scraper import parse_prometheus_text
from titan.entrypoints.cli import main as cli_main
from titan.router.app import RouterApp
from titan.router.config import RouterConfig, parse_backend
from titan.router.responses import has_output


class ServerThread:
    """uvicorn serving an ASGI app from a background thread."""

    def __init__(self, app: Any) -> None:
        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="critical",
                                                    lifespan="auto", timeout_graceful_shutdown=1))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "server did not start"
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


class Backend:
    """An OpenAI-style backend whose behaviour the test sets: mode 'ok', '503', 'die-before-body', 'die-mid-body'.
    Streams send one chunk, wait for `release`, then finish."""

    def __init__(self, name: str, model: str = "stub") -> None:
        self.name = name
        self.model = model
        self.mode = "ok"
        self.ready = True
        self.requests: list[dict[str, Any]] = []
        self.headers: list[dict[bytes, bytes]] = []
        self.release = threading.Event()
        self.client_left = threading.Event()

    async def __call__(self, scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]) -> None:
        if scope["type"] != "http":
            return
        path = scope["path"]
        if path == "/ready":
            await self.reply(send, 200 if self.ready else 503, {"status": "ready" if self.ready else "draining"})
        elif path == "/v1/models":
            await self.reply(send, 200, {"object": "list", "data": [{"id": self.model, "object": "model"}]})
        elif path == "/v1/completions":
            body = b""
            while True:
                message = await receive()
                body += message.get("body", b"")
                if not message.get("more_body"):
                    break
            self.headers.append(dict(scope["headers"]))
            try:
                request = json.loads(body)
            except (ValueError, RecursionError):
                await self.reply(send, 400, {"error": {"message": "not JSON", "code": "invalid_json"}})
                return
            self.requests.append(request)
            await self.complete(request, receive, send)
        else:
            await self.reply(send, 404, {"error": {"message": "Not Found"}})

    async def reply(self, send: Callable[..., Any], status: int, payload: Any) -> None:
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": json.dumps(payload).encode()})

    async def complete(self, request: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]) -> None:
        if self.mode == "503":
            await self.reply(send, 503, {"error": {"message": "The server is shutting down.", "code": "shutting_down"}})
            return
        if self.mode == "gzip-503":  # another server behind the router, fronted by a compressing proxy
            body = gzip.compress(json.dumps({"error": {"message": "busy", "code": "busy"}}).encode())
            await send({"type": "http.response.start", "status": 503, "headers": [
                (b"content-type", b"application/json"), (b"content-encoding", b"gzip")]})
            await send({"type": "http.response.body", "body": body})
            return
        if self.mode == "silent":  # a generation slower than the router's read timeout
            while not self.release.is_set():
                await asyncio.sleep(0.01)
        if not request.get("stream"):
            if self.mode == "die-before-body":
                await send({"type": "http.response.start", "status": 200, "headers": []})
                raise RuntimeError("died after the headers")
            await self.reply(send, 200, {"backend": self.name, "choices": [{"text": "done"}]})
            return
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        if self.mode == "die-before-body":
            raise RuntimeError("died after the headers")
        # Like chat servers: an output-free role delta as soon as the request is accepted.
        role = {"backend": self.name, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
        await send({"type": "http.response.body", "body": b"data: " + json.dumps(role).encode() + b"\n\n",
                    "more_body": True})
        if self.mode == "die-after-role":
            raise RuntimeError("died in prefill")
        await send({"type": "http.response.body", "body": self.event("first"), "more_body": True})
        if self.mode == "die-mid-body":
            raise RuntimeError("died mid-stream")
        watcher = asyncio.ensure_future(receive())
        while not self.release.is_set():
            if watcher.done() and watcher.result()["type"] == "http.disconnect":
                self.client_left.set()
                return
            await asyncio.sleep(0.01)
        watcher.cancel()
        await send({"type": "http.response.body", "body": self.event("second"), "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})

    def event(self, text: str) -> bytes:
        return b"data: " + json.dumps({"backend": self.name, "choices": [{"text": text}]}).encode() + b"\n\n"


@pytest.fixture
def cluster() -> Iterator[Callable[..., tuple[str, list[Backend], list[ServerThread]]]]:
    """cluster(n, **config) → (router URL, backends, their servers); everything stops afterwards."""
    threads: list[ServerThread] = []

    def start(count: int, models: list[str] | None = None, wait_ready: int | None = None,
              **settings: Any) -> tuple[str, list[Backend], list[ServerThread]]:
        backends = [Backend(f"b{i}", models[i] if models else "stub") for i in range(count)]
        servers = [ServerThread(backend).start() for backend in backends]
        threads.extend(servers)
        config = RouterConfig(backends=[parse_backend({"url": server.url, "name": backend.name})
                                        for server, backend in zip(servers, backends, strict=True)],
                              **{"policy": "round-robin", "health_interval": 0.1, **settings})
        router = ServerThread(RouterApp(config)).start()
        threads.append(router)
        wait_until(lambda: ready_count(router.url) >= (count if wait_ready is None else wait_ready))
        return router.url, backends, servers

    yield start
    for thread in reversed(threads):
        thread.stop()


def wait_until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def ready_count(router: str) -> int:
    try:
        return sum(backend["ready"] for backend in httpx.get(router + "/ready", timeout=5).json()["backends"])
    except httpx.HTTPError:
        return 0


def metric(router: str, name: str, **labels: str) -> float:
    samples = parse_prometheus_text(httpx.get(router + "/metrics", timeout=5).text)
    return sum(sample.value for sample in samples
               if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()))


def complete(router: str, stream: bool = False, **extra: Any) -> httpx.Response:
    return httpx.post(router + "/v1/completions", json={"prompt": "hi", "stream": stream, **extra}, timeout=10)


def test_streams_pass_through_unbuffered(cluster: Callable[..., Any]) -> None:
    router, (backend,), _ = cluster(1)
    with httpx.stream("POST", router + "/v1/completions", json={"prompt": "hi", "stream": True}, timeout=10) as reply:
        assert reply.status_code == 200
        assert reply.headers["content-type"].startswith("text/event-stream")
        assert reply.headers["x-titan-router-backend"] == "b0"
        lines = (line for line in reply.iter_lines() if line)
        assert "delta" in json.loads(next(lines)[6:])["choices"][0]  # the role preamble
        # The backend holds its second event until released: the first must already be here.
        assert json.loads(next(lines)[6:])["choices"][0]["text"] == "first"
        backend.release.set()
        rest = list(lines)
    assert [json.loads(line[6:])["choices"][0]["text"] for line in rest[:-1]] == ["second"]
    assert rest[-1] == "data: [DONE]"
    assert metric(router, "titan_router:first_byte_seconds_count", backend="b0") == 1
    assert metric(router, "titan_router:request_duration_seconds_count", backend="b0") == 1
    assert metric(router, "titan_router:backend_outstanding", backend="b0") == 0


def test_failure_before_the_first_byte_is_retried_once_elsewhere(cluster: Callable[..., Any]) -> None:
    router, backends, _ = cluster(3)
    for backend in backends:
        backend.release.set()
    backends[0].mode = "die-before-body"  # answers with headers, then its process "dies"
    replies = [complete(router, stream) for stream in (False, True) * 3]
    assert [reply.status_code for reply in replies] == [200] * 6
    assert {reply.headers["x-titan-router-backend"] for reply in replies} == {"b1", "b2"}
    assert all(b"[DONE]" in reply.content for reply in replies[1::2])
    # Round-robin (b0, retry b1; b2; ...) started three of the six on b0; each went on to b1, once.
    assert metric(router, "titan_router:retries_total", backend="b0") == 3
    assert metric(router, "titan_router:errors_total", backend="b0", reason="disconnect") == 3
    assert metric(router, "titan_router:requests_total") == 9
    # Once only: when the second backend fails too, the client gets an error rather than a third try.
    backends[1].mode = backends[2].mode = "die-before-body"
    reply = complete(router)
    assert reply.status_code == 502 and reply.json()["error"]["code"] == "backend_failed"
    assert metric(router, "titan_router:requests_total") == 11
    assert metric(router, "titan_router:unrouted_total", reason="failed") == 1


def test_a_stream_that_dies_before_its_first_token_is_retried(cluster: Callable[..., Any]) -> None:
    router, backends, _ = cluster(2)
    backends[0].mode = "die-after-role"  # accepted (role delta sent), then died in prefill
    backends[1].release.set()
    reply = complete(router, stream=True)
    assert reply.status_code == 200 and reply.headers["x-titan-router-backend"] == "b1"
    events = [json.loads(event[6:]) for event in reply.text.split("\n\n") if event and "[DONE]" not in event]
    assert [event["backend"] for event in events] == ["b1"] * 3  # b0's role delta never reached the client
    assert metric(router, "titan_router:retries_total", backend="b0") == 1


def test_nothing_is_retried_after_streaming_began(cluster: Callable[..., Any]) -> None:
    router, backends, _ = cluster(2)
    backends[0].mode = backends[1].mode = "die-mid-body"
    reply = complete(router, stream=True)
    assert reply.status_code == 200
    events = [line for line in reply.text.split("\n\n") if line]
    assert json.loads(events[1][6:])["choices"][0]["text"] == "first"
    assert json.loads(events[-1][6:])["error"]["code"] == "backend_failed"
    assert "[DONE]" not in reply.text
    assert metric(router, "titan_router:requests_total") == 1  # one attempt only
    assert metric(router, "titan_router:errors_total", reason="stream") == 1
    assert metric(router, "titan_router:retries_total") == 0


def test_a_read_timeout_is_a_504_and_not_run_again_elsewhere(cluster: Callable[..., Any]) -> None:
    """The request reached the backend, which may be generating it still: sent to another, a slow generation
    ran twice and the client got a 502 after twice the timeout."""
    router, backends, _ = cluster(2, read_timeout=0.5)
    for backend in backends:
        backend.mode = "silent"
    try:
        reply = complete(router)
        assert reply.status_code == 504 and reply.json()["error"]["code"] == "backend_timeout"
        assert sum(len(backend.requests) for backend in backends) == 1
        assert metric(router, "titan_router:retries_total") == 0
    finally:
        for backend in backends:
            backend.release.set()


def test_bodies_the_router_cannot_read_are_the_backends_business(cluster: Callable[..., Any]) -> None:
    """JSON nested past the parser's depth used to crash the router's routing-key parse (a plain-text 500);
    a gzip-encoded error passed on decoded but still labelled gzip, which the client could not read."""
    router, backends, _ = cluster(1, retries=0)
    deep = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    reply = httpx.post(router + "/v1/completions", content=deep, timeout=10)
    assert reply.status_code == 400 and reply.json()["error"]["code"] == "invalid_json"
    assert reply.headers["x-titan-router-backend"] == "b0"
    backends[0].mode = "gzip-503"
    reply = complete(router)
    assert reply.status_code == 503 and reply.json()["error"]["code"] == "busy"


def test_the_router_appends_its_real_peer_to_x_forwarded_for() -> None:
    """`titan router` as served: uvicorn replaced a 127.0.0.1 peer by the header's last hop, which the router
    then appended a second time (1.1.1.1 arrived as "1.1.1.1, 1.1.1.1")."""
    backend = Backend("b0")
    server = ServerThread(backend).start()
    try:
        with RouterProcess([server.url], ["--policy", "round-robin"]) as router:
            reply = httpx.post(router.url + "/v1/completions", json={"prompt": "hi"},
                               headers={"X-Forwarded-For": "1.1.1.1"}, timeout=30)
            assert reply.status_code == 200
    finally:
        server.stop()
    assert backend.headers[-1][b"x-forwarded-for"] == b"1.1.1.1, 127.0.0.1"


def test_503_and_refused_connections_go_elsewhere_and_leave_the_pool(cluster: Callable[..., Any]) -> None:
    router, backends, servers = cluster(3, health_interval=30.0)  # no poll in between: the proxy must act
    backends[0].mode = "503"
    first = complete(router)  # b0 answers 503 and leaves; the request goes on to b1
    servers[1].stop()  # b1 refuses connections from now on
    replies = [first] + [complete(router) for _ in range(3)]  # b2; b1 refused, so b2; b2
    assert [reply.status_code for reply in replies] == [200] * 4
    assert [reply.headers["x-titan-router-backend"] for reply in replies] == ["b1", "b2", "b2", "b2"]
    assert metric(router, "titan_router:errors_total", backend="b0", reason="http_503") == 1
    assert metric(router, "titan_router:errors_total", backend="b1", reason="connect") == 1
    assert metric(router, "titan_router:backend_ready", backend="b0") == 0
    assert metric(router, "titan_router:backend_ready", backend="b1") == 0
    assert metric(router, "titan_router:requests_total", backend="b2") == 3
    # With every backend failing, the client gets the backend's own 503 (retryable), not a generic error.
    backends[2].mode = "503"
    reply = complete(router)
    assert reply.status_code == 503 and reply.json()["error"]["code"] == "shutting_down"
    reply = complete(router)
    assert reply.status_code == 503 and reply.json()["error"]["code"] == "no_backend"
    assert httpx.get(router + "/ready").status_code == 503


def test_a_draining_backend_leaves_the_pool_and_rejoins_when_ready(cluster: Callable[..., Any]) -> None:
    router, backends, _ = cluster(2)
    backends[1].ready = False  # /ready answers 503 (draining)
    wait_until(lambda: ready_count(router) == 1)
    body = httpx.get(router + "/ready").json()
    assert body["backends"][1] == {"name": "b1", "ready": False, "outstanding": 0,
                                   "reason": "/ready answered 503 (draining)"}
    assert {complete(router).headers["x-titan-router-backend"] for _ in range(4)} == {"b0"}
    assert backends[1].requests == []
    backends[1].ready = True
    wait_until(lambda: ready_count(router) == 2)
    assert {complete(router).headers["x-titan-router-backend"] for _ in range(4)} == {"b0", "b1"}


def test_models_are_the_union_and_requests_go_to_a_backend_serving_theirs(cluster: Callable[..., Any]) -> None:
    router, backends, _ = cluster(3, models=["small", "large", "small"])
    models = httpx.get(router + "/v1/models").json()
    assert sorted(card["id"] for card in models["data"]) == ["large", "small"]
    assert {complete(router, model="large").headers["x-titan-router-backend"] for _ in range(3)} == {"b1"}
    assert {complete(router, model="small").headers["x-titan-router-backend"] for _ in range(4)} == {"b0", "b2"}


def test_a_client_that_leaves_closes_the_backend_stream(cluster: Callable[..., Any]) -> None:
    router, (backend,), _ = cluster(1)
    with httpx.stream("POST", router + "/v1/completions", json={"prompt": "hi", "stream": True}, timeout=10) as reply:
        next(reply.iter_lines())
    assert backend.client_left.wait(5), "the backend kept streaming to a client that had left"
    wait_until(lambda: metric(router, "titan_router:backend_outstanding", backend="b0") == 0)


def test_router_answers_its_own_errors(cluster: Callable[..., Any]) -> None:
    router, _, _ = cluster(1, max_request_body_bytes=1000)
    reply = httpx.post(router + "/v1/completions", content=b"x" * 2000, timeout=5)
    assert reply.status_code == 413 and reply.json()["error"]["code"] == "request_too_large"
    assert httpx.get(router + "/nowhere").status_code == 404
    assert httpx.get(router + "/health").status_code == 200
    # Paths the router does not know under /v1 are the backend's business.
    assert httpx.post(router + "/v1/embeddings", json={"input": "x"}).status_code == 404


def test_cli_rejects_bad_settings(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["router"]) == 2
    assert "no backends" in capsys.readouterr().err
    assert cli_main(["router", "--backend", "http://a:1", "--chunk-chars", "999"]) == 2


def test_output_free_stream_preambles_are_recognised() -> None:
    role = b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'
    assert not has_output(role)
    assert not has_output(role + b'data: {"choices":[{"delta":{"content":"Hi"}}]}')  # not complete yet
    assert has_output(role + b'data: {"choices":[{"delta":{"content":"Hi"}}]}\n\n')
    assert has_output(b'data: {"choices":[{"text":"a","index":0}]}\n\n')
    assert has_output(b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\r\n\r\n')
    assert has_output(b"data: [DONE]\n\n")
    assert has_output(b'data: {"error":{"message":"engine failed"}}\n\n')
    assert not has_output(b": keep-alive\n\n")
