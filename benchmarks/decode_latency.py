"""Decode latency of the default model on its quantized kernels vs --quantization none, side by side.

Each mode runs in a fresh child process (so cold start and RSS are its own), one after the other:
- cold start: process spawn -> engine loaded -> first token of a 16-token prompt (no warm-up);
- RSS at ready (--kv-cache-memory 0.25, after warm-up);
- single-stream inter-token latency P50/P99 at contexts 128, 1024 and 4096;
- per-step overhead: a 1-token decode step's time outside its native calls (the decoder stack, or each
  linear and attention call, and the lm_head);
- output tok/s at 1, 4, 16 and 64 concurrent streams (32-token prompts, 32 output tokens) and for the
  burst of 32 x (150 in, 64 out);
plus, once, this CPU's model and SIMD flags, the measured memory read bandwidth, and the fraction of the
bandwidth floor (weight bytes per step / bandwidth) that single-stream decode at context 128 reaches.

    .venv/bin/python benchmarks/decode_latency.py [--quick] [--threads N] [--output FILE.json]

Numbers from a shared machine are noisy; compare the two modes' ratios from one run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

CONTEXTS = (128, 1024, 4096)
STREAMS = (1, 4, 16, 64)
MODES = ("auto", "none")


def cpu_description() -> dict[str, Any]:
    model, flags = platform.processor(), []
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        key, _, value = line.partition(":")
        if key.strip() == "model name":
            model = value.strip()
        elif key.strip() == "flags":
            flags = value.split()
            break
    simd = [f for f in flags if f.startswith(("avx", "amx", "fma", "f16c"))]
    return {"model": model, "simd_flags": sorted(simd), "cpus": os.cpu_count()}


def read_bandwidth_gbs(mib: int = 512, repeats: int = 5) -> float:
    """Best-of read rate of a float32 sum over a buffer far larger than the caches (all threads)."""
    import torch

    buffer = torch.ones(mib * 2**20 // 4)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        buffer.sum()
        best = min(best, time.perf_counter() - start)
    return buffer.numel() * 4 / best / 1e9


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


# --- the child: one mode, one fresh process ---------------------------------------------------------------


def run_child(quantization: str, threads: int | None, quick: bool, spawned: float) -> dict[str, Any]:
    import torch

    from titan import SamplingParams
    from titan.config_flags import engine_config
    from titan.engine.llm_engine import LLMEngine
    from titan.kernels import QuantizedTensor, backend_name

    def engine_for(kv_gib: float) -> LLMEngine:
        return LLMEngine(engine_config("default", quantization=quantization, kv_cache_memory=kv_gib,
                                       threads=threads))

    result: dict[str, Any] = {"quantization": quantization}
    engine = engine_for(0.25)
    engine.add_request(list(range(100, 116)), SamplingParams(max_tokens=1, temperature=0.0))
    while engine.has_unfinished_requests():
        engine.step()
    result["cold_start_s"] = time.time() - spawned
    result["load_s"] = engine.load_seconds
    result["kernels"] = backend_name() if quantization == "auto" else "float32 F.linear"
    result["threads"] = torch.get_num_threads()
    engine.warmup()
    result["rss_at_ready_mib"] = rss_mib()
    weights = engine.runner.model
    result["weight_bytes_per_step"] = sum(p.numel() * p.element_size() for p in weights.parameters()) + sum(
        {id(q): q.nbytes for m in weights.modules() for q in _quantized_parts(m, QuantizedTensor)}.values()
    )

    decode_tokens = 24 if quick else 48
    result["itl_ms"] = {}
    for context in CONTEXTS[:2] if quick else CONTEXTS:
        gaps = single_stream_gaps(engine, context, decode_tokens)
        result["itl_ms"][str(context)] = {"p50": percentile(gaps, 0.5), "p99": percentile(gaps, 0.99)}
    result["step_overhead_ms"] = step_overhead_ms(engine)
    del engine

    engine = engine_for(1.0)
    engine.warmup()
    result["tokens_per_s"] = {}
    for streams in STREAMS[:3] if quick else STREAMS:
        result["tokens_per_s"][str(streams)] = throughput(engine, streams, 32, 32)
    result["burst_tokens_per_s"] = throughput(engine, 8 if quick else 32, 150, 64)
    return result


def _quantized_parts(module: Any, quantized_type: type) -> list:
    parts = getattr(module, "quantized", None)
    if parts is None:
        return []
    return list(parts) if isinstance(parts, list) else [parts]


def single_stream_gaps(engine: Any, context: int, decode_tokens: int) -> list[float]:
    """Milliseconds between consecutive tokens of one request whose prompt is `context` tokens."""
    from titan import SamplingParams

    prompt = [(7 * i) % 40000 + 100 for i in range(context)]
    engine.add_request(prompt, SamplingParams(max_tokens=decode_tokens + 1, temperature=0.0, ignore_eos=True))
    stamps = []
    while engine.has_unfinished_requests():
        if engine.step():
            stamps.append(time.perf_counter())
    return [(b - a) * 1e3 for a, b in zip(stamps[1:], stamps[2:], strict=False)]


def step_overhead_ms(engine: Any, steps: int = 32) -> dict[str, float]:
    """A 1-token decode step (context 128) against the time inside its native calls: the decoder stack
    (every layer in one call, titan/model/native_decoder.py) where it runs, else each Linear and attention
    call, plus the lm_head. What is left is Python: scheduling, metadata, sampling, commit, observers."""
    from common import timed

    from titan import SamplingParams
    from titan.model import layers, llama, native_decoder

    spent = [0.0]
    stack = native_decoder.NativeDecoderStack
    originals = layers.Linear.forward, llama.paged_attention, stack.__call__

    prompt = [(5 * i) % 40000 + 100 for i in range(128)]
    engine.add_request(prompt, SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True))
    engine.step()  # prefill
    totals, kernels = [], []
    layers.Linear.forward, llama.paged_attention, stack.__call__ = (timed(f, spent) for f in originals)
    try:
        while engine.has_unfinished_requests():
            spent[0] = 0.0
            start = time.perf_counter()
            engine.step()
            totals.append(time.perf_counter() - start)
            kernels.append(spent[0])
    finally:
        layers.Linear.forward, llama.paged_attention, stack.__call__ = originals
    overheads = sorted((t - k) * 1e3 for t, k in zip(totals, kernels, strict=True))
    return {"median": statistics.median(overheads), "step_median": statistics.median(totals) * 1e3}


def throughput(engine: Any, streams: int, prompt_tokens: int, output_tokens: int) -> float:
    """Output tokens per second for `streams` requests submitted at once, each with its own prompt."""
    from titan import SamplingParams

    params = SamplingParams(max_tokens=output_tokens, temperature=0.0, ignore_eos=True)
    for s in range(streams):
        engine.add_request([(11 * i + 97 * s) % 40000 + 100 for i in range(prompt_tokens)], params)
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return streams * output_tokens / (time.perf_counter() - start)


# --- the parent: both modes, the table, the JSON -------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer contexts and streams (a smoke run)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--output", default="benchmarks/results/decode_latency.json")
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--spawned", type=float, default=0.0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(run_child(args.child, args.threads, args.quick, args.spawned)), flush=True)
        return

    cpu = cpu_description()
    print(f"CPU: {cpu['model']} ({cpu['cpus']} CPUs); SIMD: {' '.join(cpu['simd_flags'])}")
    bandwidth = read_bandwidth_gbs()
    print(f"memory read bandwidth: {bandwidth:.1f} GB/s")
    results = {}
    for mode in MODES:
        command = [sys.executable, __file__, "--child", mode, "--spawned", repr(time.time())]
        command += ["--quick"] if args.quick else []
        command += ["--threads", str(args.threads)] if args.threads else []
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        if done.returncode != 0 or not lines:
            sys.exit(f"{mode} run failed:\n{done.stderr[-3000:]}")
        results[mode] = json.loads(lines[-1].removeprefix("RESULT "))
        floor_ms = results[mode]["weight_bytes_per_step"] / (bandwidth * 1e9) * 1e3
        results[mode]["bandwidth_floor_ms"] = floor_ms
        results[mode]["bandwidth_floor_fraction"] = floor_ms / results[mode]["itl_ms"]["128"]["p50"]

    report(results)
    from common import write_result

    write_result(args.output, {"cpu": cpu, "memory_read_gbs": bandwidth, "modes": results,
                               "note": "shared, noisy machine; compare ratios within one run"})


def report(results: dict[str, dict[str, Any]]) -> None:
    quantized, reference = results["auto"], results["none"]

    def row(label: str, q: float, n: float, unit: str, fmt: str = ".1f", higher_is_better: bool = False) -> None:
        # The gain of the quantized path: none/q for times and sizes, q/none for rates.
        gain = (q / n if higher_is_better else n / q) if q and n else float("nan")
        print(f"{label:<38}{q:>11{fmt}}{n:>11{fmt}}{gain:>8.2f}x  {unit}")

    print(f"\n{'':<38}{'quantized':>11}{'none':>11}{'gain':>9}")
    print(f"{'kernels':<38}{quantized['kernels']:>11}{'fp32':>11}")
    for context in quantized["itl_ms"]:
        for q in ("p50", "p99"):
            row(f"ITL {q.upper()} @ context {context}", quantized["itl_ms"][context][q],
                reference["itl_ms"][context][q], "ms")
    for streams in quantized["tokens_per_s"]:
        row(f"output tok/s @ {streams} streams", quantized["tokens_per_s"][streams],
            reference["tokens_per_s"][streams], "tok/s", higher_is_better=True)
    row("burst (150 in, 64 out) tok/s", quantized["burst_tokens_per_s"], reference["burst_tokens_per_s"],
        "tok/s", higher_is_better=True)
    row("RSS at ready (KV 0.25 GiB)", quantized["rss_at_ready_mib"], reference["rss_at_ready_mib"], "MiB", ".0f")
    row("cold start -> first token", quantized["cold_start_s"], reference["cold_start_s"], "s", ".2f")
    row("weights read per decode step", quantized["weight_bytes_per_step"] / 2**20,
        reference["weight_bytes_per_step"] / 2**20, "MiB", ".0f")
    row("bandwidth floor per step", quantized["bandwidth_floor_ms"], reference["bandwidth_floor_ms"], "ms", ".2f")
    row("fraction of floor reached (ctx 128)", quantized["bandwidth_floor_fraction"],
        reference["bandwidth_floor_fraction"], "", ".2f", higher_is_better=True)
    row("1-token step outside native calls", quantized["step_overhead_ms"]["median"],
        reference["step_overhead_ms"]["median"], "ms", ".2f")
    row("1-token step total (ctx 128)", quantized["step_overhead_ms"]["step_median"],
        reference["step_overhead_ms"]["step_median"], "ms", ".2f")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    main()
