"""`titan router` in front of real `titan serve` replicas: what prefix-affinity buys, and what a crash costs.

1. Prefix-cache hit rate per policy. Workload: `--groups` long shared prefixes (~190 tokens each, like a
   system prompt per application) x `--per-group` requests with a short distinct question, in rounds that
   ask every group once in a random order, sent by `--concurrency` clients through the router; max_tokens
   is 1. Each policy gets fresh prefixes. The rate is Δ`titan:prefix_cache_hits_total` /
   Δ`titan:prefix_cache_queries_total` summed over the replicas (tokens found in the cache / looked up).
2. Kill under load. `--kill-clients` closed-loop clients (half the requests streamed) through a
   prefix-affinity router over two replicas; after `--kill-after` s one replica gets SIGKILL; the load
   runs `--kill-duration` s in all. Counts requests that succeeded and, of those that failed, how many were
   streams already under way (the only kind allowed to fail), plus the router's retries.
3. TTFT tails per policy on a multi-prefix workload (`benchmarks/router_tails.py`, on fresh replicas with
   a KV cache that holds about half the prefixes): P50/P99 per policy, cold and warm, and the default
   policy's P99 against round-robin's.

Replicas: the default model, small step shapes, one torch thread each (`OMP_NUM_THREADS=1`: replicas share
this machine's cores).

    .venv/bin/python benchmarks/router.py [--servers 3] [--output benchmarks/results/router.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import router_tails
from common import write_result
from router_fleet import ROUTER_ARGS, SERVER_ARGS, SERVER_ENV, start_servers, stop_servers

from harness.router import RouterProcess
from harness.server import ServerProcess
from titan.bench.metrics_scraper import parse_prometheus_text

POLICIES = ("round-robin", "least-load", "prefix-affinity", "score")
PREFIX_BODY = ("You answer questions about the Lighthouse Hardware store. The store opens at eight and closes at "
               "six, sells tools, paint, garden supplies and fasteners, and offers key cutting, paint mixing and "
               "tool rental. Be brief, be friendly, and say when you do not know. ") * 2


def metric_sum(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(sample.value for sample in parse_prometheus_text(text) if sample.name == name)


def prefix_cache_counts(servers: list[ServerProcess]) -> tuple[float, float]:
    return (sum(metric_sum(server.url, "titan:prefix_cache_hits_total") for server in servers),
            sum(metric_sum(server.url, "titan:prefix_cache_queries_total") for server in servers))


def shared_prefix_prompts(tag: str, groups: int, per_group: int, seed: int = 0) -> list[str]:
    """`per_group` rounds; each round asks every group once, in a random order (a fixed order would let
    round-robin line groups up with backends whenever `groups` is a multiple of the replica count)."""
    order = random.Random(seed)
    prefixes = [f"Session {tag}-{group}. {PREFIX_BODY}" for group in range(groups)]
    prompts = []
    for index in range(per_group):
        for group in order.sample(range(groups), groups):
            prompts.append(f"{prefixes[group]}Question {index}: where is aisle {index + group}?")
    return prompts


def hit_rate_run(servers: list[ServerProcess], policy: str, prompts: list[str], concurrency: int) -> dict[str, Any]:
    with RouterProcess([server.url for server in servers], ["--policy", policy, *ROUTER_ARGS]) as router:
        hits_before, queries_before = prefix_cache_counts(servers)
        with httpx.Client(timeout=120) as client:
            def send(prompt: str) -> tuple[int, str]:
                reply = client.post(router.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1})
                return reply.status_code, reply.headers.get("x-titan-router-backend", "")

            started = time.perf_counter()
            with ThreadPoolExecutor(concurrency) as pool:
                replies = list(pool.map(send, prompts))
            seconds = time.perf_counter() - started
        time.sleep(0.5)  # the engine records the last step's counters after the response went out
        hits_after, queries_after = prefix_cache_counts(servers)
    per_backend: dict[str, int] = {}
    for _, backend in replies:
        per_backend[backend] = per_backend.get(backend, 0) + 1
    return {"hit_rate": (hits_after - hits_before) / max(queries_after - queries_before, 1.0),
            "hit_tokens": hits_after - hits_before, "queried_tokens": queries_after - queries_before,
            "succeeded": sum(1 for status, _ in replies if status == 200), "requests": len(prompts),
            "seconds": seconds, "requests_per_backend": sorted(per_backend.values(), reverse=True)}


def one_request(url: str, prompt: str, stream: bool, max_tokens: int) -> dict[str, Any]:
    outcome = {"stream": stream, "started": time.monotonic(), "ok": False, "began_streaming": False}
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": stream}
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as reply:
            if reply.status_code != 200:
                reply.read()
                return outcome
            if not stream:
                outcome["ok"] = bool(json.loads(reply.read())["choices"][0]["text"])
                return outcome
            for line in reply.iter_lines():
                if line == "data: [DONE]":
                    outcome["ok"] = True
                elif line.startswith("data: ") and "error" not in json.loads(line[6:]):
                    outcome["began_streaming"] = True
    except httpx.HTTPError:
        pass
    return outcome


def kill_run(servers: list[ServerProcess], clients: int, kill_after: float, duration: float,
             max_tokens: int) -> dict[str, Any]:
    survivor, victim = servers[:2]
    with RouterProcess([survivor.url, victim.url], ["--policy", "prefix-affinity", *ROUTER_ARGS]) as router:
        outcomes: list[dict[str, Any]] = []
        stopping = threading.Event()

        def client(index: int) -> None:
            count = 0
            while not stopping.is_set():
                prompt = f"Client {index}, request {count}: write a short poem about the sea."
                outcomes.append(one_request(router.url, prompt, (index + count) % 2 == 0, max_tokens))
                count += 1

        threads = [threading.Thread(target=client, args=(index,)) for index in range(clients)]
        for thread in threads:
            thread.start()
        time.sleep(kill_after)
        assert victim.process is not None
        victim.process.kill()
        killed = time.monotonic()
        time.sleep(max(0.0, duration - kill_after))
        stopping.set()
        for thread in threads:
            thread.join(120)
        retries = metric_sum(router.url, "titan_router:retries_total")
    failed = [outcome for outcome in outcomes if not outcome["ok"]]
    return {
        "requests": len(outcomes), "succeeded": len(outcomes) - len(failed), "failed": len(failed),
        "failed_streams_already_begun": sum(1 for o in failed if o["stream"] and o["began_streaming"]),
        "failed_before_streaming": sum(1 for o in failed if not (o["stream"] and o["began_streaming"])),
        "sent_after_kill": sum(1 for o in outcomes if o["started"] > killed),
        "router_retries": retries,
        "clients": clients, "kill_after_s": kill_after, "duration_s": duration, "max_tokens": max_tokens,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--servers", type=int, default=3)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--per-group", type=int, default=6)
    parser.add_argument("--concurrency", type=int, default=3)
    parser.add_argument("--kill-clients", type=int, default=4)
    parser.add_argument("--kill-after", type=float, default=3.0)
    parser.add_argument("--kill-duration", type=float, default=8.0)
    parser.add_argument("--kill-max-tokens", type=int, default=16)
    tails = parser.add_argument_group("3. TTFT tails per policy (benchmarks/router_tails.py)")
    router_tails.add_arguments(tails, servers=False)
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/router.json"))
    args = parser.parse_args()
    os.environ.setdefault("TITAN_CACHE_DIR", str(Path(__file__).resolve().parents[1] / ".titan-cache"))

    servers = start_servers(args.servers)
    try:
        hit_rates = {}
        for policy in POLICIES:
            prompts = shared_prefix_prompts(policy, args.groups, args.per_group)
            hit_rates[policy] = hit_rate_run(servers, policy, prompts, args.concurrency)
            print(f"{policy:>16}: prefix-cache hit rate {hit_rates[policy]['hit_rate']:.3f} "
                  f"({hit_rates[policy]['succeeded']}/{len(prompts)} ok, {hit_rates[policy]['seconds']:.1f} s, "
                  f"per backend {hit_rates[policy]['requests_per_backend']})", flush=True)
        kill = kill_run(servers, args.kill_clients, args.kill_after, args.kill_duration, args.kill_max_tokens)
        print(f"kill under load: {kill['succeeded']} of {kill['requests']} succeeded; failed: "
              f"{kill['failed_streams_already_begun']} streams already under way, {kill['failed_before_streaming']} "
              f"others; {kill['router_retries']:.0f} retried by the router", flush=True)
        # Fresh replicas: the kill took one down, and the tails must not start from warm caches.
        stop_servers(servers)
        servers = []
        tails = router_tails.run(args)
    finally:
        stop_servers(servers)
    result = {
        "workload": {"servers": args.servers, "groups": args.groups, "per_group": args.per_group,
                     "concurrency": args.concurrency, "prompt_chars": len(shared_prefix_prompts("x", 1, 1)[0]),
                     "server_args": SERVER_ARGS, "server_env": SERVER_ENV},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "prefix_cache_hit_rate": {policy: run["hit_rate"] for policy, run in hit_rates.items()},
        "hit_rate_runs": hit_rates,
        "kill_under_load": kill,
        "ttft_tails": tails,
    }
    write_result(args.output, result)


if __name__ == "__main__":
    main()
