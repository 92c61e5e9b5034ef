"""Speculative decoding side by side: off vs ngram (adaptive) vs ngram (fixed k), same build, one run.

Three servers on the default model run at once (idle ones cost nothing); every workload goes to each
in turn, so all configurations see the same machine state:
- copy-heavy: repeat / proofread a given passage (the output repeats spans of the input), greedy;
  single stream and 16 concurrent; and "rewrite" (the earlier set: short passages and code, some with a
  title to add), where the default model writes much new text, single stream;
- open-ended chat (low acceptance), sampled with a seed per request; single stream and 16 concurrent;
- the burst: 32 x (~150 in, 64 out) sent at once.
`--configs "off control,..."` adds a second speculation-off server, whose ratio to off shows how far
two identical configurations read apart in the same sitting. Per run:
output tok/s, TPOT P50/P99 (per-request time per output token), chunk ITL P50/P99 (gaps
between streamed chunks; a chunk carries several tokens when drafts were accepted), acceptance (from the
server's spec_decode metrics), the share of output words that repeat the prompt ("copied"), and whether
every output equals the speculation-off output (greedy and seeded requests must). No smaller model with
SmolLM2's tokenizer ships offline, so the draft-model row is the default model drafting for itself: exact,
never faster, and a test that the adaptive rule counts a draft model's own cost and turns speculation off
instead of losing.

    .venv/bin/python benchmarks/speculative.py [--threads N] [--quick] [--rounds R] [--workloads A,B]
                                              [--configs C,D] [--output FILE.json]

With `--rounds R` every workload runs R times, the servers' order rotating each round; a config's ratio
to off is taken within each round (the two measured minutes apart, not tens of minutes) and reported as
the median with its range, so the machine's drift does not pass for a speed-up. Single-stream workloads
go to all servers request by request (request i to each server in turn, then request i + 1), so the
configurations compared are measured seconds apart, not minutes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import statistics
import time
from typing import Any

from common import cpu_description, write_result

from harness.server import ServerProcess
from titan.bench.client import RequestResult, make_client, send_request

CONFIGS: dict[str, dict[str, Any] | None] = {
    "off": None,
    # A second speculation-off server: its ratio to off is the noise floor of the sitting (two identical
    # servers measured seconds apart differed by up to 13 % in one 8-second run of open-ended x16).
    "off control": None,
    "ngram adaptive": {"method": "ngram", "num_speculative_tokens": 4},
    # The adaptive rule chooses how many of up to 8 drafts each step verifies.
    "ngram adaptive k<=8": {"method": "ngram", "num_speculative_tokens": 8},
    "ngram fixed k=4": {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False},
    "ngram fixed k=8": {"method": "ngram", "num_speculative_tokens": 8, "adaptive": False},
    # No smaller model with SmolLM2's tokenizer ships offline: the default model drafting for itself
    # shows the adaptive rule weighing a draft model's cost (it should turn itself off, not lose).
    "self-draft adaptive": {"method": "draft_model", "model": "default", "num_speculative_tokens": 4},
}
# Copy-heavy: passages the default model does repeat when asked to (0.97-1.0 of its output words inside
# 3-grams of the prompt; the benchmark prints that share). SmolLM2-135M rewrites some passages instead
# (one on photosynthesis: 0.25), rewrites code instead of copying it and writes new text after a title:
# such prompts are the separate "rewrite" workload, the copy-heavy set of earlier versions.
PASSAGES = [
    "The lighthouse stood at the edge of the cliff for two hundred years. Every night its keeper climbed the "
    "spiral stairs, trimmed the wick and polished the great lens until the beam reached far out to sea. Ships "
    "passing in the dark counted its flashes to know where they were. In winter the storms threw spray over the "
    "lantern room, and the keeper wrote each one into a logbook that is still kept in the village library.",
    "The night train leaves the capital at ten and reaches the coast by dawn. Passengers in the sleeping cars "
    "are woken with coffee and a warm roll an hour before arrival. From the window they can watch the fields "
    "give way to pine forests and then to dunes. At the last station a bus waits to take travellers to the "
    "harbour, where the ferries to the islands leave every two hours.",
    "Dear Maria, thank you for your letter and for the photographs of the garden. The roses look wonderful this "
    "year, and I can hardly believe how tall the apple tree has grown. We are planning to visit in the second "
    "week of June, if that suits you. Please let me know whether we should bring anything for the house. With "
    "love, Anna.",
    "To fix a flat bicycle tyre, first remove the wheel and let out any remaining air. Use two tyre levers to "
    "lift one side of the tyre off the rim, then pull out the inner tube. Find the hole by pumping a little air "
    "into the tube and listening for the hiss. Patch it, put the tube back, seat the tyre and pump it up.",
]
COPY_TASKS = ["Repeat the following text exactly, word for word:\n\n{}",
              "Correct any spelling mistakes in the following text and write it out in full:\n\n{}"]
# Rewrite: the earlier copy-heavy set (short passages and code, a title added), where about half of the
# default model's output is new text; prompt lookup has nothing to draft there.
REWRITE_PASSAGES = [
    "The lighthouse stood at the edge of the cliff for two hundred years. Every night its keeper climbed "
    "the spiral stairs, trimmed the wick and polished the great lens until the beam reached far out to sea.",
    "Photosynthesis converts light energy into chemical energy. In the chloroplasts, water is split, oxygen "
    "is released, and the energy captured is stored in glucose molecules built from carbon dioxide.",
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n\n"
    "def factorial(n):\n    result = 1\n    for i in range(2, n + 1):\n        result *= i\n    return result\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"
    "        self.items.append(item)\n\n    def pop(self):\n        return self.items.pop()\n",
]
REWRITE_TASKS = ["Repeat the following text exactly, word for word:\n\n{}",
                 "Rewrite the following, keeping every sentence, and add a title at the top:\n\n{}"]
OPEN_PROMPTS = ["Write a short story about a dragon who learns to bake bread.",
                "What are three good habits for staying healthy? Explain each.",
                "Describe a city on Mars one hundred years from now.",
                "Give me advice for my first day at a new job.",
                "Why is the sky blue? Explain it to a ten-year-old.",
                "Invent a new board game and explain its rules.",
                "Write a letter to a friend you have not seen in years.",
                "What would happen if cats could talk?"]
BURST_TEXT = ("The history of computing is a story of people who wanted to calculate faster. From the abacus to "
              "mechanical calculators, from vacuum tubes to transistors, each step made machines smaller, "
              "cheaper and more reliable. ")


def session_messages(session: str, content: str) -> list[dict[str, str]]:
    """A user turn behind a system prompt naming the session: each round sends prompts no server has seen,
    so a repeated round measures prefill again instead of hitting the prefix cache."""
    return [{"role": "system", "content": f"You are a helpful assistant. Session {session}."},
            {"role": "user", "content": content}]


def copy_bodies(count: int, session: str = "0", passages: list[str] = PASSAGES,
                tasks: list[str] = COPY_TASKS) -> list[dict[str, Any]]:
    prompts = [task.format(passage) for passage in passages for task in tasks]
    return [{"messages": session_messages(session, prompts[i % len(prompts)]), "max_tokens": 128,
             "temperature": 0.0} for i in range(count)]


def rewrite_bodies(count: int, session: str = "0") -> list[dict[str, Any]]:
    return copy_bodies(count, session, REWRITE_PASSAGES, REWRITE_TASKS)


def copied_share(bodies: list[dict[str, Any]], texts: dict[int, str]) -> float | None:
    """The share of output words inside a run of 3 or more words that also occurs in the request's prompt:
    how much of the output prompt lookup could have drafted."""
    covered = total = 0
    for index, text in texts.items():
        prompt = bodies[index]["messages"][-1]["content"].split()
        grams = {tuple(prompt[i:i + 3]) for i in range(len(prompt) - 2)}
        words = text.split()
        inside = [False] * len(words)
        for i in range(len(words) - 2):
            if tuple(words[i:i + 3]) in grams:
                inside[i:i + 3] = [True] * 3
        covered, total = covered + sum(inside), total + len(words)
    return round(covered / total, 3) if total else None


def open_bodies(count: int, session: str = "0") -> list[dict[str, Any]]:
    return [{"messages": session_messages(session, OPEN_PROMPTS[i % len(OPEN_PROMPTS)]), "max_tokens": 96,
             "temperature": 0.8, "seed": i} for i in range(count)]


def burst_bodies(count: int, session: str = "0") -> list[dict[str, Any]]:
    return [{"messages": session_messages(session, f"Document {i}: " + BURST_TEXT * 4 + "Summarize it."),
             "max_tokens": 64, "temperature": 0.0, "ignore_eos": True, "min_tokens": 64} for i in range(count)]


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


MODEL = "SmolLM2-135M-Instruct.Q4_1"


async def stream_one(client: Any, url: str, index: int, body: dict[str, Any], start: float) -> RequestResult:
    result = RequestResult(index, "bench", 0, body["max_tokens"], time.perf_counter() - start)
    full = {**body, "model": MODEL, "stream": True, "stream_options": {"include_usage": True}}
    await send_request(client, url, full, result, start)
    return result


def unseen(body: dict[str, Any]) -> dict[str, Any]:
    """`body` behind a system prompt no server has seen. Asked again as it was, a request after a
    concurrent load reads the prompt's KV from the prefix cache, computed in whatever chunks and batches
    that load's timing made; those differ in the last bits, and a near-tie can then flip a token (two
    speculation-off servers differ so). Computed from scratch, alone, the text is the request's own."""
    system, *rest = body["messages"]
    return {**body, "messages": [{**system, "content": system["content"] + " Exactness check."}, *rest]}


