"""The whole engine on the real default model (SmolLM2-135M-Instruct, Q4_1 GGUF)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from titan import LLM, SamplingParams
from titan.engine.scheduler import RequestRejectedError

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "List three colors:",
    "The quick brown fox",
    "In 1969, astronauts",
    "Water boils at",
    "My favourite programming language is",
]
SHARED = "You are a helpful assistant. Answer briefly and precisely. Question: "


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("default")


def greedy(max_tokens: int = 16, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kwargs)


def test_generate_returns_text_in_prompt_order(llm: LLM) -> None:
    outputs = llm.generate(PROMPTS[:3], greedy(8))
    assert len(outputs) == 3
    for output in outputs:
        assert len(output.token_ids) == 8
        assert output.finish_reason == "length"
        assert output.text == llm.tokenizer.decode(output.token_ids)
    paris = llm.generate("The capital of France is", greedy(4))[0]
    assert "Paris" in paris.text
    # Every computed token shows up in the engine's step records.
    steps = list(llm.engine.steps)
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs) + len(paris.prompt_token_ids)
    computed = prompt_tokens + sum(len(o.token_ids) - 1 for o in [*outputs, paris])
    assert sum(s.num_tokens for s in steps) == computed
    assert all(s.duration > 0 and s.num_prefill_tokens + s.num_decodes <= s.num_tokens for s in steps)


def test_slo_policy_gives_the_same_greedy_outputs(llm: LLM) -> None:
    expected = [o.token_ids for o in llm.generate(PROMPTS[:4], greedy(12))]
    slo = LLM("default", scheduling_policy="slo", itl_slo_ms=30.0, max_num_batched_tokens=64)
    assert [o.token_ids for o in slo.generate(PROMPTS[:4], greedy(12))] == expected


def test_batch_invariance_with_chunking_prefix_hits_and_preemption() -> None:
    """16 concurrent requests through a tiny cache and token budget give their one-at-a-time outputs.

    Greedy decoding on the real model is token-identical here: the fp32 differences between batch
    shapes stay far below the gaps between the top logits for these prompts.
    """
    prompts = [SHARED + p for p in PROMPTS] + PROMPTS
    reference_llm = LLM("default", max_num_batched_tokens=256, max_num_seqs=1)
    reference = [reference_llm.generate(p, greedy())[0].token_ids for p in prompts]
    del reference_llm

    # 4-token blocks, 24-token steps and ~46 blocks for 16 × (up to 36 + 16) tokens.
    llm = LLM("default", block_size=4, max_num_batched_tokens=24, max_num_seqs=16, kv_cache_memory=0.004)
    engine = llm.engine
    assert llm.generate(prompts[0], greedy())[0].token_ids == reference[0]  # warms the prefix cache
    outputs = llm.generate(prompts, greedy())
    assert engine.scheduler.num_preemptions > 0, "the cache was sized to force preemption"
    assert engine.block_manager.prefix_cache_hits > 0
    assert [o.token_ids for o in outputs] == reference
    stats = engine.stats()
    assert stats.num_running == stats.num_waiting == 0 and stats.kv_cache_usage == 0.0


def test_float16_kv_cache_holds_twice_the_tokens_and_keeps_batch_invariance() -> None:
    """--kv-cache-dtype float16: the same memory holds twice the blocks, and a request's tokens still do not
    depend on chunking, prefix hits or preemption (every path rounds K/V the same way)."""
    prompts = [SHARED + p for p in PROMPTS[:4]] + PROMPTS[:4]
    reference_llm = LLM("default", kv_cache_dtype="float16", max_num_batched_tokens=256, max_num_seqs=1,
                        kv_cache_memory=0.05)
    float32_blocks = LLM("default", kv_cache_memory=0.05, kv_cache_dtype="float32").engine.num_blocks
    assert reference_llm.engine.num_blocks in (2 * float32_blocks, 2 * float32_blocks + 1)  # whole blocks
    reference = [reference_llm.generate(p, greedy())[0].token_ids for p in prompts]
    del reference_llm

    llm = LLM("default", kv_cache_dtype="float16", block_size=4, max_num_batched_tokens=24, max_num_seqs=8,
              kv_cache_memory=0.003)
    assert all(cache.dtype == torch.float16 for layer in llm.engine.runner.kv_caches for cache in layer)
    assert llm.generate(prompts[0], greedy())[0].token_ids == reference[0]  # warms the prefix cache
    outputs = llm.generate(prompts, greedy())
    assert llm.engine.scheduler.num_preemptions > 0, "the cache was sized to force preemption"
    assert [o.token_ids for o in outputs] == reference


def test_seeded_sampling_ignores_the_rest_of_the_batch(llm: LLM) -> None:
    seeded = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)
    alone = llm.generate(PROMPTS[0], seeded)[0].token_ids
    crowd = [SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True) for _ in range(5)]
    batched = llm.generate(PROMPTS[1:6] + [PROMPTS[0]], [*crowd, seeded])[-1].token_ids
    assert batched == alone
    other_seed = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=99, ignore_eos=True)
    assert llm.generate(PROMPTS[0], other_seed)[0].token_ids != alone


def test_stop_string_truncates_and_reports_reason(llm: LLM) -> None:
    full = llm.generate(PROMPTS[2], greedy(24))[0]
    words = full.text.split()
    stop = words[len(words) // 2]
    stopped = llm.generate(PROMPTS[2], greedy(24, stop=[stop]))[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop
    assert stop not in stopped.text
    assert full.text.startswith(stopped.text)


def test_eos_stops_unless_ignored(llm: LLM) -> None:
    chat = llm.tokenizer.apply_chat_template([{"role": "user", "content": "Say hi."}])
    prompt = llm.tokenizer.encode(chat, add_special_tokens=False)
    natural = llm.generate(prompt, SamplingParams(max_tokens=64, temperature=0.0))[0]
    assert natural.finish_reason == "stop"
    assert natural.token_ids[-1] in llm.tokenizer.eos_token_ids
    forced = llm.generate(prompt, SamplingParams(max_tokens=len(natural.token_ids) + 3, temperature=0.0,
                                                 ignore_eos=True))[0]
    assert forced.finish_reason == "length"
    assert forced.token_ids[: len(natural.token_ids)] == natural.token_ids


def test_streaming_deltas_rebuild_text_with_chinese_and_emoji(llm: LLM) -> None:
    engine = llm.engine
    # A repetitive prompt: even a tiny model continues it with more multi-byte characters.
    prompt = "大海 大海 大海 🌊🌊🌊🌊🌊🌊🌊🌊"
    engine.add_request(prompt, SamplingParams(max_tokens=40, temperature=0.8, seed=7, ignore_eos=True),
                       request_id="zh")
    deltas, final = [], None
    while engine.has_unfinished_requests():
        for output in engine.step():
            deltas.append(output.new_text)
            final = output
    assert final is not None and final.finished
    # A sampled tiny model may emit byte sequences that are not UTF-8 (or stop inside a character): the
    # offline decode shows those as U+FFFD too. Streaming must never add one where a whole character
    # exists, i.e. the deltas rebuild exactly the offline decode of the same tokens.
    assert "".join(deltas) == final.text == llm.tokenizer.decode(final.token_ids)
    assert any(ord(c) > 0x2E80 for c in final.text)  # the multi-byte characters really streamed


def test_logprobs_follow_each_token(llm: LLM) -> None:
    output = llm.generate(PROMPTS[0], greedy(6, logprobs=3))[0]
    assert output.logprobs is not None and len(output.logprobs) == 6
    for token_id, entry in zip(output.token_ids, output.logprobs, strict=True):
        assert entry.token_id == token_id and entry.rank == 1  # greedy picks the most likely token
        assert len(entry.top) == 3 and entry.top[0][0] == token_id
        assert entry.logprob <= 0.0


def test_abort_frees_every_block(llm: LLM) -> None:
    engine = llm.engine
    for index, prompt in enumerate(PROMPTS):
        engine.add_request(prompt, greedy(50), request_id=f"abort-{index}")
    for _ in range(3):
        engine.step()
    assert engine.stats().kv_cache_usage > 0
    for index in range(len(PROMPTS)):
        final = engine.abort(f"abort-{index}")
        assert final is not None and final.finish_reason == "abort"
    stats = engine.stats()
    assert stats.kv_cache_usage == 0.0 and not engine.has_unfinished_requests()


def test_requests_that_cannot_fit_are_rejected_clearly() -> None:
    small = LLM("default", max_model_len=32)
    with pytest.raises(RequestRejectedError, match="context"):
        small.generate(list(range(100, 140)), greedy(4))
    assert not small.engine.has_unfinished_requests()
    assert len(small.generate(PROMPTS[0], greedy(4))[0].token_ids) == 4  # still serving


def test_generate_cli_prints_text() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "titan.entrypoints.cli", "generate", "--prompt", "The capital of France is",
         "--max-tokens", "4", "--json"],
        capture_output=True, text=True, timeout=120, check=True,
    )
    assert "Paris" in result.stdout
