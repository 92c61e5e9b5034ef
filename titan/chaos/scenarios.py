"""The chaos scenarios. Each starts its own router and replicas on 127.0.0.1, sends a bounded load, injects
its fault when a third of the requests went out and removes it at two thirds (counts, not times), and
returns one verdict row.

recovery s: from the fault's removal until the router has the faulty backend back in its pool (measured
by polling the router's /ready); P99 before / during: TTFT P99 of the requests sent before the fault and
while it was on.
"""

from __future__ import annotations

import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np

from titan.chaos.fleet import Proc, replica, router
from titan.chaos.load import OUTCOMES, LoadResult, run_load
from titan.chaos.tcp_proxy import FaultProxy

SERVER_ARGS = ["--max-num-batched-tokens", "64", "--max-num-seqs", "8", "--kv-cache-memory", "0.1",
               "--drain-timeout", "5"]
# A hung backend is found by timeouts: its health poll gives up after 1 s, a request after 15 s of silence
# (generous: replicas share a few cores with the load generator and with a restarting replica).
ROUTER_ARGS = ["--policy", "score", "--health-interval", "0.2", "--health-timeout", "1", "--read-timeout", "15",
               "--connect-timeout", "1", "--retries", "1"]

# Scenarios that test the engine, not the router's timeouts: a stalled stream there is slow, not hung.
PATIENT_ROUTER_ARGS = ["--policy", "score", "--health-interval", "0.2", "--health-timeout", "10", "--read-timeout",
                       "300", "--connect-timeout", "3", "--retries", "1"]


@dataclass
class Settings:
    requests: int = 30
    clients: int = 3
    max_tokens: int = 16


@dataclass
class Verdict:
    scenario: str
    counts: dict[str, int]
    sent: int
    recovery_s: float | None
    p99_before_ms: float | None
    p99_during_ms: float | None
    notes: list[str] = field(default_factory=list)
    ok: bool = True  # the scenario's own check (besides lost == 0)

    @property
    def lost(self) -> int:
        return self.counts["lost"]

    def to_json(self) -> dict[str, Any]:
        return {"scenario": self.scenario, "sent": self.sent, **self.counts, "recovery_s": self.recovery_s,
                "p99_before_ms": self.p99_before_ms, "p99_during_ms": self.p99_during_ms, "notes": self.notes,
                "ok": self.ok}


class Phases:
    """Calls `inject` as request `requests // 3` goes out and `heal` at `2 * requests // 3`."""

    def __init__(self, requests: int, inject: Callable[[], None] | None, heal: Callable[[], None] | None) -> None:
        self.inject_at, self.heal_at = requests // 3, 2 * requests // 3
        self.inject, self.heal = inject, heal
        self.injected_t: float | None = None
        self.healed_t: float | None = None
        self.lock = threading.Lock()

    def __call__(self, number: int) -> None:
        with self.lock:
            if number == self.inject_at and self.inject is not None:
                self.injected_t = time.monotonic()
                self.inject()
            elif number == self.heal_at and self.heal is not None:
                self.healed_t = time.monotonic()
                self.heal()


def p99_ms(values: list[float]) -> float | None:
    return round(float(np.percentile(np.asarray(values) * 1000, 99)), 1) if values else None


def verdict(name: str, load: LoadResult, phases: Phases | None, recovery: float | None) -> Verdict:
    counts = {outcome: load.count(outcome) for outcome in OUTCOMES}
    before, during = [], []
    for record in load.records:
        if record.ttft is None:
            continue
        if phases is None or phases.injected_t is None or record.started < phases.injected_t:
            before.append(record.ttft)
        elif phases.healed_t is None or record.started < phases.healed_t:
            during.append(record.ttft)
    notes = sorted({f"{record.outcome}: {record.detail}" for record in load.records
                    if record.outcome != "completed"})[:3]
    return Verdict(name, counts, len(load.records), recovery, p99_ms(before), p99_ms(during), notes)


def backend_ready(router_proc: Proc, name: str) -> bool:
    try:
        body = httpx.get(router_proc.url + "/ready", timeout=2).json()
    except (httpx.HTTPError, ValueError):
        return False
    return any(backend["name"] == name and backend["ready"] for backend in body.get("backends", []))


def wait_rejoined(router_proc: Proc, name: str, since: float, ceiling: float = 300.0) -> float | None:
    """Seconds from `since` until `name` is back in the router's pool (None: not within the ceiling)."""
    while time.monotonic() - since < ceiling:
        if backend_ready(router_proc, name):
            return round(time.monotonic() - since, 2)
        time.sleep(0.05)
    return None