async def reply_texts(client: Any, url: str, bodies: list[dict[str, Any]]) -> dict[int, str]:
    """The text of each (deterministic) request, for the exactness check: asked again alone, without
    streaming, on a prompt the load did not leave in the prefix cache."""
    texts = {}
    for index, body in enumerate(bodies[:8]):
        reply = await client.post(url, json={**unseen(body), "model": MODEL})
        texts[index] = reply.json()["choices"][0]["message"]["content"]
    return texts


def load_summary(results: list[RequestResult], wall: float, texts: dict[int, str]) -> dict[str, Any]:
    ok = [r for r in results if r.success]
    tokens = sum(r.completion_tokens or 0 for r in ok)
    tpots = [r.tpot for r in ok if r.tpot is not None]
    itls = [gap for r in ok for gap in r.itls]
    return {"requests": len(results), "failed": len(results) - len(ok), "output_tokens": tokens,
            "wall_s": round(wall, 2), "output_tok_s": round(tokens / wall, 2),
            "tpot_ms_p50": ms(percentile(tpots, 50)), "tpot_ms_p99": ms(percentile(tpots, 99)),
            "itl_ms_p50": ms(percentile(itls, 50)), "itl_ms_p99": ms(percentile(itls, 99)), "texts": texts}


async def run_load(server: ServerProcess, bodies: list[dict[str, Any]], concurrency: int) -> dict[str, Any]:
    limit = asyncio.Semaphore(concurrency)
    url = server.url + "/v1/chat/completions"
    async with make_client(600.0) as client:
        start = time.perf_counter()

        async def one(index: int, body: dict[str, Any]) -> RequestResult:
            async with limit:
                return await stream_one(client, url, index, body, start)

        results = await asyncio.gather(*(one(i, body) for i, body in enumerate(bodies)))
        wall = time.perf_counter() - start
        texts = await reply_texts(client, url, bodies)
    return load_summary(list(results), wall, texts)


