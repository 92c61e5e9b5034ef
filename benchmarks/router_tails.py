"""TTFT tails per routing policy on a multi-prefix workload, through `titan router` over real replicas.

Workload: `--prefixes` distinct `--prefix-words`-word prefixes (like one long system prompt per
application), each request one of them picked at random plus a short distinct question, streamed with
`--max-tokens` output tokens, sent open loop at `--rate` req/s (Poisson arrivals) until `--requests` went
out. TTFT is the client's: send to the first content event. Each policy gets fresh prefixes (no cache
carried over) and the same arrival times and prefix picks.

Each replica's KV cache (`--kv-cache-memory`, 0.03 GiB of the float16 default, ~1,400 tokens) holds about
half the prefixes, as a production pool holds a share of its applications' prompts. Two phases per policy,
each its own row:
- cold: the fleet has never seen the prefixes, so each one's first request computes it whatever the policy
  (a floor no routing removes: a 400-word prefill on one thread);
- warm (`--phases cold warm`): the same schedule with new questions, after the cold phase, so every prefix has
  been sent once through this policy's router. That is the steady state of a fleet serving a fixed set of
  system prompts, and what routing changes: where each prefix's later requests land.

    .venv/bin/python benchmarks/router_tails.py [--servers 3] [--policies score round-robin] [--phases cold warm]

`benchmarks/router.py` runs it too, as its third part.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from common import write_result
from router_fleet import ROUTER_ARGS, SERVER_ENV, server_args, start_servers, stop_servers

from harness.router import RouterProcess
from harness.server import ServerProcess

WORDS = ("store tool paint garden supply fastener key cutting mixing rental aisle shelf price order customer "
         "delivery hammer drill screw bolt nut washer hinge lock chain rope ladder bucket brush roller tape "
         "glue saw blade wrench pliers clamp level ruler pencil glove mask boot hose sprinkler seed soil "
         "fertilizer mulch shovel rake hoe wheelbarrow lamp bulb switch socket cable wire fuse battery").split()


# ~1,400 tokens of float32 KV for SmolLM2-135M: about three of the ~470-token prompts.
KV_CACHE_GIB = 0.03


def make_prefix(tag: str, number: int, words: int) -> str:
    chooser = random.Random(f"{tag}-{number}")
    body = " ".join(chooser.choice(WORDS) for _ in range(words))
    return f"Application {tag}-{number}. You answer questions using these notes: {body}. "


def plan(requests: int, prefixes: int, rate: float, seed: int) -> list[tuple[float, int]]:
    """(send offset in seconds, prefix number) per request: the same for every policy."""
    chooser = random.Random(seed)
    offsets, at = [], 0.0
    for _ in range(requests):
        offsets.append((at, chooser.randrange(prefixes)))
        at += chooser.expovariate(rate)
    return offsets


def stream_ttft(url: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    sent = time.perf_counter()
    outcome: dict[str, Any] = {"ok": False, "ttft": None, "backend": None}
    body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as reply:
            outcome["backend"] = reply.headers.get("x-titan-router-backend")
            if reply.status_code != 200:
                reply.read()
                outcome["status"] = reply.status_code
                return outcome
            for line in reply.iter_lines():
                if line == "data: [DONE]":
                    outcome["ok"] = outcome["ttft"] is not None
                elif line.startswith("data: "):
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        return outcome
                    if outcome["ttft"] is None and chunk["choices"][0].get("text"):
                        outcome["ttft"] = time.perf_counter() - sent
    except httpx.HTTPError as error:
        outcome["error"] = str(error)
    return outcome


def send_schedule(url: str, schedule: list[tuple[float, int]], prefixes: list[str], max_tokens: int,
                  phase: str) -> list[dict[str, Any]]:
    """Sends the schedule open loop (a thread per request) and waits for every answer."""
    outcomes: list[dict[str, Any]] = [{} for _ in schedule]
    threads = []
    started = time.perf_counter()
    for index, (offset, prefix) in enumerate(schedule):
        time.sleep(max(0.0, started + offset - time.perf_counter()))
        prompt = f"{prefixes[prefix]}Question {phase}-{index}: which aisle has item {index}?"

        def send(index: int = index, prompt: str = prompt) -> None:
            outcomes[index] = stream_ttft(url, prompt, max_tokens)

        thread = threading.Thread(target=send)
        thread.start()
        threads.append(thread)
    for thread in threads:
        thread.join()
    return outcomes


def summarize_phase(policy: str, schedule: list[tuple[float, int]], outcomes: list[dict[str, Any]]) -> dict[str, Any]:
    ttfts = np.asarray([o["ttft"] for o in outcomes if o.get("ok")]) * 1000
    per_backend: dict[str, int] = {}
    for outcome in outcomes:
        per_backend[str(outcome.get("backend"))] = per_backend.get(str(outcome.get("backend")), 0) + 1
    return {"policy": policy, "requests": len(schedule), "succeeded": int(len(ttfts)),
            "failed": len(schedule) - int(len(ttfts)),
            "ttft_p50_ms": float(np.percentile(ttfts, 50)) if len(ttfts) else None,
            "ttft_p99_ms": float(np.percentile(ttfts, 99)) if len(ttfts) else None,
            "ttft_max_ms": float(ttfts.max()) if len(ttfts) else None,
            "requests_per_backend": sorted(per_backend.values(), reverse=True),
            # Per request, in send order: when it went out, its prefix, where it went, its TTFT (ms).
            "requests_detail": [{"offset_s": round(offset, 3), "prefix": prefix, "backend": outcome.get("backend"),
                                 "ttft_ms": None if outcome.get("ttft") is None else round(outcome["ttft"] * 1000, 1)}
                                for (offset, prefix), outcome in zip(schedule, outcomes, strict=True)]}


def policy_run(servers: list[ServerProcess], policy: str, schedule: list[tuple[float, int]], prefix_words: int,
               max_tokens: int, phases: tuple[str, ...] = ("cold",)) -> dict[str, dict[str, Any]]:
    """One router with `policy` over the replicas; the schedule once per phase, in order (cold first)."""
    prefixes = [make_prefix(policy, number, prefix_words) for number in range(max(p for _, p in schedule) + 1)]
    results = {}
    with RouterProcess([server.url for server in servers], ["--policy", policy, *ROUTER_ARGS]) as router:
        for phase in phases:
            results[phase] = summarize_phase(policy, schedule, send_schedule(router.url, schedule, prefixes,
                                                                              max_tokens, phase))
    return results


def run(args: argparse.Namespace, servers: list[ServerProcess] | None = None) -> dict[str, Any]:
    """Every policy over the same schedule; on `servers` if given (left running), else on fresh ones."""
    schedule = plan(args.requests, args.prefixes, args.rate, args.seed)
    own = servers is None
    servers = start_servers(args.servers, kv_cache_gib=args.kv_cache_memory) if servers is None else servers
    phases = tuple(args.phases)
    runs: dict[str, dict[str, dict[str, Any]]] = {phase: {} for phase in phases}
    try:
        for policy in args.policies:
            for phase, result in policy_run(servers, policy, schedule, args.prefix_words, args.max_tokens,
                                            phases).items():
                runs[phase][policy] = result
                print(f"{phase:>5} {policy:>16}: TTFT P50/P99 {result['ttft_p50_ms']:.0f} / "
                      f"{result['ttft_p99_ms']:.0f} ms (max {result['ttft_max_ms']:.0f}), "
                      f"{result['succeeded']}/{result['requests']} ok, per backend {result['requests_per_backend']}",
                      flush=True)
    finally:
        if own:
            stop_servers(servers)
    ratios: dict[str, dict[str, float]] = {}
    for phase, by_policy in runs.items():
        baseline = by_policy.get("round-robin", {}).get("ttft_p99_ms")
        ratios[phase] = {policy: baseline / run["ttft_p99_ms"] for policy, run in by_policy.items()
                         if baseline and run.get("ttft_p99_ms")}
        for policy, ratio in ratios[phase].items():
            print(f"{phase:>5} {policy:>16}: P99 {ratio:.2f}x better than round-robin", flush=True)
    return {"workload": {key: getattr(args, key) for key in ("servers", "prefixes", "prefix_words", "requests",
                                                              "rate", "max_tokens", "seed", "phases",
                                                              "kv_cache_memory")},
            "server_args": server_args(args.kv_cache_memory) if own else None, "server_env": SERVER_ENV,
            "runs": runs,
            "p99_speedup_vs_round_robin": ratios}


def add_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup, servers: bool = True) -> None:
    if servers:  # benchmarks/router.py has its own
        parser.add_argument("--servers", type=int, default=3)
    parser.add_argument("--prefixes", type=int, default=6)
    parser.add_argument("--prefix-words", type=int, default=400)
    parser.add_argument("--requests", type=int, default=36)
    parser.add_argument("--rate", type=float, default=0.5)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--policies", nargs="+", default=["round-robin", "prefix-affinity", "score"])
    parser.add_argument("--kv-cache-memory", type=float, default=KV_CACHE_GIB,
                        help="each replica's KV cache in GiB: at the default a replica holds about half the "
                             "prefixes, so a router that keeps each prefix in one place keeps hitting while one "
                             "that spreads them evicts (the fleet's own 0.2 holds all of them everywhere)")
    parser.add_argument("--phases", nargs="+", choices=("cold", "warm"), default=["cold", "warm"],
                        help="cold: the prefixes never seen; warm: the schedule again, every prefix seen once")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_arguments(parser)
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/router_tails.json"))
    args = parser.parse_args()
    os.environ.setdefault("TITAN_CACHE_DIR", str(Path(__file__).resolve().parents[1] / ".titan-cache"))
    result = run(args)
    result["machine"] = {"cpus": os.cpu_count(), "platform": platform.platform()}
    write_result(args.output, result)


if __name__ == "__main__":
    main()
