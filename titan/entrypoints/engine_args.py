"""Engine flags, one per config field (see `build_engine_config`)."""

from __future__ import annotations

import argparse
from typing import Any


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    group.add_argument("--model", default="default",
                       help="'default' (SmolLM2-135M-Instruct Q4_1), a .gguf file or an HF folder")
    group.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    group.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                       help="auto: float32 on CPU, bfloat16 (or float16) on CUDA")
    group.add_argument("--max-model-len", type=int, default=None,
                       help="context length (default: the model's)")
    group.add_argument("--seed", type=int, default=0, help="seed for requests without their own")
    group.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block")
    group.add_argument("--kv-cache-memory", type=float, default=None,
                       help="KV cache size in GiB (default: 1 GiB on CPU, 80%% of free memory on CUDA)")
    group.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    group.add_argument("--max-num-batched-tokens", type=int, default=512, help="token budget per step")
    group.add_argument("--max-num-seqs", type=int, default=64, help="sequences per step")
    group.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority", "slo"],
                       help="fcfs: arrival order; priority: lower `priority` first, with preemption; "
                            "slo: priority plus prefill chunks capped to keep steps within --itl-slo-ms")
    group.add_argument("--aging-seconds", type=float, default=10.0,
                       help="a waiting request gains one priority level per this many seconds (0: off)")
    group.add_argument("--itl-slo-ms", type=float, default=None,
                       help="target step duration for --scheduling-policy slo")
    admission = parser.add_argument_group("admission control (HTTP 429 when exceeded)")
    admission.add_argument("--max-queued-requests", type=int, default=None, help="bound on waiting requests")
    admission.add_argument("--max-queued-tokens", type=int, default=None, help="bound on waiting prompt tokens")
    admission.add_argument("--ttft-slo-ms", type=float, default=None,
                           help="refuse requests whose predicted time to first token exceeds this")
    admission.add_argument("--batch-share", type=float, default=0.5,
                           help="share of each admission limit the batch class (priority > 0) may use")
    admission.add_argument("--degrade-batch-max-tokens", type=int, default=None,
                           help="opt-in: while requests are waiting, clamp batch-class max_tokens to this "
                                "(counted, and reported in the response as titan_degraded)")
    group.add_argument("--quantization", default="auto", choices=["auto", "none", "int8", "int4"],
                       help="auto: a GGUF keeps its quantized formats; none: dequantize to float at load")
    group.add_argument("--threads", type=int, default=None, help="compute threads (default: physical cores)")
    group.add_argument("--slow-request-ms", type=float, default=5000.0,
                       help="log the timeline of requests whose first token or longest token gap took longer "
                            "(0: off)")


ENGINE_FIELDS = ("device", "dtype", "max_model_len", "seed", "block_size", "kv_cache_memory",
                 "enable_prefix_caching", "max_num_batched_tokens", "max_num_seqs", "scheduling_policy",
                 "aging_seconds", "itl_slo_ms", "max_queued_requests", "max_queued_tokens", "ttft_slo_ms",
                 "batch_share", "degrade_batch_max_tokens", "slow_request_ms", "quantization", "threads")


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return {name: getattr(args, name) for name in ENGINE_FIELDS}
