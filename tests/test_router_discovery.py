"""Backend discovery by DNS (titan/router/discovery.py).

A Kubernetes Service's DNS cannot run here, so most tests inject the resolver (the one seam): a function
whose answer the test sets. Everything behind it is real: the router's pool, health polling, policy ring and
metrics, and in the last two tests uvicorn servers on 127.0.0.1. Discovered addresses with no server behind
them use 127.0.0.x, where a connection is refused at once. The final test resolves `localhost` for real and
routes a completion to a real `titan serve`.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
from collections.abc import Iterable

import httpx
import pytest
from test_router_proxy import Backend as StubBackend
from test_router_proxy import ServerThread, metric, wait_until

from harness.router import RouterProcess
from harness.server import ServerProcess, free_port
from titan.bench.metrics_scraper import parse_prometheus_text
from titan.entrypoints.cli import build_parser
from titan.router.app import RouterApp
from titan.router.args import flag_settings
from titan.router.backend import BackendPool
from titan.router.config import BackendSpec, ConfigError, DnsTarget, RouterConfig, build_config
from titan.router.discovery import backend_for, dns_resolver
from titan.router.policies import PrefixAffinity, RoundRobin
from titan.router.request_key import RoutingInfo

TARGET = DnsTarget("titan-headless.default.svc.cluster.local", 8000)


class FakeDns:
    """The injected resolver: answers with `addresses`, or raises `error` when one is set."""

    def __init__(self, *addresses: str) -> None:
        self.addresses = list(addresses)
        self.error: Exception | None = None
        self.asked: list[tuple[str, int]] = []

    async def __call__(self, host: str, port: int) -> Iterable[str]:
        self.asked.append((host, port))
        if self.error is not None:
            raise self.error
        return list(self.addresses)


def discovering(**settings: object) -> RouterConfig:
    # A long interval: the tests call refresh() themselves, and the background loop stays asleep.
    values: dict[str, object] = {"discover_dns": [TARGET], "discover_interval": 3600.0, "health_interval": 0.05,
                                 "policy": "prefix-affinity", **settings}
    return RouterConfig(**values)  # type: ignore[arg-type]


def series(app: RouterApp, name: str) -> dict[str, float]:
    """{backend label: value} of one of the router's metrics."""
    return {sample.labels["backend"]: sample.value for sample in parse_prometheus_text(app.metrics.render().decode())
            if sample.name == name and "backend" in sample.labels}


def ring_members(app: RouterApp) -> set[str]:
    policy = app.pool.policy
    assert isinstance(policy, PrefixAffinity)
    return set(policy.ring.owners)


# ---- the sync logic, resolver injected -----------------------------------------------------------------

def test_addresses_join_stay_and_leave_the_pool() -> None:
    port = free_port()  # nothing listens there: discovered backends are polled, refused, and stay not ready
    names = [f"127.0.0.{host}:{port}" for host in (2, 3, 4)]
    dns = FakeDns("127.0.0.2", "127.0.0.3")

    async def scenario() -> None:
        app = RouterApp(discovering(discover_dns=[DnsTarget("titan-headless", port)]), resolver=dns)
        await app.startup()  # resolves once before it returns
        try:
            assert dns.asked == [("titan-headless", port)]
            assert app.pool.names == names[:2]
            assert [backend.url for backend in app.pool.backends] == [f"http://{name}" for name in names[:2]]
            assert ring_members(app) == set(names[:2])
            assert set(series(app, "titan_router:backend_ready")) == set(names[:2])
            await asyncio.sleep(0.2)  # a few polls: refused, so they never join the rotation
            assert not app.pool.ready
            assert "ConnectError" in app.pool.backends[0].not_ready_reason

            # Unchanged (in another order): nothing moves, the members are the same objects.
            members = list(app.pool.backends)
            dns.addresses = ["127.0.0.3", "127.0.0.2"]
            assert await app.discovery.refresh() == ([], [])  # type: ignore[union-attr]
            assert app.pool.backends == members

            # One leaves, one joins: the ring and the metrics follow; round-robin order extends at the end.
            dns.addresses = ["127.0.0.3", "127.0.0.4"]
            assert await app.discovery.refresh() == ([names[2]], [names[0]])  # type: ignore[union-attr]
            assert app.pool.names == names[1:]
            assert app.pool.backends[0] is members[1] and app.pool.backends[1].index > members[1].index
            assert ring_members(app) == set(names[1:])
            assert set(series(app, "titan_router:backend_ready")) == set(names[1:])
            assert set(series(app, "titan_router:requests_total")) == set(names[1:])
            assert set(app.health.tasks) == set(names[1:])  # type: ignore[union-attr]
            assert not app.pool.retiring  # nothing was open on the one that left

            # An empty answer is an answer: everyone leaves.
            dns.addresses = []
            assert await app.discovery.refresh() == ([], names[1:])  # type: ignore[union-attr]
            assert app.pool.backends == [] and ring_members(app) == set()
            assert app.readiness().status == 503
        finally:
            await app.shutdown()

    asyncio.run(scenario())


