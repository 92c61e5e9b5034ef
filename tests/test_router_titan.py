"""`titan router` in front of three real `titan serve` processes on 127.0.0.1 (the default model each):
prefix-affinity raises the prefix-cache hit rate over round-robin; a draining backend gets no new
requests; killing a backend under load fails only streams that had already begun.

The servers start once for the module. The drain and kill tests each end one of them; `Fleet.alive`
restarts any that a previous test ended, so the tests pass in any order (fastest in file order).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from harness.router import RouterProcess
from harness.server import ServerProcess
from titan.bench.metrics_scraper import parse_prometheus_text
from titan.router.policies import PrefixAffinity
from titan.router.request_key import affinity_key

# Small step shapes keep warm-up short; a 0.1 GiB KV cache (~2300 tokens) holds every prefix used here.
SERVER_ARGS = ["--model", "default", "--max-num-batched-tokens", "64", "--max-num-seqs", "8",
               "--kv-cache-memory", "0.1", "--drain-timeout", "30"]
# Three servers share two cores: one thread each (oversubscribed thread pools slow everything ~10x).
SERVER_ENV = {"OMP_NUM_THREADS": "1"}
ROUTER_ARGS = ["--health-interval", "0.2"]


class Fleet:
    def __init__(self, size: int) -> None:
        self.servers = [ServerProcess(SERVER_ARGS, env=SERVER_ENV) for _ in range(size)]
        self.start(self.servers)

    @staticmethod
    def start(servers: list[ServerProcess]) -> None:
        threads = [threading.Thread(target=server.start) for server in servers]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        for server in servers:
            assert server.get_status("/ready") == 200, server.log()

    def alive(self) -> list[ServerProcess]:
        """All servers, any that a previous test ended replaced by a fresh one."""
        dead = [index for index, server in enumerate(self.servers)
                if server.process is None or server.process.poll() is not None]
        for index in dead:
            self.retire(self.servers[index])
            self.servers[index] = ServerProcess(SERVER_ARGS, env=SERVER_ENV)
        self.start([self.servers[index] for index in dead])
        return list(self.servers)

    @staticmethod
    def retire(server: ServerProcess) -> None:
        server.stop()
        if server.log_path is not None:
            server.log_path.unlink(missing_ok=True)

    def stop(self) -> None:
        for server in self.servers:
            self.retire(server)


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    fleet = Fleet(3)
    yield fleet
    fleet.stop()


def scrape(url: str) -> dict[str, float]:
    """A /metrics page as {name: sum over label sets} plus {"name|backend=B": value} where labelled so."""
    totals: dict[str, float] = {}
    for sample in parse_prometheus_text(httpx.get(url + "/metrics", timeout=10).text):
        keys = [sample.name] + ([f"{sample.name}|backend={sample.labels['backend']}"]
                                if "backend" in sample.labels else [])
        for key in keys:
            totals[key] = totals.get(key, 0.0) + sample.value
    return totals


def prefix_cache_counts(servers: list[ServerProcess]) -> tuple[float, float]:
    hits = queries = 0.0
    for server in servers:
        metrics = scrape(server.url)
        hits += metrics.get("titan:prefix_cache_hits_total", 0.0)
        queries += metrics.get("titan:prefix_cache_queries_total", 0.0)
    return hits, queries


def shared_prefix_prompts(tag: str, groups: int = 4, per_group: int = 5) -> list[str]:
    """`groups` long prefixes (~190 tokens, distinct from the first character), each followed by a short
    question; interleaved g0, g1, g2, g3, g0, ... as independent users would send them."""
    body = ("You answer questions about the Lighthouse Hardware store. The store opens at eight and closes "
            "at six, sells tools, paint, garden supplies and fasteners, and offers key cutting, paint mixing "
            "and tool rental. Be brief, be friendly, and say when you do not know. ") * 2
    prefixes = [f"Session {tag}-{group}. {body}" for group in range(groups)]
    return [f"{prefixes[group]}Question {index}: where is aisle {index + group}?"
            for index in range(per_group) for group in range(groups)]


def hit_rate(servers: list[ServerProcess], policy: str, prompts: list[str]) -> float:
    with RouterProcess([server.url for server in servers], ["--policy", policy, *ROUTER_ARGS]) as router:
        hits_before, queries_before = prefix_cache_counts(servers)
        for prompt in prompts:  # one at a time: concurrent twins would both miss before either is cached
            reply = httpx.post(router.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1}, timeout=60)
            assert reply.status_code == 200, reply.text
        time.sleep(0.3)  # the engine thread records the last step's counters after the response
        hits_after, queries_after = prefix_cache_counts(servers)
    assert queries_after > queries_before
    return (hits_after - hits_before) / (queries_after - queries_before)


def test_prefix_affinity_raises_the_prefix_cache_hit_rate(fleet: Fleet) -> None:
    servers = fleet.alive()
    # Fresh prefixes for each policy, so neither run finds the other's blocks cached.
    round_robin = hit_rate(servers, "round-robin", shared_prefix_prompts("rr"))
    affinity = hit_rate(servers, "prefix-affinity", shared_prefix_prompts("pa"))
    print(f"prefix-cache hit rate: round-robin {round_robin:.3f}, prefix-affinity {affinity:.3f}")
    # 4 prefixes x 5 requests on 3 backends: round-robin meets each prefix cold on every backend (3 of 5
    # miss), affinity once (1 of 5); ~87 % of each prompt is the prefix.
    assert affinity > round_robin + 0.2
    assert affinity > 0.6


def test_score_policy_finds_the_cached_prefix(fleet: Fleet) -> None:
    servers = fleet.alive()
    round_robin = hit_rate(servers, "round-robin", shared_prefix_prompts("rr2"))
    score = hit_rate(servers, "score", shared_prefix_prompts("sc"))
    print(f"prefix-cache hit rate: round-robin {round_robin:.3f}, score {score:.3f}")
    assert score > round_robin + 0.2
    assert score > 0.6


@dataclass
class Outcome:
    stream: bool
    started: float
    ok: bool = False
    began_streaming: bool = False  # at least one event had arrived
    backend: str | None = None
    error: str = ""


def run_request(url: str, prompt: str, stream: bool, max_tokens: int, chat: bool = False,
                began: threading.Event | None = None, hang_up: threading.Event | None = None) -> Outcome:
    """One completion (or chat completion), streamed or not, and what became of it. A stream sets `began`
    at its first content event and, once `hang_up` is set, closes the connection (as a user who gives up)."""
    outcome = Outcome(stream, time.monotonic())
    body: dict[str, object] = {"max_tokens": max_tokens, "ignore_eos": True, "stream": stream}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    path = "/v1/chat/completions" if chat else "/v1/completions"
    try:
        # Generous: a request retried onto a loaded survivor of a 2-core machine may take minutes; the test
        # is about whether it succeeds, never about how fast.
        with httpx.stream("POST", url + path, json=body, timeout=600) as reply:
            outcome.backend = reply.headers.get("x-titan-router-backend")
            if reply.status_code != 200:
                outcome.error = f"{reply.status_code} {reply.read()[:200]!r}"
                return outcome
            if not stream:
                choice = json.loads(reply.read())["choices"][0]
                outcome.ok = len(choice["message"]["content"] if chat else choice["text"]) > 0
                return outcome
            for line in reply.iter_lines():
                if line == "data: [DONE]":
                    outcome.ok = True
                elif line.startswith("data: "):
                    event = json.loads(line[6:])
                    if "error" in event:
                        outcome.error = event["error"]["message"]
                    else:
                        outcome.began_streaming = True
                        if began is not None:
                            began.set()
                if hang_up is not None and hang_up.is_set():
                    return outcome
            if not outcome.ok and not outcome.error:
                outcome.error = "stream ended without [DONE]"
    except (httpx.HTTPError, json.JSONDecodeError) as error:
        outcome.error = f"{type(error).__name__}: {error}"
    return outcome


class Load:
    """Closed-loop clients until stopped, alternately streaming chat (whose role delta Titan sends before
    the first token) and plain completions."""

    def __init__(self, url: str, clients: int, max_tokens: int) -> None:
        self.url = url
        self.max_tokens = max_tokens
        self.outcomes: list[Outcome] = []
        self.stopping = threading.Event()
        self.threads = [threading.Thread(target=self.client, args=(index,), daemon=True) for index in range(clients)]
        for thread in self.threads:
            thread.start()

    def client(self, index: int) -> None:
        count = 0
        while not self.stopping.is_set():
            prompt = f"Client {index}, request {count}: write a short poem about the sea."
            stream = (index + count) % 2 == 0
            self.outcomes.append(run_request(self.url, prompt, stream, self.max_tokens, chat=stream))
            count += 1

    def stop(self) -> list[Outcome]:
        self.stopping.set()
        for thread in self.threads:
            thread.join(120)
        return self.outcomes


def backend_state(router: RouterProcess, name: str) -> dict[str, object]:
    state = httpx.get(router.url + "/ready", timeout=5).json()
    return next(backend for backend in state["backends"] if backend["name"] == name)


def name_of(server: ServerProcess) -> str:
    return f"{server.host}:{server.port}"


def test_a_draining_backend_gets_no_new_requests(fleet: Fleet) -> None:
    servers = fleet.alive()
    victim = servers[2]
    with RouterProcess([server.url for server in servers], ["--policy", "least-load", *ROUTER_ARGS]) as router:
        # Two streams accepted before SIGTERM: `holder` keeps the victim draining until this test hangs up
        # (2,000 tokens against the 6 two-token requests below: bounded by counts, not by how fast decode
        # is), `accepted` must be finished in full (SIGTERM lets accepted requests finish).
        holder, accepted = HeldStream(victim.url, max_tokens=2000), HeldStream(victim.url, max_tokens=150)
        holder.began.wait(60)
        accepted.began.wait(60)
        assert holder.streaming() and accepted.streaming()
        victim.terminate()
        deadline = time.monotonic() + 5
        while backend_state(router, name_of(victim))["ready"]:
            assert time.monotonic() < deadline, "the router kept a draining backend in its pool"
            time.sleep(0.05)
        sent_before = scrape(router.url)[f"titan_router:requests_total|backend={name_of(victim)}"]
        outcomes = [run_request(router.url, f"Question {index}: what is {index} + 1?", stream=index % 2 == 0,
                                max_tokens=2) for index in range(6)]
        metrics = scrape(router.url)
        assert victim.process is not None and victim.process.poll() is None, "the drain ended early"
        assert not holder.finished.is_set(), "the holder's 2,000 tokens ended first: the test proves nothing"
        holder.hang_up.set()  # the server aborts it; the drain then ends once `accepted` is done
        accepted.finished.wait(120)
        holder.finished.wait(120)
    assert all(outcome.ok for outcome in outcomes), [outcome.error for outcome in outcomes]
    assert name_of(victim) not in {outcome.backend for outcome in outcomes}
    assert metrics[f"titan_router:requests_total|backend={name_of(victim)}"] == sent_before
    assert metrics["titan_router:retries_total"] == 0  # not even tried: it had left the pool
    # least-load read the survivors' queues from their /metrics.
    assert metrics[f"titan_router:backend_waiting|backend={name_of(servers[0])}"] >= 0
    assert accepted.outcome.ok, f"the draining backend must finish what it had accepted: {accepted.outcome.error}"
    assert victim.wait(60) == 0


class HeldStream(threading.Thread):
    """A streamed completion running in the background (run_request with `began` and `hang_up`)."""

    def __init__(self, url: str, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.url, self.max_tokens = url, max_tokens
        self.outcome = Outcome(True, time.monotonic())
        self.began, self.finished, self.hang_up = threading.Event(), threading.Event(), threading.Event()
        self.start()

    def run(self) -> None:
        try:
            self.outcome = run_request(self.url, "Tell me a long story.", stream=True, max_tokens=self.max_tokens,
                                       began=self.began, hang_up=self.hang_up)
        finally:
            self.finished.set()
            self.began.set()  # a request that failed before its first token leaves nobody waiting

    def streaming(self) -> bool:
        """Began streaming: still running (`began` came from a content event), or ended having streamed."""
        return not self.finished.is_set() or self.outcome.began_streaming


def test_killing_a_backend_under_load_fails_only_streams_already_begun(fleet: Fleet) -> None:
    survivor, victim = fleet.alive()[:2]
    names = [name_of(survivor), name_of(victim)]
    with RouterProcess([survivor.url, victim.url], ["--policy", "prefix-affinity", *ROUTER_ARGS]) as router:
        load = Load(router.url, clients=3, max_tokens=12)
        # A request that prefix-affinity certainly sends to the victim, open on it when it dies: it must be
        # retried on the survivor (3 load clients stay under the min_load of 4, so it cannot spill).
        ring = PrefixAffinity(names)
        sentinel_prompt = next(prompt for prompt in (f"Sentinel {index}: count to twenty." for index in range(100))
                               if ring.ring.owner(affinity_key(prompt, 256, 64)) == name_of(victim))
        sentinel: list[Outcome] = []
        # 400 tokens: still running when the kill follows its routing, on any machine (bounded by counts).
        sentinel_thread = threading.Thread(target=lambda: sentinel.append(
            run_request(router.url, sentinel_prompt, stream=False, max_tokens=400)))
        time.sleep(1.0)
        sentinel_thread.start()
        time.sleep(0.5)  # routed at once (the load's requests may also be outstanding there, so not only a poll)
        polls = 0
        while backend_state(router, name_of(victim))["outstanding"] < 1:
            polls += 1
            assert polls < 1000 and sentinel_thread.is_alive(), "the sentinel never reached the victim"
            time.sleep(0.02)
        assert sentinel_thread.is_alive()
        assert victim.process is not None
        victim.process.kill()
        killed = time.monotonic()
        sentinel_thread.join(600)
        time.sleep(2.0)  # load continues on the survivor
        outcomes = load.stop()
        metrics = scrape(router.url)
        assert not backend_state(router, name_of(victim))["ready"]
    failures = [outcome for outcome in outcomes if not outcome.ok]
    print(f"kill under load: {len(outcomes) - len(failures)} of {len(outcomes)} load requests succeeded, "
          f"{metrics['titan_router:retries_total']:.0f} retried; sentinel ok: {sentinel[0].ok}")
    assert sentinel and sentinel[0].ok and sentinel[0].backend == name_of(survivor), sentinel
    assert metrics[f"titan_router:retries_total|backend={name_of(victim)}"] >= 1
    for failure in failures:  # only streams cut after their first event, and only on the victim
        assert failure.stream and failure.began_streaming and failure.backend == name_of(victim), failure
        assert failure.started < killed
    assert sum(1 for outcome in outcomes if outcome.started > killed) > 0, "no load after the kill"