class RejoinWatch:
    """Started when a fault is removed: polls the router until the backend is back, in its own thread, so the
    time is measured while the load still runs."""

    def __init__(self, router_proc: Proc, name: str) -> None:
        self.since = time.monotonic()
        self.seconds: float | None = None
        self.thread = threading.Thread(target=self.run, args=(router_proc, name), daemon=True)
        self.thread.start()

    def run(self, router_proc: Proc, name: str) -> None:
        self.seconds = wait_rejoined(router_proc, name, self.since)

    def result(self) -> float | None:
        self.thread.join()
        return self.seconds


def start_all(procs: list[Proc]) -> None:
    for proc in procs:
        proc.spawn()
    for proc in procs:
        proc.wait_ready()


class Fleet:
    """Replicas (some maybe behind fault proxies) and a router over them; stopped on exit."""

    def __init__(self, replicas: list[Proc], backend_urls: list[str] | None = None,
                 router_args: list[str] | None = None) -> None:
        self.replicas = replicas
        self.backend_urls = backend_urls
        self.router_args = router_args or ROUTER_ARGS
        self.router: Proc | None = None
        self.proxies: list[FaultProxy] = []

    def __enter__(self) -> Fleet:
        start_all(self.replicas)
        urls = self.backend_urls or [proc.url for proc in self.replicas]
        self.router = router(urls, self.router_args)
        self.router.spawn()
        self.router.wait_ready()
        for url in urls:  # every backend in the pool before the load starts
            name = url.split("://", 1)[1]
            if wait_rejoined(self.router, name, time.monotonic(), 120) is None:
                raise RuntimeError(f"backend {name} never joined the router's pool")
        return self

    def __exit__(self, *_: object) -> None:
        for proc in [*([self.router] if self.router else []), *self.replicas]:
            proc.stop()
        for proxy in self.proxies:
            proxy.stop()


def name_of(url: str) -> str:
    return url.split("://", 1)[1]


def replica_kill(settings: Settings) -> Verdict:
    replicas = [replica(SERVER_ARGS), replica(SERVER_ARGS)]
    with Fleet(replicas) as fleet:
        assert fleet.router is not None
        victim = replicas[1]
        watches: list[RejoinWatch] = []

        def heal() -> None:
            victim.spawn()  # the same port: the router's configured backend comes back
            assert fleet.router is not None
            watches.append(RejoinWatch(fleet.router, name_of(victim.url)))

        phases = Phases(settings.requests, victim.kill, heal)
        load = run_load(fleet.router.url, settings.requests, settings.clients, settings.max_tokens, phases)
        return verdict("replica-kill", load, phases, watches[0].result() if watches else None)


FREEZE_MAX_SECONDS = 60.0


def replica_freeze(settings: Settings) -> Verdict:
    replicas = [replica(SERVER_ARGS), replica(SERVER_ARGS)]
    with Fleet(replicas) as fleet:
        assert fleet.router is not None
        victim = replicas[1]
        watches: list[RejoinWatch] = []

        def heal() -> None:
            assert fleet.router is not None
            # Stay frozen until the router's health poll has timed out on it (an event, not a sleep: the
            # requests that reach the heal point may all have gone to the survivor within the timeout),
            # bounded so a router that never notices fails the check instead of hanging the suite.
            deadline = time.monotonic() + FREEZE_MAX_SECONDS
            while backend_ready(fleet.router, name_of(victim.url)) and time.monotonic() < deadline:
                time.sleep(0.05)
            victim.signal(signal.SIGCONT)
            watches.append(RejoinWatch(fleet.router, name_of(victim.url)))

        phases = Phases(settings.requests, lambda: victim.signal(signal.SIGSTOP), heal)
        load = run_load(fleet.router.url, settings.requests, settings.clients, settings.max_tokens, phases)
        result = verdict("replica-freeze", load, phases, watches[0].result() if watches else None)
        errors = metric_total(fleet.router.url, "titan_router:errors_total", 'reason="timeout"')
        log = fleet.router.log()
        ejected = sum(1 for line in log.splitlines() if "left the pool" in line and "Timeout" in line)
        result.notes.insert(0, f"the router took the frozen backend out on a poll timeout {ejected} time(s); "
                               f"requests that timed out on it: {errors:g}")
        result.ok = ejected > 0
        return result


