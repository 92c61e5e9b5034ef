"""Prefill time with the opt-in bf32 GEMM for wide steps (TITAN_WIDE_BF32=1) against the integer kernels.

One `LLM` (the default model, no prefix cache, one whole-prompt step up to 2,048 tokens), prompts of random
token ids, each length timed with both paths in alternation within the same process (the host's noise
falls on both alike); each prompt is new, so nothing is cached. Prints the CPU and its flags: the bf32 path
multiplies on the AMX tiles where the CPU has them, in bfloat16 vector units with AVX512-BF16, and in
float32 elsewhere (slower than the integer kernels there).

    .venv/bin/python benchmarks/wide_bf32.py [--threads 1] [--lengths 96,128,256,512] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

from common import cpu_description, write_result

from titan import LLM, SamplingParams
from titan.kernels import ops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--lengths", default="96,128,256,512")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--output", default="benchmarks/results/wide_bf32.json")
    args = parser.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    print(f"{cpu_description()}; {args.threads} thread(s); bf32 from {ops.WIDE_BF32_MIN_ROWS} rows", flush=True)
    llm = LLM("default", threads=args.threads, max_num_batched_tokens=2048, enable_prefix_caching=False)
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    rng = random.Random(0)
    # Every prompt new and its tokens random: no prefix-cache hit, no repeated text.
    llm.generate([[rng.randrange(200, 40_000) for _ in range(300)]], params)  # warm-up
    rows = []
    for length in lengths:
        spent: dict[str, list[float]] = {"integer": [], "bf32": []}
        for _ in range(args.repeats):
            for name, enabled in (("integer", False), ("bf32", True)):
                os.environ[ops.WIDE_BF32_ENV] = "1" if enabled else "0"  # the opt-in itself, read afresh
                ops.wide_bf32.cache_clear()
                prompt = [rng.randrange(200, 40_000) for _ in range(length)]
                start = time.perf_counter()
                llm.generate([prompt], params)
                spent[name].append(time.perf_counter() - start)
        integer, bf32 = (1000 * statistics.median(spent[name]) for name in ("integer", "bf32"))
        rows.append({"tokens": length, "integer_ms": integer, "bf32_ms": bf32, "speedup": integer / bf32})
        print(f"{length:5d} tokens: integer {integer:7.1f} ms, bf32 {bf32:7.1f} ms, {integer / bf32:.2f}x", flush=True)
    write_result(args.output, {"cpu": cpu_description(), "threads": args.threads,
                               "min_rows": ops.WIDE_BF32_MIN_ROWS, "repeats": args.repeats, "lengths": rows})


if __name__ == "__main__":
    main()
