"""Does a cold, big JSON schema stall other requests' steps? Worst step time with and without one arriving.

One server; background load: `--streams` streaming completions decoding all the time. Window A: the
load alone. Window B: the same load while `--schemas` requests, each with a distinct (never cached) large
JSON schema, arrive one after another. Both windows read the engine's own step records (/debug/steps):
the worst and P99 step durations, and how long each schema request took to its first token (its
compilation runs in a server worker thread, outside the engine's steps).

    .venv/bin/python benchmarks/structured_cold_schema.py [--streams 6] [--schemas 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

import httpx
import numpy as np
from common import cpu_description, write_result

from harness.server import ServerProcess


def big_schema(seed: int, fields: int = 60) -> dict[str, object]:
    """A nested object schema with many properties, enums and patterns: expensive to compile."""
    properties: dict[str, object] = {}
    for index in range(fields):
        kind = index % 4
        if kind == 0:
            properties[f"field_{seed}_{index}"] = {"type": "string", "pattern": f"^[a-z]{{{index % 7 + 1}}}[0-9]+$"}
        elif kind == 1:
            properties[f"field_{seed}_{index}"] = {"enum": [f"v{seed}_{index}_{k}" for k in range(12)]}
        elif kind == 2:
            properties[f"field_{seed}_{index}"] = {"type": "array", "items": {"type": "integer"}, "maxItems": 5}
        else:
            properties[f"field_{seed}_{index}"] = {"type": "object", "properties": {
                "x": {"type": "number"}, "y": {"type": "string", "maxLength": 16}}, "required": ["x"]}
    return {"type": "object", "properties": properties, "required": list(properties)[:10]}


async def stream_forever(client: httpx.AsyncClient, stop: asyncio.Event) -> None:
    body = {"prompt": "Count slowly from one to one thousand:", "max_tokens": 64, "ignore_eos": True, "stream": True}
    while not stop.is_set():
        async with client.stream("POST", "/v1/completions", json=body) as response:
            async for _ in response.aiter_lines():
                pass


async def window(url: str, streams: int, seconds: float, schemas: int) -> tuple[float, float, list[float]]:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        stop = asyncio.Event()
        load = [asyncio.create_task(stream_forever(client, stop)) for _ in range(streams)]
        await asyncio.sleep(2.0)  # the load reaches its steady batch
        started = time.time()
        first_tokens: list[float] = []
        for index in range(schemas):
            body = {"messages": [{"role": "user", "content": "Fill in the form."}], "max_tokens": 8,
                    "response_format": {"type": "json_schema",
                                        "json_schema": {"name": f"form{index}", "schema": big_schema(index + 100)}}}
            sent = time.perf_counter()
            reply = await client.post("/v1/chat/completions", json=body)
            assert reply.status_code == 200, reply.text
            first_tokens.append(time.perf_counter() - sent)
        await asyncio.sleep(max(0.0, seconds - (time.time() - started)))
        ended = time.time()
        stop.set()
        await asyncio.gather(*load)
        steps = (await client.get("/debug/steps", params={"limit": 2048})).json()["data"]
    durations = [s["duration"] for s in steps if started <= s["time"] <= ended]
    return max(durations), float(np.percentile(durations, 99)), first_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=6)
    parser.add_argument("--schemas", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=20.0, help="length of each window")
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/structured_cold_schema.json"))
    args = parser.parse_args()
    print(cpu_description())
    with ServerProcess(["--max-num-seqs", "16"]) as server:
        quiet_max, quiet_p99, _ = asyncio.run(window(server.url, args.streams, args.seconds, 0))
        cold_max, cold_p99, first_tokens = asyncio.run(window(server.url, args.streams, args.seconds, args.schemas))
    summary = {"without_schema": {"max_step_s": quiet_max, "p99_step_s": quiet_p99},
               "with_cold_schemas": {"max_step_s": cold_max, "p99_step_s": cold_p99,
                                     "schema_request_seconds": first_tokens},
               "max_step_ratio": cold_max / quiet_max}
    print(json.dumps(summary, indent=2))
    write_result(args.output, {"config": vars(args) | {"output": str(args.output)}, "summary": summary})


if __name__ == "__main__":
    main()
