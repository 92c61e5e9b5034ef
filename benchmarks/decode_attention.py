"""Decode step time and the attention share of it: the native paged attention kernel vs the PyTorch path.

One engine (default model); steps built directly on its runner, the runner's `native_attention` flag
flipped between consecutive steps, so both paths see the same machine state (this machine is noisy): a
single decode at contexts 128, 1024 and 4096, 16 decodes at 128, and a 5-row speculative verify chunk at
1024. Per case, the median step time and the median time inside `paged_attention` (all layers). Then
single-stream inter-token latency through the engine (prompt of `context` tokens, 24 greedy tokens), the
two paths taking turns request by request.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/decode_attention.py --threads 1 [--repeats N] [--output F]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from common import cpu_description, timed, write_result
from decode_latency import single_stream_gaps

from titan.config_flags import engine_config
from titan.engine.llm_engine import LLMEngine
from titan.engine.sampling_params import SamplingParams
from titan.engine.scheduler_output import ScheduledSequence, SchedulerOutput
from titan.model import llama

PATHS = ("torch", "native")


def step(contexts: list[int], block_size: int, verify_rows: int = 0) -> SchedulerOutput:
    """One-token decodes at the given contexts (or, with verify_rows, one sequence verifying that many
    tokens: the runner lays them out as one-token rows on one table)."""
    greedy = SamplingParams(max_tokens=1, temperature=0.0)
    scheduled, next_block = [], 0
    for index, context in enumerate(contexts):
        blocks = -(-context // block_size)
        table = list(range(next_block, next_block + blocks))
        next_block += blocks
        rows = max(1, verify_rows)
        drafts = [5] * (rows - 1)
        scheduled.append(ScheduledSequence(index, [5] * rows, context - rows, table, True, greedy,
                                           [5] * (context - rows + 1), [], draft_token_ids=drafts))
    return SchedulerOutput(scheduled=scheduled)


def measure(engine: LLMEngine, output: SchedulerOutput, repeats: int) -> dict[str, dict[str, float]]:
    """Median step and attention milliseconds per path, the paths alternating step by step."""
    runner, spent = engine.runner, [0.0]
    samples: dict[str, tuple[list[float], list[float]]] = {path: ([], []) for path in PATHS}
    original = llama.paged_attention
    llama.paged_attention = timed(original, spent)
    try:
        for index in range(2 * (repeats + 2)):
            path = PATHS[index % 2]
            runner.native_attention = path == "native"
            spent[0] = 0.0
            started = time.perf_counter()
            runner.execute(output)
            elapsed = time.perf_counter() - started
            if index >= 4:  # two warm-up steps per path
                samples[path][0].append(elapsed)
                samples[path][1].append(spent[0])
    finally:
        llama.paged_attention = original
    return {path: {"step_ms": round(1e3 * statistics.median(steps), 3),
                   "attention_ms": round(1e3 * statistics.median(attention), 3)}
            for path, (steps, attention) in samples.items()}


def itl_ms(engine: LLMEngine, context: int, tokens: int = 24) -> float:
    """Median milliseconds between consecutive tokens of one greedy request with a `context`-token prompt
    (the first gap, right after the prefill, left out)."""
    return statistics.median(single_stream_gaps(engine, context, tokens + 1)[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--itl-rounds", type=int, default=2, help="requests per path and context (0: skip)")
    parser.add_argument("--output", default="benchmarks/results/decode_attention.json")
    args = parser.parse_args()
    engine = LLMEngine(engine_config(threads=args.threads))
    native_default = engine.runner.native_attention
    if not native_default:
        raise SystemExit("the native attention kernel is not available here (see titan.kernels.native_error())")
    size = engine.config.cache.block_size
    # Random K/V in the blocks the steps read (the pool is allocated uninitialized).
    generator = torch.Generator().manual_seed(0)
    for key_cache, value_cache in engine.runner.kv_caches:
        key_cache[: 16 * 128 + 4096 + size].normal_(generator=generator)
        value_cache[: 16 * 128 + 4096 + size].normal_(generator=generator)
    cases = {f"1 decode @ ctx {c}": step([c], size) for c in (128, 1024, 4096)}
    cases["16 decodes @ ctx 128"] = step([128] * 16, size)
    cases["verify 5 rows @ ctx 1024"] = step([1024], size, verify_rows=5)
    print(cpu_description(), f"threads {torch.get_num_threads()}")
    print(f"{'':30s}{'step torch':>12s}{'step native':>12s}{'speedup':>9s}{'attn torch':>12s}{'attn native':>12s}")
    results = {}
    for name, output in cases.items():
        result = results[name] = measure(engine, output, args.repeats)
        torch_path, native_path = result["torch"], result["native"]
        print(f"{name:30s}{torch_path['step_ms']:12.2f}{native_path['step_ms']:12.2f}"
              f"{torch_path['step_ms'] / native_path['step_ms']:8.2f}x"
              f"{torch_path['attention_ms']:12.2f}{native_path['attention_ms']:12.2f}   ms")
    itl: dict[str, dict[str, float]] = {}
    for context in (128, 1024, 4096) if args.itl_rounds else ():
        gaps: dict[str, list[float]] = {path: [] for path in PATHS}
        for index in range(2 * args.itl_rounds):
            path = PATHS[index % 2]
            engine.runner.native_attention = path == "native"
            gaps[path].append(itl_ms(engine, context))
        medians = itl[str(context)] = {path: round(statistics.median(values), 2) for path, values in gaps.items()}
        print(f"ITL @ ctx {context:<5d} torch {medians['torch']:7.2f}  native {medians['native']:7.2f} ms"
              f"  ({medians['torch'] / medians['native']:.2f}x)")
    engine.runner.native_attention = native_default
    write_result(args.output, {"cpu": cpu_description(), "threads": torch.get_num_threads(), "cases": results,
                               "itl_ms": itl,
                               "note": "paths alternate step by step; medians; shared, noisy machine"})


if __name__ == "__main__":
    main()
