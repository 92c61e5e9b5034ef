"""What the HTTP server costs over the offline engine: same workload, same engine flags.

Workload: 32 distinct prompts of ~150 tokens, 64 output tokens each (ignore_eos, greedy), as in
offline_throughput.py. Offline: `LLMEngine` stepped to completion in this process. HTTP: `titan serve`
in a child process, 32 concurrent streaming clients (httpx, SSE) sending at once. Each side runs
`--repeats` times after a warm-up; the best run counts (the machine is shared and noisy).

Reports output tokens/s of both and their ratio (target >= 0.9), mean engine step time offline and
inside the server (the price of sharing the GIL and the cores with the event loop), the server's RSS,
its cold start (spawn → /ready 200, and the server's own `titan:startup_seconds`), and what
tokenizing a prompt on the event loop costs.

    .venv/bin/python benchmarks/serving_overhead.py [--repeats 3] [--output benchmarks/results/serving_overhead.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import time
from pathlib import Path

import httpx
import torch
from common import make_prompts, write_result
from prometheus_client.parser import text_string_to_metric_families

from harness.server import ServerProcess
from titan.config_flags import engine_config
from titan.engine.llm_engine import LLMEngine
from titan.engine.sampling_params import SamplingParams

NUM_CLIENTS = 32
PROMPT_TOKENS = 150
OUTPUT_TOKENS = 64
# No prefix caching: repeated runs must prefill in full on both sides.
ENGINE_FLAGS = {"max_num_batched_tokens": 512, "max_num_seqs": 64, "enable_prefix_caching": False}


def run_offline(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> dict[str, float]:
    for prompt in prompts:
        engine.add_request(prompt, params)
    steps = []
    generated = 0
    started = time.perf_counter()
    while engine.has_unfinished_requests():
        step_started = time.perf_counter()
        outputs = engine.step()
        steps.append(time.perf_counter() - step_started)
        generated += sum(len(output.new_token_ids) for output in outputs)
    seconds = time.perf_counter() - started
    return {"seconds": seconds, "output_tokens": generated, "tokens_per_second": generated / seconds,
            "mean_step_ms": 1000 * statistics.fmean(steps), "steps": len(steps)}


async def one_stream(client: httpx.AsyncClient, prompt: list[int]) -> tuple[int, float, list[float]]:
    body = {"prompt": prompt, "max_tokens": OUTPUT_TOKENS, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    sent = time.perf_counter()
    arrivals = []
    tokens = 0
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            arrivals.append(time.perf_counter())
            if '"usage":{' in line:
                tokens = json.loads(line[6:])["usage"]["completion_tokens"]
    return tokens, arrivals[0] - sent, [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]


async def run_http(url: str, prompts: list[list[int]]) -> dict[str, float]:
    limits = httpx.Limits(max_connections=NUM_CLIENTS, max_keepalive_connections=NUM_CLIENTS)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        started = time.perf_counter()
        results = await asyncio.gather(*(one_stream(client, prompt) for prompt in prompts))
        seconds = time.perf_counter() - started
    generated = sum(tokens for tokens, _, _ in results)
    gaps = sorted(gap for _, _, request_gaps in results for gap in request_gaps)
    ttfts = sorted(ttft for _, ttft, _ in results)
    return {"seconds": seconds, "output_tokens": generated, "tokens_per_second": generated / seconds,
            "ttft_p50_ms": 1000 * ttfts[len(ttfts) // 2], "chunk_gap_p50_ms": 1000 * gaps[len(gaps) // 2],
            "chunk_gap_p99_ms": 1000 * gaps[int(len(gaps) * 0.99)]}


def server_metrics(url: str) -> dict[str, float]:
    values = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for sample in family.samples:
            if not sample.labels.get("le"):
                values[sample.name] = sample.value
    return values


def cpu_seconds(pid: int, thread_id: int | None = None) -> float:
    """user + system CPU time of a process, or of one of its threads (Linux /proc)."""
    path = f"/proc/{pid}/task/{thread_id}/stat" if thread_id else f"/proc/{pid}/stat"
    with open(path) as stat_file:
        fields = stat_file.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def tokenize_cost_us(engine: LLMEngine) -> dict[str, float]:
    """What a prompt's tokenization costs the event loop (it runs there for texts up to 8192 chars)."""
    sentence = "The history of computing is a story of people who wanted to calculate faster. "
    result = {}
    for name, text in (("240_chars", sentence * 3), ("2048_chars", sentence * 26), ("8000_chars", sentence * 100)):
        engine.tokenizer.encode(text)
        started = time.perf_counter()
        for _ in range(50):
            engine.tokenizer.encode(text)
        result[name] = 1e6 * (time.perf_counter() - started) / 50
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/serving_overhead.json"))
    args = parser.parse_args()

    engine = LLMEngine(engine_config("default", **ENGINE_FLAGS))
    engine.warmup()
    prompts = make_prompts(engine.tokenizer, NUM_CLIENTS, PROMPT_TOKENS)
    params = SamplingParams(max_tokens=OUTPUT_TOKENS, temperature=0, ignore_eos=True)
    run_offline(engine, prompts[:4], SamplingParams(max_tokens=4, temperature=0))  # warm caches/allocator
    tokenize = tokenize_cost_us(engine)

    flags = ["--model", "default", "--max-num-batched-tokens", str(ENGINE_FLAGS["max_num_batched_tokens"]),
             "--max-num-seqs", str(ENGINE_FLAGS["max_num_seqs"]), "--no-enable-prefix-caching"]
    offline_runs, http_runs = [], []
    with ServerProcess(flags) as server:
        cold_start = server.ready_seconds
        rss_ready = server.rss_bytes()
        asyncio.run(run_http(server.url, [prompt[:8] for prompt in prompts[:4]]))  # warm the HTTP path
        steps_before = server_metrics(server.url)
        pid = server.process.pid
        # The main thread runs the event loop (HTTP, JSON, SSE); the rest is the engine and torch.
        loop_cpu_before, process_cpu_before = cpu_seconds(pid, pid), cpu_seconds(pid)
        # Alternate the two so that the machine's background load hits both alike; the idle side
        # (a blocked engine thread, or an engine nobody steps) costs nothing meanwhile.
        for _ in range(args.repeats):
            offline_runs.append(run_offline(engine, prompts, params))
            http_runs.append(asyncio.run(run_http(server.url, prompts)))
            print(f"offline {offline_runs[-1]['tokens_per_second']:.1f} tok/s, "
                  f"http {http_runs[-1]['tokens_per_second']:.1f} tok/s", flush=True)
        steps_after = server_metrics(server.url)
        loop_cpu = cpu_seconds(pid, pid) - loop_cpu_before
        process_cpu = cpu_seconds(pid) - process_cpu_before
        rss_loaded = server.rss_bytes()
        startup_metric = steps_after.get("titan:startup_seconds", float("nan"))
    del engine

    step_count = steps_after["titan:engine_step_seconds_count"] - steps_before["titan:engine_step_seconds_count"]
    step_sum = steps_after["titan:engine_step_seconds_sum"] - steps_before["titan:engine_step_seconds_sum"]
    best_offline = max(offline_runs, key=lambda run: run["tokens_per_second"])
    best_http = max(http_runs, key=lambda run: run["tokens_per_second"])
    result = {
        "workload": {"clients": NUM_CLIENTS, "prompt_tokens": PROMPT_TOKENS, "output_tokens": OUTPUT_TOKENS,
                     "engine_flags": ENGINE_FLAGS, "repeats": args.repeats},
        "machine": {"cpus": torch.get_num_threads(), "platform": platform.platform()},
        "offline": best_offline,
        "http": best_http,
        "throughput_ratio": best_http["tokens_per_second"] / best_offline["tokens_per_second"],
        "median_throughput_ratio": (statistics.median(r["tokens_per_second"] for r in http_runs)
                                    / statistics.median(r["tokens_per_second"] for r in offline_runs)),
        "mean_step_ms": {"offline": best_offline["mean_step_ms"], "server": 1000 * step_sum / max(step_count, 1)},
        "event_loop_cpu": {"seconds": loop_cpu, "share_of_server_cpu": loop_cpu / process_cpu,
                           "us_per_streamed_token": 1e6 * loop_cpu / sum(r["output_tokens"] for r in http_runs)},
        "server_rss_mib": {"ready": rss_ready / 2**20, "after_load": rss_loaded / 2**20},
        "cold_start_seconds": {"spawn_to_ready": cold_start, "server_reported": startup_metric},
        "tokenize_on_event_loop_us": tokenize,
        "all_runs": {"offline": offline_runs, "http": http_runs},
    }
    summary_keys = ("throughput_ratio", "median_throughput_ratio", "mean_step_ms", "event_loop_cpu",
                    "server_rss_mib", "cold_start_seconds", "tokenize_on_event_loop_us")
    print(json.dumps({key: result[key] for key in summary_keys}, indent=2))
    print(f"offline {best_offline['tokens_per_second']:.1f} tok/s, http {best_http['tokens_per_second']:.1f} tok/s "
          f"(ratio {result['throughput_ratio']:.3f}); TTFT p50 {best_http['ttft_p50_ms']:.0f} ms, "
          f"chunk gap p50 {best_http['chunk_gap_p50_ms']:.1f} ms")
    write_result(args.output, result)


if __name__ == "__main__":
    main()
