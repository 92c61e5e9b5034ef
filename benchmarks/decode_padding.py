"""Decode step time when one long conversation joins a batch of short ones: bucketed vs padded attention.

One engine (default model), steps built directly on its runner: 16 decodes at context 128; 15 at 128
plus one at 4,000; the same mixed batch with bucketing turned off (every row padded to the longest
context, the pre-bucketing behaviour). Median of repeated steps, all measured in one run.

    .venv/bin/python benchmarks/decode_padding.py [--threads N] [--output FILE.json]
"""

from __future__ import annotations

import argparse
import statistics
import time

from common import cpu_description, write_result
from decode_attention import step  # one-token decodes at given contexts, built on the runner directly

from titan.config_flags import engine_config
from titan.engine.llm_engine import LLMEngine
from titan.engine.scheduler_output import SchedulerOutput
from titan.model import attention


def median_ms(engine: LLMEngine, output: SchedulerOutput, repeats: int) -> float:
    for _ in range(3):
        engine.runner.execute(output)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        engine.runner.execute(output)
        times.append(time.perf_counter() - started)
    return round(1000 * statistics.median(times), 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--output", default="benchmarks/results/decode_padding.json")
    args = parser.parse_args()
    engine = LLMEngine(engine_config(threads=args.threads))
    size = engine.config.cache.block_size
    short, mixed = step([128] * 16, size), step([128] * 15 + [4000], size)
    results = {"16 x ctx 128": median_ms(engine, short, args.repeats),
               "15 x ctx 128 + 1 x ctx 4000, bucketed": median_ms(engine, mixed, args.repeats)}
    attention.PAD_COLUMNS = 1 << 30  # pad every row to the longest context
    attention.PAD_SHARE = float("inf")
    results["15 x ctx 128 + 1 x ctx 4000, padded"] = median_ms(engine, mixed, args.repeats)
    print(cpu_description())
    for name, value in results.items():
        print(f"{name:42s} {value:8.2f} ms")
    write_result(args.output, {"cpu": cpu_description(), "threads": args.threads, "step_ms": results})


if __name__ == "__main__":
    main()