def slow_link(settings: Settings) -> Verdict:
    replicas = [replica(SERVER_ARGS), replica(SERVER_ARGS)]
    proxy = FaultProxy("127.0.0.1", replicas[1].port).start()
    fleet = Fleet(replicas, [replicas[0].url, proxy.url])
    fleet.proxies.append(proxy)
    with fleet:
        assert fleet.router is not None
        watches: list[RejoinWatch] = []

        def heal() -> None:
            proxy.set_faults()
            assert fleet.router is not None
            watches.append(RejoinWatch(fleet.router, name_of(proxy.url)))

        phases = Phases(settings.requests, lambda: proxy.set_faults(delay=0.05, drop=0.2), heal)
        load = run_load(fleet.router.url, settings.requests, settings.clients, settings.max_tokens, phases)
        result = verdict("slow-link", load, phases, watches[0].result() if watches else None)
        result.notes.insert(0, f"connections or chunks dropped by the proxy: {proxy.dropped}")
        return result


def metric_total(url: str, name: str, label: str = "") -> float:
    try:
        text = httpx.get(url + "/metrics", timeout=5).text
    except httpx.HTTPError:
        return float("nan")
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and label in line)


def kv_exhaustion(settings: Settings) -> Verdict:
    # A pool of ~14 blocks (~220 tokens) for up to 8 sequences of up to 16 + 96 tokens: preemption storms.
    tiny = ["--max-num-batched-tokens", "64", "--max-num-seqs", "8", "--kv-cache-memory", "0.01"]
    replicas = [replica(tiny)]
    with Fleet(replicas, router_args=PATIENT_ROUTER_ARGS) as fleet:
        assert fleet.router is not None
        phases = Phases(settings.requests, None, None)

        def tokens(number: int) -> int:  # short outputs first, then long ones that cannot all fit
            return settings.max_tokens if number < phases.inject_at else 96

        phases.inject = lambda: None
        load = run_load(fleet.router.url, settings.requests, max(settings.clients, 6), tokens, phases)
        result = verdict("kv-exhaustion", load, phases, None)
        preemptions = metric_total(replicas[0].url, "titan:num_preemptions_total")
        result.notes.insert(0, f"preemptions: {preemptions:g}")
        result.ok = preemptions > 0 and result.counts["completed"] == result.sent
        return result


def step_failure(settings: Settings) -> Verdict:
    # Every 40th step with work fails on one replica (titan/engine/fault_injection.py); the other is healthy.
    replicas = [replica(SERVER_ARGS), replica(SERVER_ARGS, env={"TITAN_TEST_FAIL_STEP_EVERY": "40"})]
    with Fleet(replicas) as fleet:
        assert fleet.router is not None
        load = run_load(fleet.router.url, settings.requests, settings.clients, settings.max_tokens)
        result = verdict("step-failure", load, None, None)
        faulty = replicas[1]
        still_serving = httpx.post(faulty.url + "/v1/completions", timeout=60,
                                   json={"prompt": "Hi", "max_tokens": 2}).status_code
        failures = sum(1 for _ in open(faulty.log_path, errors="replace") if "injected failure" in _) \
            if faulty.log_path else 0
        result.notes.insert(0, f"injected step failures logged: {failures}; the faulty replica then answered "
                               f"HTTP {still_serving}")
        result.ok = still_serving in (200, 500)  # 500: the check itself hit an injected failure; it still serves
        return result


def slow_client(settings: Settings) -> Verdict:
    replicas = [replica(SERVER_ARGS)]
    with Fleet(replicas, router_args=PATIENT_ROUTER_ARGS) as fleet:
        assert fleet.router is not None
        server, router = replicas[0], fleet.router
        baseline_rss = server.rss_bytes()
        sockets: list[socket.socket] = []
        body = (b'{"prompt": "Write a very long story.", "max_tokens": 512, "stream": true, "ignore_eos": true}')

        def stall() -> None:  # from a third of the load on: clients that send a request and never read it
            for _ in range(4):
                sock = socket.create_connection(("127.0.0.1", router.port))
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                             b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
                sockets.append(sock)

        phases = Phases(settings.requests, stall, None)
        try:
            load = run_load(router.url, settings.requests, settings.clients, settings.max_tokens, phases)
            grown = (server.rss_bytes() - baseline_rss) / 2**20
        finally:
            for sock in sockets:
                sock.close()
        result = verdict("slow-client", load, phases, None)
        # The other requests: their TTFT P99 before the stalled streams and while they hang (the columns);
        # they share the batch with four 512-token streams nobody reads, so some slowing is the extra work.
        result.notes.insert(0, f"server RSS grew {grown:.0f} MiB with 4 stalled streams")
        result.ok = grown < 256 and result.counts["completed"] == result.sent
        return result


SCENARIOS: dict[str, Callable[[Settings], Verdict]] = {
    "replica-kill": replica_kill,
    "replica-freeze": replica_freeze,
    "slow-link": slow_link,
    "kv-exhaustion": kv_exhaustion,
    "step-failure": step_failure,
    "slow-client": slow_client,
}
