"""Prefill chunks of 17-64 rows through the native stack (short contexts) against SDPA and the layer path.

`titan.model.native_attention.takes_native` sends a chunk of up to 16 rows to the native attention kernel, and
since stop 54 one of up to 64 rows whose rows x context fits NATIVE_CHUNK_MAX_PAIRS too: the step then runs
in the native decoder stack. This times both rules side by side in one process, alternating per repeat: one
`LLM` (the default model, no prefix cache), prompts of random token ids, alone (one chunk) and prefilled in
chunks of `--chunks` tokens (`max_num_batched_tokens`), milliseconds per prompt.

    .venv/bin/python benchmarks/native_chunks.py [--threads 1] [--lone 20,32,64] [--long 256,1500]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

from common import cpu_description, write_result

import titan.model.native_attention as native_attention
from titan import LLM, SamplingParams
from titan.kernels.build import backend_name

RULE = native_attention.NATIVE_CHUNK_MAX_PAIRS


def side_by_side(llm: LLM, prompt: Callable[[], list[int]], repeats: int) -> tuple[float, float]:
    """Median ms of one prompt with 16-row chunks only (pair budget 0), then with the rule."""
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    spent: dict[int, list[float]] = {0: [], RULE: []}
    try:
        for _ in range(repeats):
            for pairs in spent:
                native_attention.NATIVE_CHUNK_MAX_PAIRS = pairs
                tokens = prompt()
                start = time.perf_counter()
                llm.generate([tokens], params)
                spent[pairs].append(time.perf_counter() - start)
    finally:
        native_attention.NATIVE_CHUNK_MAX_PAIRS = RULE
    return 1000 * statistics.median(spent[0]), 1000 * statistics.median(spent[RULE])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--lone", default="20,32,64", help="prompt lengths prefilled in one chunk")
    parser.add_argument("--long", default="256,1500", help="prompt lengths prefilled in chunks")
    parser.add_argument("--chunks", default="24,32,64")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--output", default="benchmarks/results/native_chunks.json")
    args = parser.parse_args()
    print(f"{cpu_description()}; {args.threads} thread(s); kernels {backend_name()}", flush=True)
    rng = random.Random(0)

    def prompt_of(length: int) -> Callable[[], list[int]]:
        return lambda: [rng.randrange(200, 40_000) for _ in range(length)]  # new each time: no cache hit

    rows = []
    budgets = [2048] + [int(n) for n in args.chunks.split(",")]
    for budget in budgets:
        llm = LLM("default", threads=args.threads, max_num_batched_tokens=budget, enable_prefix_caching=False)
        llm.generate([prompt_of(100)()], SamplingParams(max_tokens=1))  # warm-up
        lengths = args.lone if budget == 2048 else args.long
        for length in (int(n) for n in lengths.split(",")):
            before, after = side_by_side(llm, prompt_of(length), args.repeats)
            label = f"{length} tokens" + ("" if budget == 2048 else f" in chunks of {budget}")
            rows.append({"tokens": length, "chunk": min(budget, length), "sixteen_rows_ms": before,
                         "rule_ms": after, "speedup": before / after})
            print(f"{label:28s} 16 rows only {before:8.1f} ms, the rule {after:8.1f} ms: {before / after:.2f}x",
                  flush=True)
        del llm
    write_result(args.output, {"cpu": cpu_description(), "threads": args.threads, "max_pairs": RULE,
                               "repeats": args.repeats, "prompts": rows})


if __name__ == "__main__":
    main()