def test_a_failed_resolution_keeps_the_last_known_backends(caplog: pytest.LogCaptureFixture) -> None:
    port = free_port()
    dns = FakeDns("127.0.0.2", "127.0.0.3")

    async def scenario() -> None:
        app = RouterApp(discovering(discover_dns=[DnsTarget("titan-headless", port)]), resolver=dns)
        await app.startup()
        try:
            before = app.pool.names
            dns.error = socket.gaierror(socket.EAI_NONAME, "Name or service not known")
            with caplog.at_level(logging.INFO, logger="titan.router"):
                for _ in range(3):
                    assert await app.discovery.refresh() == ([], [])  # type: ignore[union-attr]
                assert app.pool.names == before
                warnings = [record for record in caplog.records if record.levelno == logging.WARNING]
                assert len(warnings) == 1, "one warning per failure streak, not one per interval"
                assert "titan-headless" in warnings[0].getMessage()
                assert "keeping its last 2 addresses" in warnings[0].getMessage()
                # It resolves again: the new answer applies.
                dns.error, dns.addresses = None, ["127.0.0.3"]
                assert await app.discovery.refresh() == ([], [f"127.0.0.2:{port}"])  # type: ignore[union-attr]
                assert any("resolves again" in record.getMessage() for record in caplog.records)
        finally:
            await app.shutdown()

    asyncio.run(scenario())


def test_static_backends_and_several_names_combine() -> None:
    port, other_port = free_port(), free_port()
    static = BackendSpec(f"http://127.0.0.2:{port}", "pinned")
    headless, canary = DnsTarget("titan-headless", port), DnsTarget("titan-canary", other_port)
    answers = {"titan-headless": ["127.0.0.2", "127.0.0.3", "fe80::1%eth0"], "titan-canary": ["127.0.0.3"]}
    failing: set[str] = set()

    async def resolve(host: str, _port: int) -> list[str]:
        if host in failing:
            raise OSError("resolver timed out")
        return answers[host]

    async def scenario() -> None:
        app = RouterApp(discovering(backends=[static], discover_dns=[headless, canary]), resolver=resolve)
        await app.startup()
        try:
            # 127.0.0.2:port is the static `pinned` already; the zoned link-local address has no URL form.
            assert app.pool.names == ["pinned", f"127.0.0.3:{port}", f"127.0.0.3:{other_port}"]
            # One name fails and keeps its answer while the other's changes.
            failing.add("titan-canary")
            answers["titan-headless"] = []
            assert await app.discovery.refresh() == ([], [f"127.0.0.3:{port}"])  # type: ignore[union-attr]
            assert app.pool.names == ["pinned", f"127.0.0.3:{other_port}"]
            # Static backends never leave, whatever DNS says.
            failing.clear()
            answers["titan-canary"] = []
            await app.discovery.refresh()  # type: ignore[union-attr]
            assert app.pool.names == ["pinned"]
        finally:
            await app.shutdown()

    asyncio.run(scenario())


def test_pool_membership_and_retiring() -> None:
    pool = BackendPool([BackendSpec("http://a:1", "a")], RoundRobin())
    b = pool.add(BackendSpec("http://b:1", "b"))
    assert (pool.names, b.index, b.ready) == (["a", "b"], 1, False)  # readiness polling lets it in
    with pytest.raises(ValueError, match="already"):
        pool.add(BackendSpec("http://b:1", "b"))
    for backend in pool.backends:
        backend.ready = True
    b.outstanding = 2  # two requests open on it (as Proxy.attempt counts them)
    assert pool.remove("b", "gone from DNS") is b
    assert pool.names == ["a"] and pool.retiring == {"b": b} and not b.ready
    assert pool.choose(RoutingInfo(), set()).name == "a"  # no new requests on b
    pool.set_ready(b, True)  # a late poll cannot bring a removed backend back
    assert not b.ready
    assert pool.release(b) is False and pool.release(b) is True  # the last one out: gone for good
    assert pool.retiring == {}
    # Back in DNS while requests are still open: the same object returns, its count intact.
    c = pool.add(BackendSpec("http://c:1", "c"))
    c.outstanding = 1
    pool.remove("c", "gone")
    assert pool.add(BackendSpec("http://c:1", "c")) is c and c.outstanding == 1 and not c.retired
    assert pool.release(c) is False and pool.names == ["a", "c"]
    assert pool.remove("nobody", "gone") is None


