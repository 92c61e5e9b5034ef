"""Admission under abuse: a 3x overload against a TTFT target, and a fan-out request beside short ones.

One server, its compute threads limited (OMP_NUM_THREADS, default 1) so capacity is low, started with
`--scheduling-policy slo --ttft-slo-ms 2000` and no explicit queue limits (the server derives them).

1. capacity: 32 of the workload's requests at once measure completed requests/s (batched);
2. overload: an open Poisson loop at 3x that rate for `--duration` s, half interactive (priority 0) and
   half batch (X-Titan-Priority: batch), streamed; for every request: status, TTFT, Retry-After and the
   wait the 429 message predicts;
3. fan-out: short requests in a closed loop; one `{"prompt": [200 strings], "n": 50}` request arrives in
   the middle: its status and latency, and the short requests' TTFT before and after it.

Checks (PASS/FAIL): admitted interactive TTFT P99 <= the target + one step (the P99 step of /debug/steps);
every Retry-After >= the wait its message predicts; zero 5xx; every accepted request completed; the
fan-out request refused with 400; the short requests' TTFT P50 after it within 1.5x of before.

    .venv/bin/python benchmarks/admission_overload.py [--duration 60] [--threads 1]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import numpy as np
from common import cpu_description, write_result

from harness.server import ServerProcess

PROMPT = "Write a short note about the history of lighthouses and the people who kept them. " * 3
PREDICTED = re.compile(r"predicted time to first token is (\d+) ms")


@dataclass
class Outcome:
    request_class: str
    status: int
    ttft: float | None = None  # seconds
    completed: bool = False
    retry_after: int | None = None
    predicted_wait: float | None = None  # seconds, from a 429 message


async def one(client: httpx.AsyncClient, request_class: str, max_tokens: int) -> Outcome:
    headers = {"X-Titan-Priority": request_class}
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    started = time.perf_counter()
    async with client.stream("POST", "/v1/completions", json=body, headers=headers) as response:
        outcome = Outcome(request_class, response.status_code)
        if response.status_code != 200:
            text = (await response.aread()).decode()
            if response.status_code == 429:
                outcome.retry_after = int(response.headers["Retry-After"])
                match = PREDICTED.search(text)
                outcome.predicted_wait = int(match.group(1)) / 1000 if match else None
            return outcome
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                choice = event["choices"][0] if event.get("choices") else {}
                if outcome.ttft is None and choice.get("text"):
                    outcome.ttft = time.perf_counter() - started
                if choice.get("finish_reason") == "length":
                    outcome.completed = True
    return outcome


async def capacity(url: str, max_tokens: int, count: int = 32) -> float:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        started = time.perf_counter()
        await asyncio.gather(*(one(client, "interactive", max_tokens) for _ in range(count)))
        return count / (time.perf_counter() - started)


async def overload(url: str, rate: float, duration: float, max_tokens: int, seed: int) -> list[Outcome]:
    rng = random.Random(seed)
    tasks = []
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=httpx.Limits(max_connections=1000)) as client:
        deadline = time.perf_counter() + duration
        while time.perf_counter() < deadline:
            request_class = "interactive" if rng.random() < 0.5 else "batch"
            tasks.append(asyncio.create_task(one(client, request_class, max_tokens)))
            await asyncio.sleep(rng.expovariate(rate))
        return list(await asyncio.gather(*tasks))


async def fan_out(url: str, max_tokens: int, rounds: int = 6) -> dict[str, object]:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        before = [await one(client, "interactive", max_tokens) for _ in range(rounds)]
        abuse = {"prompt": [f"word {i}" for i in range(200)], "n": 50, "max_tokens": 1}
        started = time.perf_counter()
        during_task = asyncio.create_task(one(client, "interactive", max_tokens))
        refused = await client.post("/v1/completions", json=abuse)
        refusal_seconds = time.perf_counter() - started
        during = [await during_task] + [await one(client, "interactive", max_tokens) for _ in range(rounds - 1)]
    ttft_before = float(np.median([o.ttft for o in before if o.ttft is not None]))
    ttft_after = float(np.median([o.ttft for o in during if o.ttft is not None]))
    return {"status": refused.status_code, "param": refused.json()["error"]["param"],
            "refusal_seconds": refusal_seconds, "short_ttft_p50_before": ttft_before,
            "short_ttft_p50_around": ttft_after, "ratio": ttft_after / ttft_before}


def p99(values: list[float]) -> float | None:
    return float(np.percentile(values, 99)) if values else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of overload")
    parser.add_argument("--overload", type=float, default=3.0, help="offered rate / measured capacity")
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of the server")
    parser.add_argument("--ttft-slo-ms", type=float, default=2000.0)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/admission_overload.json"))
    args = parser.parse_args()
    flags = ["--scheduling-policy", "slo", "--ttft-slo-ms", f"{args.ttft_slo_ms:g}"]
    with ServerProcess(flags, env={"OMP_NUM_THREADS": str(args.threads)}) as server:
        served = asyncio.run(capacity(server.url, args.max_tokens))
        rate = args.overload * served
        print(f"{cpu_description()}\ncapacity {served:.2f} req/s with {args.threads} thread(s); offering {rate:.2f}")
        outcomes = asyncio.run(overload(server.url, rate, args.duration, args.max_tokens, args.seed))
        steps = httpx.get(server.url + "/debug/steps", params={"limit": 2048}, timeout=30).json()["data"]
        fan = asyncio.run(fan_out(server.url, args.max_tokens))
    step_p99 = p99([s["duration"] for s in steps]) or 0.0
    admitted = [o for o in outcomes if o.status == 200]
    interactive_ttft = [o.ttft for o in admitted if o.request_class == "interactive" and o.ttft is not None]
    refused = [o for o in outcomes if o.status == 429]
    honest = [o for o in refused if o.predicted_wait is None or o.retry_after >= o.predicted_wait]
    target = args.ttft_slo_ms / 1000
    checks = {
        "interactive TTFT P99 <= target + one step": (p99(interactive_ttft) or 0.0) <= target + step_p99,
        "every Retry-After >= its predicted wait": len(honest) == len(refused),
        "zero 5xx": not any(o.status >= 500 for o in outcomes),
        "every accepted request completed": all(o.completed for o in admitted),
        "fan-out refused with 400": fan["status"] == 400,
        "short TTFT around the fan-out within 1.5x": fan["ratio"] <= 1.5,
    }
    summary = {
        "capacity_rps": served, "offered_rps": rate, "sent": len(outcomes), "admitted": len(admitted),
        "refused_429": len(refused), "by_status": {str(s): sum(o.status == s for o in outcomes)
                                                   for s in sorted({o.status for o in outcomes})},
        "interactive_ttft_p50": float(np.median(interactive_ttft)) if interactive_ttft else None,
        "interactive_ttft_p99": p99(interactive_ttft), "step_p99": step_p99,
        "retry_after_min_margin": min((o.retry_after - o.predicted_wait for o in refused
                                       if o.predicted_wait is not None), default=None),
        "fan_out": fan, "checks": checks,
    }
    print(json.dumps(summary, indent=2))
    for name, ok in checks.items():
        print(f"{'PASS' if ok else 'FAIL'}  {name}")
    write_result(args.output, {"config": vars(args) | {"output": str(args.output)}, "summary": summary,
                               "outcomes": [asdict(o) for o in outcomes]})
    if not math.isfinite(rate):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
