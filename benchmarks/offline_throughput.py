"""Offline throughput of the default model against this machine's fp32 GEMM roofline and HF transformers.

Workload: 32 prompts of ~150 tokens, 64 output tokens each (ignore_eos). In the same run it measures
torch's fp32 GEMM GFLOP/s on the model's own linear shapes, derives the roofline time for the work
(2·params FLOPs per processed token for the decoder layers, plus the lm_head only for sampled
positions), and runs the same workload through HF transformers `generate` with static batches.

    .venv/bin/python benchmarks/offline_throughput.py [--skip-hf] [--output benchmarks/results/offline.json]
"""

from __future__ import annotations

import argparse
import resource
import time
from pathlib import Path

import torch
from common import make_prompts, write_result

from titan import LLM, SamplingParams

NUM_PROMPTS = 32
PROMPT_TOKENS = 150
OUTPUT_TOKENS = 64


def layers_gflops(rows: int, shapes: list[tuple[int, int]], num_layers: int, repeats: int = 5) -> float:
    """fp32 GFLOP/s of the model's linear ops as a forward pass meets them: `num_layers` distinct
    weight sets streamed in turn (a single hot matrix would sit in cache and overstate the rate)."""
    inputs = {width: torch.randn(rows, width) for width, _ in shapes}
    weights = [[torch.randn(out, width) for width, out in shapes] for _ in range(num_layers)]
    flops = 2 * rows * sum(width * out for width, out in shapes) * num_layers

    def run() -> None:
        for layer in weights:
            for (width, _), weight in zip(shapes, layer, strict=True):
                torch.nn.functional.linear(inputs[width], weight)

    run()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return flops / best / 1e9


def roofline(config, prompt_tokens: int, sampled_tokens: int, decode_rows: int) -> dict[str, float]:
    """FLOPs of the work and the time they need at the GEMM rates measured on the model's shapes."""
    hidden, inter = config.hidden_size, config.intermediate_size
    kv = config.num_key_value_heads * config.head_dim
    # in → out of each fused projection: qkv, o, gate_up, down.
    shapes = [(hidden, hidden + 2 * kv), (hidden, hidden), (hidden, 2 * inter), (inter, hidden)]
    layers = config.num_hidden_layers
    layer_flops_per_token = sum(2 * i * o for i, o in shapes) * layers
    head_flops_per_token = 2 * hidden * config.vocab_size
    prefill_rate = layers_gflops(512, shapes, layers)
    decode_rate = layers_gflops(decode_rows, shapes, layers)
    head_rate = layers_gflops(decode_rows, [(hidden, config.vocab_size)], 1)
    decode_tokens = sampled_tokens - decode_rows  # the first token of each request comes from prefill
    seconds = (prompt_tokens * layer_flops_per_token / (prefill_rate * 1e9)
               + decode_tokens * layer_flops_per_token / (decode_rate * 1e9)
               + sampled_tokens * head_flops_per_token / (head_rate * 1e9))
    return {
        "gemm_gflops_512_rows": prefill_rate,
        "gemm_gflops_decode_rows": decode_rate,
        "gemm_gflops_1_row": layers_gflops(1, shapes, layers),
        "gemm_gflops_lm_head": head_rate,
        "flops_total": (prompt_tokens + decode_tokens) * layer_flops_per_token
        + sampled_tokens * head_flops_per_token,
        "roofline_seconds": seconds,
    }


def run_titan(llm: LLM, prompts: list[list[int]]) -> dict[str, float]:
    params = SamplingParams(max_tokens=OUTPUT_TOKENS, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    generated = sum(len(o.token_ids) for o in outputs)
    assert generated == len(prompts) * OUTPUT_TOKENS
    prompt_tokens = sum(len(p) for p in prompts)
    return {"seconds": seconds, "output_tokens_per_s": generated / seconds,
            "total_tokens_per_s": (generated + prompt_tokens) / seconds}


def run_hf(folder: Path, prompts: list[list[int]], batch_size: int) -> dict[str, float]:
    """HF transformers generate over static batches (equal-length prompts, so no padding)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    kwargs = {"max_new_tokens": OUTPUT_TOKENS, "min_new_tokens": OUTPUT_TOKENS, "do_sample": False}
    with torch.inference_mode():
        model.generate(torch.tensor(prompts[:2]), max_new_tokens=4, do_sample=False)
        start = time.perf_counter()
        generated = 0
        for i in range(0, len(prompts), batch_size):
            batch = torch.tensor(prompts[i:i + batch_size])
            out = model.generate(batch, attention_mask=torch.ones_like(batch), **kwargs)
            generated += (out.shape[1] - batch.shape[1]) * batch.shape[0]
        seconds = time.perf_counter() - start
    prompt_tokens = sum(len(p) for p in prompts)
    return {"seconds": seconds, "output_tokens_per_s": generated / seconds,
            "total_tokens_per_s": (generated + prompt_tokens) / seconds, "batch_size": batch_size}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--output", default="benchmarks/results/offline_throughput.json")
    args = parser.parse_args()

    llm = LLM(args.model, max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=NUM_PROMPTS)
    prompts = make_prompts(llm.tokenizer, NUM_PROMPTS, PROMPT_TOKENS)
    titan = run_titan(llm, prompts)
    bounds = roofline(llm.engine.model_config, sum(map(len, prompts)), NUM_PROMPTS * OUTPUT_TOKENS,
                      NUM_PROMPTS)
    titan["roofline_fraction"] = bounds["roofline_seconds"] / titan["seconds"]
    result = {"workload": {"prompts": NUM_PROMPTS, "prompt_tokens": PROMPT_TOKENS,
                           "output_tokens": OUTPUT_TOKENS, "model": llm.engine.model_name,
                           "max_num_batched_tokens": args.max_num_batched_tokens,
                           "threads": torch.get_num_threads()},
              "titan": titan, "roofline": bounds}
    result["titan_peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if not args.skip_hf:
        from titan.loader import load_model_files

        folder = load_model_files(args.model).folder
        del llm
        result["hf"] = run_hf(folder, prompts, batch_size=NUM_PROMPTS)
        result["titan_over_hf"] = titan["output_tokens_per_s"] / result["hf"]["output_tokens_per_s"]
    result["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    print(f"titan: {titan['output_tokens_per_s']:.1f} output tok/s, {titan['total_tokens_per_s']:.1f} total tok/s, "
          f"{titan['roofline_fraction']:.0%} of the fp32 roofline ({bounds['roofline_seconds']:.2f} s)")
    print(f"GEMM GFLOP/s: {bounds['gemm_gflops_512_rows']:.1f} at 512 rows, "
          f"{bounds['gemm_gflops_decode_rows']:.1f} at {NUM_PROMPTS} rows, "
          f"{bounds['gemm_gflops_1_row']:.1f} at 1 row, lm_head {bounds['gemm_gflops_lm_head']:.1f} "
          "(the model's 30 layers of linear ops, weights streamed as in a forward pass)")
    if "hf" in result:
        print(f"HF transformers: {result['hf']['output_tokens_per_s']:.1f} output tok/s → "
              f"titan/hf = {result['titan_over_hf']:.2f}x")
    print(f"peak RSS: titan {result['titan_peak_rss_mib']:.0f} MiB, whole run {result['peak_rss_mib']:.0f} MiB")
    write_result(args.output, result)


if __name__ == "__main__":
    main()