def test_backend_names_for_addresses() -> None:
    assert backend_for("10.1.2.3", 8000) == BackendSpec("http://10.1.2.3:8000", "10.1.2.3:8000")
    assert backend_for("fd00::5", 8000) == BackendSpec("http://[fd00::5]:8000", "[fd00::5]:8000")


def test_the_system_resolver_runs_on_the_event_loop() -> None:
    addresses = asyncio.run(dns_resolver("ipv4")("localhost", 8000))
    assert "127.0.0.1" in addresses and all(":" not in address for address in addresses)
    with pytest.raises(OSError):
        asyncio.run(dns_resolver()("no-such-host.invalid", 8000))


def test_discovered_names_feed_the_model_pools() -> None:
    """`--discover-dns primary=... --discover-dns fallback=...`: each name's addresses join its pool, and
    the degrader sees them (its routing decision itself is tested on real servers in test_router_pools)."""
    port = free_port()
    answers = {"big-headless": ["127.0.0.2", "127.0.0.3"], "small-headless": ["127.0.0.4"]}

    async def resolve(host: str, port: int) -> Iterable[str]:
        return list(answers[host])

    config = build_config({"discover_interval": 3600.0, "health_interval": 0.05},
                          {"discover_dns": [f"big-headless:{port}", f"fallback=small-headless:{port}"]})
    assert [(target.host, target.pool) for target in config.discover_dns] == \
        [("big-headless", "primary"), ("small-headless", "fallback")]

    async def scenario() -> None:
        app = RouterApp(config, resolver=resolve)
        await app.startup()
        try:
            assert app.degrader is not None
            pools = {backend.name: backend.pool for backend in app.pool.backends}
            assert pools == {f"127.0.0.2:{port}": "primary", f"127.0.0.3:{port}": "primary",
                             f"127.0.0.4:{port}": "fallback"}
            # A fallback replica joins later: it lands in the fallback pool, never in the primary.
            answers["small-headless"].append("127.0.0.5")
            assert await app.discovery.refresh() == ([f"127.0.0.5:{port}"], [])  # type: ignore[union-attr]
            assert [backend.name for backend in app.degrader.members("fallback")] == \
                [f"127.0.0.4:{port}", f"127.0.0.5:{port}"]
            assert len(app.degrader.members("primary")) == 2
        finally:
            await app.shutdown()

    asyncio.run(scenario())


# ---- settings ----------------------------------------------------------------------------------------------

def test_discovery_settings_from_flags_and_file() -> None:
    args = build_parser().parse_args(["router", "--discover-dns", "titan-headless.default.svc.cluster.local:8000",
                                      "--discover-dns", "[fd00::1]:9000", "--discover-interval", "2",
                                      "--discover-family", "ipv4"])
    config = build_config({}, flag_settings(args))
    assert config.discover_dns == [TARGET, DnsTarget("fd00::1", 9000)]
    assert (config.discover_interval, config.discover_family, config.backends) == (2.0, "ipv4", [])
    # In a file, one name needs no list; flags replace the file's names.
    from_file = build_config({"discover_dns": "Titan-Headless:8000", "backends": ["http://a:1"]}, {})
    assert from_file.discover_dns == [DnsTarget("titan-headless", 8000)] and len(from_file.backends) == 1
    replaced = build_config({"discover_dns": ["a:1", "b:2"]}, {"discover_dns": ["c:3"]})
    assert replaced.discover_dns == [DnsTarget("c", 3)]


@pytest.mark.parametrize("settings,message", [
    ({"discover_dns": ["titan-headless"]}, "HOST:PORT"),
    ({"discover_dns": ["titan-headless:"]}, "HOST:PORT"),
    ({"discover_dns": ["titan-headless:http"]}, "bad discover_dns entry"),
    ({"discover_dns": ["titan-headless:70000"]}, "out of range"),
    ({"discover_dns": ["http://titan-headless:8000"]}, "without a scheme"),
    ({"discover_dns": ["titan-headless:8000/v1"]}, "without a scheme or path"),
    ({"discover_dns": ["bad host:8000"]}, "bad host name"),
    ({"discover_dns": [""]}, "HOST:PORT"),
    ({"discover_dns": [8000]}, "HOST:PORT"),
    ({"discover_dns": {"host": "a"}}, "string or a list"),
    ({"discover_dns": ["a:1", "a:1"]}, "more than once"),
    ({"discover_dns": ["a:1"], "discover_interval": 0}, "discover_interval must be positive"),
    ({"discover_dns": ["a:1"], "discover_family": "ipv5"}, "discover_family"),
    ({"discover_dns": []}, "no backends"),
    ({"discover_dns": ["canary=a:1"]}, "pool is primary or fallback"),
    ({"discover_dns": ["fallback=a:1"]}, "both need a backend or a DNS name"),
    ({"discover_dns": ["fallback=a:1", "b:2"], "pools": ["fallback=http://c:3"]}, None),
])
def test_bad_discovery_settings_are_rejected(settings: dict[str, object], message: str | None) -> None:
    if message is None:  # the control: a fallback name plus an unnamed one (primary) is a valid pair
        assert {target.pool for target in build_config(settings, {}).discover_dns} == {"primary", "fallback"}
        return
    with pytest.raises(ConfigError, match=message):
        build_config(settings, {})


