"""The offline API: `LLM("default").generate(prompts, params)`."""

from __future__ import annotations

from collections.abc import Sequence as SequenceType
from typing import Any

from titan.config import AdmissionConfig, CacheConfig, EngineConfig, SchedulerConfig
from titan.engine.llm_engine import LLMEngine
from titan.engine.outputs import RequestOutput
from titan.engine.sampling_params import SamplingParams

Prompt = str | list[int]


def build_engine_config(
    model: str = "default",
    *,
    device: str = "auto",
    dtype: str = "auto",
    max_model_len: int | None = None,
    seed: int = 0,
    block_size: int = 16,
    kv_cache_memory: float | None = None,
    enable_prefix_caching: bool = True,
    max_num_batched_tokens: int = 512,
    max_num_seqs: int = 64,
    scheduling_policy: str = "fcfs",
    aging_seconds: float = 10.0,
    itl_slo_ms: float | None = None,
    max_queued_requests: int | None = None,
    max_queued_tokens: int | None = None,
    ttft_slo_ms: float | None = None,
    batch_share: float = 0.5,
    degrade_batch_max_tokens: int | None = None,
    slow_request_ms: float = 5000.0,
    quantization: str = "auto",
    threads: int | None = None,
) -> EngineConfig:
    """Flat keyword arguments (the CLI flags, one-to-one) → the typed nested config."""
    return EngineConfig(
        model=model,
        device=device,
        dtype=dtype,
        max_model_len=max_model_len,
        seed=seed,
        cache=CacheConfig(block_size, kv_cache_memory, enable_prefix_caching),
        scheduler=SchedulerConfig(max_num_batched_tokens, max_num_seqs, scheduling_policy, aging_seconds, itl_slo_ms),
        admission=AdmissionConfig(max_queued_requests, max_queued_tokens, ttft_slo_ms, batch_share,
                                  degrade_batch_max_tokens),
        slow_request_ms=slow_request_ms,
        quantization=quantization,
        threads=threads,
    )


class LLM:
    def __init__(self, model: str = "default", **engine_args: Any) -> None:
        self.engine = LLMEngine(build_engine_config(model, **engine_args))
        self.tokenizer = self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | SequenceType[Prompt],
        sampling_params: SamplingParams | SequenceType[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion, batched continuously; outputs come back in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError("give one SamplingParams, or one per prompt")
        order: dict[str, int] = {}
        try:
            for index, (prompt, params) in enumerate(zip(prompts, sampling_params, strict=True)):
                seq = self.engine.add_request(prompt, params)
                order[seq.request_id] = index
        except Exception:
            for request_id in order:  # all or nothing: a rejected prompt leaves no orphans behind
                self.engine.abort(request_id)
            raise
        results: list[RequestOutput | None] = [None] * len(order)
        while self.engine.has_unfinished_requests():
            for output in self.engine.step():
                if output.finished and output.request_id in order:
                    results[order[output.request_id]] = output
        return [r for r in results if r is not None]

    def chat(
        self,
        messages: list[dict[str, Any]],
        sampling_params: SamplingParams | None = None,
    ) -> RequestOutput:
        return self.generate(self.tokenizer.encode_chat(messages), sampling_params)[0]
