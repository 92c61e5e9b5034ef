"""Decode steps with the 512-bit kernel that pairs row groups against the 256-bit one, by batch width.

On AVX-512 CPUs the interleaved integer kernels multiply a step's rows against two groups of 8 weight rows
at a time in 512-bit registers, or one group in 256-bit registers; the numbers are the same either way, the
speed is not (a 512-bit op costs two 256-bit ones on Zen 4). `TITAN_WIDE_ROWS` (default auto: every step on
Intel, from 16 rows elsewhere) picks the width from which steps pair groups. This times both kernels on this CPU
side by side in one process: one `LLM` (the default model, no prefix cache), batches of 8-token prompts of
random ids decoding `--tokens` tokens each, the two kernels alternating per repeat (the host's noise falls
on both alike), as milliseconds per decode step (a batch's wall time over its tokens, prefill included).

    .venv/bin/python benchmarks/wide_rows.py [--threads 1] [--batches 1,2,3,4,8,12,15] [--repeats 3]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from common import cpu_description, write_result

from titan import LLM, SamplingParams
from titan.kernels.build import native

NEVER = 1 << 30  # a row count no step reaches: every step takes the 256-bit kernel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batches", default="1,2,3,4,8,12,15")
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", default="benchmarks/results/wide_rows.json")
    args = parser.parse_args()
    module = native()
    if module is None or "avx512f" not in module.cpu_features():
        raise SystemExit(f"{cpu_description()}: no AVX-512 native kernels here, so no 512-bit kernel to compare")
    default = module.set_wide_rows(0)
    print(f"{cpu_description()}; {args.threads} thread(s); 512-bit from {default} rows by default", flush=True)
    llm = LLM("default", threads=args.threads, enable_prefix_caching=False)
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    rng = random.Random(0)

    def prompts(count: int) -> list[list[int]]:
        return [[rng.randrange(200, 40_000) for _ in range(8)] for _ in range(count)]

    llm.generate(prompts(4), params)  # warm-up
    rows = []
    try:
        for batch in (int(n) for n in args.batches.split(",")):
            spent: dict[str, list[float]] = {"paired": [], "single": []}
            for _ in range(args.repeats):
                for name, from_rows in (("paired", 1), ("single", NEVER)):
                    module.set_wide_rows(from_rows)
                    start = time.perf_counter()
                    llm.generate(prompts(batch), params)
                    spent[name].append((time.perf_counter() - start) / args.tokens)
            paired, single = (1000 * statistics.median(spent[name]) for name in ("paired", "single"))
            rows.append({"batch": batch, "paired_ms": paired, "single_ms": single, "speedup": single / paired})
            print(f"batch {batch:3d}: 512-bit pairs {paired:6.1f} ms a step, 256-bit {single:6.1f} ms: "
                  f"{single / paired:.2f}x", flush=True)
    finally:
        module.set_wide_rows(0)
    write_result(args.output, {"cpu": cpu_description(), "threads": args.threads, "default_wide_rows": default,
                               "tokens": args.tokens, "repeats": args.repeats, "batches": rows})


if __name__ == "__main__":
    main()