# ---- real servers ------------------------------------------------------------------------------------------

def test_a_backend_that_leaves_dns_finishes_its_open_requests() -> None:
    """A uvicorn stub backend on 127.0.0.1 behind a router (also uvicorn) that discovers it through the seam."""
    stub = StubBackend("stub")
    backend_server = ServerThread(stub).start()
    name = f"127.0.0.1:{backend_server.port}"
    dns = FakeDns("127.0.0.1")
    config = discovering(discover_dns=[DnsTarget("titan-headless", backend_server.port)], discover_interval=0.05,
                         policy="round-robin")
    router_server = ServerThread(RouterApp(config, resolver=dns)).start()
    router = router_server.url
    try:
        wait_until(lambda: metric(router, "titan_router:backend_ready", backend=name) == 1)
        outcome: list[list[str]] = []

        def stream() -> None:
            with httpx.stream("POST", router + "/v1/completions", json={"prompt": "hi", "stream": True},
                              timeout=10) as reply:
                outcome.append([line for line in reply.iter_lines() if line])

        streaming = threading.Thread(target=stream)
        streaming.start()
        wait_until(lambda: metric(router, "titan_router:backend_outstanding", backend=name) == 1)
        dns.addresses = []  # the pod left the Service's endpoints
        wait_until(lambda: httpx.get(router + "/ready", timeout=5).status_code == 503)
        state = httpx.get(router + "/ready", timeout=5).json()["backends"]
        assert state == [{"name": name, "ready": False, "outstanding": 1,
                          "reason": "removed: no longer in the DNS answer for titan-headless:"
                                    f"{backend_server.port}"}]
        refused = httpx.post(router + "/v1/completions", json={"prompt": "hi"}, timeout=10)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "no_backend"
        assert len(stub.requests) == 1  # the new request never reached it
        stub.release.set()
        streaming.join(10)
        assert outcome and outcome[0][-1] == "data: [DONE]", outcome
        # The last open request ended: its series are gone with it.
        assert "backend=" not in httpx.get(router + "/metrics", timeout=5).text
        assert httpx.get(router + "/ready", timeout=5).json()["backends"] == []
        # Back in DNS: it rejoins after a readiness poll.
        dns.addresses = ["127.0.0.1"]
        wait_until(lambda: httpx.get(router + "/ready", timeout=5).status_code == 200)
        assert httpx.post(router + "/v1/completions", json={"prompt": "hi"}, timeout=10).status_code == 200
    finally:
        stub.release.set()
        router_server.stop()
        backend_server.stop()


def test_router_discovers_a_titan_server_through_localhost() -> None:
    """No static backends: `localhost` resolves (really) to 127.0.0.1, where one `titan serve` listens."""
    with ServerProcess(["--model", "default", "--max-num-batched-tokens", "64", "--max-num-seqs", "4",
                        "--kv-cache-memory", "0.1"], env={"OMP_NUM_THREADS": "1"}) as server:
        # ipv4: the server listens on 127.0.0.1 only; where localhost also resolves to ::1 that would be a
        # backend that never becomes ready.
        args = ["--discover-dns", f"localhost:{server.port}", "--discover-family", "ipv4",
                "--discover-interval", "0.5", "--health-interval", "0.2"]
        with RouterProcess([], args, min_ready=1) as router:
            reply = httpx.post(router.url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 2}, timeout=60)
            assert reply.status_code == 200, reply.text
            assert reply.json()["choices"][0]["text"]
            name = f"127.0.0.1:{server.port}"
            assert reply.headers["x-titan-router-backend"] == name
            assert metric(router.url, "titan_router:requests_total", backend=name) == 1
            assert metric(router.url, "titan_router:backend_ready", backend=name) == 1
            backends = httpx.get(router.url + "/ready", timeout=5).json()["backends"]
            assert [backend["name"] for backend in backends] == [name]
            assert f"discovering localhost:{server.port}" in router.log()
