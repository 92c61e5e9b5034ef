"""What the result and semantic caches buy on a repeated-prompt workload, and what a lookup costs on a miss.

1. Workload: `--num-requests` chat requests (greedy, streamed, `--max-tokens` each) sent open loop at a
   fixed `--request-rate`; each is an exact repeat of an earlier prompt (40%), a paraphrase of an earlier
   question (20%, from the tests' labelled pairs) or a new question (40%), drawn with `--seed`. The same
   sequence runs against three servers in turn, one run: caches off, exact (`--result-cache`), exact +
   semantic (`--result-cache --semantic-cache`, requests opting in). Reported: TTFT P50/P99 (first content
   chunk), engine tokens computed (Δ prompt + generation tokens on /metrics) and tokens saved.
2. Lookup overhead on a miss, in-process: the key (hash of body + token ids) plus a store get that misses,
   against the memory store holding 10,000 entries and against a private Redis on 127.0.0.1.

    .venv/bin/python benchmarks/caches.py [--num-requests 40] [--request-rate 1] \
        [--output benchmarks/results/caches.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import threading
import time
from typing import Any

import httpx
from common import cpu_description, write_result

from harness.redis import RedisProcess, redis_available
from harness.server import ServerProcess
from tests.semantic_pairs import PARAPHRASES
from titan.server.cache_store import MemoryStore, RedisStore
from titan.server.gateway_metrics import GatewayMetrics
from titan.server.result_cache import cache_key

SERVER_ARGS = ["--max-num-seqs", "8", "--kv-cache-memory", "0.1", "--no-warmup"]
CONFIGS = {"off": [], "exact": ["--result-cache"], "exact+semantic": ["--result-cache", "--semantic-cache"]}


def workload(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    fresh = [first for first, _ in PARAPHRASES] + [f"Tell me one fact about the number {i}." for i in range(count)]
    paraphrase_of = dict(PARAPHRASES)
    sent: list[str] = []
    out: list[str] = []
    for _ in range(count):
        roll = rng.random()
        pending = [q for q in sent if q in paraphrase_of and paraphrase_of[q] not in sent]
        if roll < 0.4 and sent:
            prompt = rng.choice(sent)
        elif roll < 0.6 and pending:
            prompt = paraphrase_of[rng.choice(pending)]
        else:
            prompt = fresh.pop(0)
        sent.append(prompt)
        out.append(prompt)
    return out


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


def run_config(name: str, flags: list[str], prompts: list[str], rate: float, max_tokens: int) -> dict[str, Any]:
    semantic = "--semantic-cache" in flags
    with ServerProcess([*SERVER_ARGS, *flags]) as server:
        before = metric(server.url, "titan:prompt_tokens_total") + metric(server.url, "titan:generation_tokens_total")
        ttfts: list[float] = []
        kinds: list[str] = []
        lock = threading.Lock()

        def one(prompt: str) -> None:
            body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0,
                    "stream": True}
            if semantic:
                body["titan_semantic_cache"] = True
            started = time.perf_counter()
            first = None
            with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=600) as reply:
                kind = reply.headers.get("x-titan-cache", "off")
                for line in reply.iter_lines():
                    if first is None and line.startswith("data: {"):
                        delta = json.loads(line[6:])["choices"]
                        if delta and (delta[0]["delta"].get("content") or delta[0].get("finish_reason")):
                            first = time.perf_counter() - started
            with lock:
                ttfts.append(first if first is not None else time.perf_counter() - started)
                kinds.append(kind)

        threads = []
        start = time.perf_counter()
        for index, prompt in enumerate(prompts):
            delay = start + index / rate - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            thread = threading.Thread(target=one, args=(prompt,))
            thread.start()
            threads.append(thread)
        for thread in threads:
            thread.join()
        computed = (metric(server.url, "titan:prompt_tokens_total")
                    + metric(server.url, "titan:generation_tokens_total") - before)
        saved = metric(server.url, "titan:cache_tokens_saved_total")
    result = {"config": name, "ttft_p50_ms": percentile(ttfts, 0.5) * 1000,
              "ttft_p99_ms": percentile(ttfts, 0.99) * 1000, "engine_tokens": computed, "tokens_saved": saved,
              "hits": kinds.count("hit"), "coalesced": kinds.count("coalesced"),
              "semantic_hits": kinds.count("semantic-hit"), "requests": len(prompts)}
    print(f"{name:>15}: TTFT P50 {result['ttft_p50_ms']:.0f} ms, P99 {result['ttft_p99_ms']:.0f} ms; engine tokens "
          f"{computed:.0f}, saved {saved:.0f}; hits {result['hits']}, coalesced {result['coalesced']}, semantic hits "
          f"{result['semantic_hits']}")
    return result


def lookup_overhead(samples: int) -> dict[str, Any]:
    body = {"messages": [{"role": "user", "content": "What is the capital of France? " * 4}], "max_tokens": 64,
            "temperature": 0}
    prompt = list(range(200))

    async def measure(store: Any) -> list[float]:
        for i in range(min(samples, 10000)):
            await store.set(f"filled-{i}", b"x" * 512, 300)
        times = []
        for i in range(samples):
            started = time.perf_counter()
            key = cache_key("tenant:a", "m", "chat.completion", body | {"seed": i}, [prompt], {})
            assert await store.get(key) is None
            times.append(time.perf_counter() - started)
        await store.close()
        return times

    out: dict[str, Any] = {}
    memory = asyncio.run(measure(MemoryStore(64 * 1024 * 1024)))
    out["memory"] = {"p50_ms": statistics.median(memory) * 1000, "p99_ms": percentile(memory, 0.99) * 1000}
    if redis_available():
        with RedisProcess() as redis:
            times = asyncio.run(measure(RedisStore(redis.url, GatewayMetrics())))
        out["redis"] = {"p50_ms": statistics.median(times) * 1000, "p99_ms": percentile(times, 0.99) * 1000}
    for name, figures in out.items():
        print(f"miss lookup ({name}): P50 {figures['p50_ms']:.3f} ms, P99 {figures['p99_ms']:.3f} ms")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=40)
    parser.add_argument("--request-rate", type=float, default=1.0)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--lookup-samples", type=int, default=2000)
    parser.add_argument("--output", default="benchmarks/results/caches.json")
    args = parser.parse_args()
    prompts = workload(args.num_requests, args.seed)
    print(f"{cpu_description()}; {len(prompts)} requests at {args.request_rate}/s, {len(set(prompts))} distinct")
    overhead = lookup_overhead(args.lookup_samples)
    runs = [run_config(name, flags, prompts, args.request_rate, args.max_tokens) for name, flags in CONFIGS.items()]
    write_result(args.output, {"cpu": cpu_description(), "args": vars(args), "runs": runs, "miss_lookup": overhead})


if __name__ == "__main__":
    main()