async def run_paired(servers: dict[str, ServerProcess], bodies: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """A single stream to every server at once, request by request: request i goes to each server in turn
    (the order rotating per request) before request i + 1, so every configuration's requests are spread
    over the same seconds and the machine's drift falls on all of them alike. A server's wall time is
    the sum of its own requests' times."""
    names = list(servers)
    results: dict[str, list[RequestResult]] = {name: [] for name in names}
    walls = dict.fromkeys(names, 0.0)
    async with make_client(600.0) as client:
        for index, body in enumerate(bodies):
            shift = index % len(names)
            for name in names[shift:] + names[:shift]:
                began = time.perf_counter()
                results[name].append(await stream_one(client, servers[name].url + "/v1/chat/completions", index,
                                                      body, began))
                walls[name] += time.perf_counter() - began
        texts = {name: await reply_texts(client, server.url + "/v1/chat/completions", bodies)
                 for name, server in servers.items()}
    return {name: load_summary(results[name], walls[name], texts[name]) for name in names}


def ms(seconds: float | None) -> float:
    return float("nan") if seconds is None else round(1000 * seconds, 2)


def spec_counters(server: ServerProcess) -> tuple[float, float]:
    def total(name: str) -> float:
        return sum(sample.value for sample in server.metric_samples(name))
    return (total("titan:spec_decode_num_draft_tokens_total"), total("titan:spec_decode_num_accepted_tokens_total"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=None, help="--threads of every server (default: all cores)")
    parser.add_argument("--server-args", default="", help="extra flags for every server, e.g. "
                                                          "'--scheduling-policy fcfs'")
    parser.add_argument("--quick", action="store_true", help="fewer requests (a smoke run)")
    parser.add_argument("--rounds", type=int, default=1, help="repeat every workload, servers in rotating order")
    parser.add_argument("--workloads", default=None, help="comma-separated subset of the workload names")
    parser.add_argument("--configs", default=None, help="comma-separated configurations (off always runs)")
    parser.add_argument("--output", default="benchmarks/results/speculative.json")
    args = parser.parse_args()
    configs = dict(CONFIGS)
    if args.configs:
        wanted = subset(parser, "configs", args.configs, CONFIGS)
        configs = {name: CONFIGS[name] for name in CONFIGS if name == "off" or name in wanted}
    scale = 4 if args.quick else 1
    workloads = {
        "copy-heavy x1": (lambda session: copy_bodies(8 // scale, session), 1),
        "copy-heavy x16": (lambda session: copy_bodies(32 // scale, session), 16),
        "rewrite x1": (lambda session: rewrite_bodies(8 // scale, session), 1),
        "open-ended x1": (lambda session: open_bodies(8 // scale, session), 1),
        "open-ended x16": (lambda session: open_bodies(32 // scale, session), 16),
        "burst 32": (lambda session: burst_bodies(32, session), 32),
    }
    if args.workloads:
        workloads = {name: workloads[name] for name in subset(parser, "workloads", args.workloads, workloads)}
    common_args = ([] if args.threads is None else ["--threads", str(args.threads)]) + shlex.split(args.server_args)
    servers = {}
    try:
        for name, spec in configs.items():
            extra = [] if spec is None else ["--speculative-config", json.dumps(spec)]
            servers[name] = ServerProcess(common_args + extra).start()
        # Warm every server (and the adaptive cost model) on a few requests that are not measured.
        for server in servers.values():
            asyncio.run(run_load(server, copy_bodies(2, "warm-up") + open_bodies(2, "warm-up"), 2))
        rows: dict[str, dict[str, list[dict[str, Any]]]] = {}
        names = list(servers)
        for workload, (make_bodies, concurrency) in workloads.items():
            for round_index in range(args.rounds):
                bodies = make_bodies(f"{workload} {round_index}")
                shift = round_index % len(names)
                order = names[shift:] + names[:shift]
                if concurrency == 1:
                    measured = measure_paired({name: servers[name] for name in order}, bodies)
                else:
                    measured = {name: measure(servers[name], bodies, concurrency) for name in order}
                for name in order:
                    result = measured[name]
                    result["copied"] = copied_share(bodies, result["texts"])
                    rows.setdefault(workload, {}).setdefault(name, []).append(result)
                    print(f"{workload:15s} {name:20s} {result['output_tok_s']:7.1f} tok/s  "
                          f"TPOT {result['tpot_ms_p50']:6.1f}/{result['tpot_ms_p99']:6.1f} ms  "
                          f"ITL {result['itl_ms_p50']:6.1f}/{result['itl_ms_p99']:6.1f} ms  "
                          f"acceptance {result['acceptance']}  copied {result['copied']}  failed {result['failed']}",
                          flush=True)
    finally:
        for server in servers.values():
            server.stop()
    summary = {workload: summarize(by_config) for workload, by_config in rows.items()}
    print(f"\n{cpu_description()}  ({args.rounds} round{'s' if args.rounds > 1 else ''}; ratio: median of "
          f"per-round ratios to off [range])\n{'workload':15s} {'config':20s} {'tok/s':>7s} {'x off':>6s} "
          f"{'range':>11s} {'accept':>6s} {'copied':>6s} same")
    for workload, by_config in summary.items():
        for name, result in by_config.items():
            acceptance = "-" if result["acceptance"] is None else result["acceptance"]
            low, high = result["speedup_range"]
            print(f"{workload:15s} {name:20s} {result['output_tok_s']:7.1f} {result['speedup']:6.2f} "
                  f"{low:5.2f}-{high:<5.2f} {acceptance:>6} {result['copied']!s:>6} {result['outputs_identical']}")
    write_result(args.output, {"cpu": cpu_description(), "threads": args.threads, "rounds": args.rounds,
                               "results": summary})


def subset(parser: argparse.ArgumentParser, what: str, text: str, known: dict[str, Any]) -> list[str]:
    """The comma-separated names of `text`, each one of `known` (else the parser's usage error)."""
    wanted = [name.strip() for name in text.split(",")]
    unknown = [name for name in wanted if name not in known]
    if unknown:
        parser.error(f"unknown {what} {unknown}; known: {', '.join(known)}")
    return wanted


def with_acceptance(result: dict[str, Any], before: tuple[float, float], after: tuple[float, float]) -> dict[str, Any]:
    """The result with the acceptance its server's spec-decode counters saw between `before` and `after`."""
    drafts, accepted = after[0] - before[0], after[1] - before[1]
    result["acceptance"] = round(accepted / drafts, 3) if drafts else None
    result["draft_tokens"] = int(drafts)
    return result


def measure(server: ServerProcess, bodies: list[dict[str, Any]], concurrency: int) -> dict[str, Any]:
    """One run of a workload on one server."""
    before = spec_counters(server)
    result = asyncio.run(run_load(server, bodies, concurrency))
    return with_acceptance(result, before, spec_counters(server))


def measure_paired(servers: dict[str, ServerProcess], bodies: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """One single-stream run of a workload on every server, request by request (run_paired)."""
    before = {name: spec_counters(server) for name, server in servers.items()}
    results = asyncio.run(run_paired(servers, bodies))
    return {name: with_acceptance(results[name], before[name], spec_counters(server))
            for name, server in servers.items()}


def summarize(by_config: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per config: median tok/s, the median and range of its per-round ratios to off, pooled acceptance,
    and whether every round's outputs equal off's."""
    base = by_config["off"]
    summary = {}
    for name, runs in by_config.items():
        ratios = [run["output_tok_s"] / off["output_tok_s"] for run, off in zip(runs, base, strict=True)]
        drafts = sum(run["draft_tokens"] for run in runs)
        accepted = sum((run["acceptance"] or 0.0) * run["draft_tokens"] for run in runs)
        summary[name] = {
            "output_tok_s": round(statistics.median(run["output_tok_s"] for run in runs), 2),
            "speedup": round(statistics.median(ratios), 3),
            "speedup_range": [round(min(ratios), 3), round(max(ratios), 3)],
            "acceptance": round(accepted / drafts, 3) if drafts else None,
            "copied": statistics.median(run["copied"] for run in runs) if runs[0]["copied"] is not None else None,
            "outputs_identical": all(run["texts"] == off["texts"] for run, off in zip(runs, base, strict=True)),
            "runs": [{key: value for key, value in run.items() if key != "texts"} for run in runs],
        }
    return summary


if __name__ == "__main__":
    main()
