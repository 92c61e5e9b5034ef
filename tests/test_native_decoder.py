"""The native decoder stack (one call for every layer of a narrow step) against the layer-by-layer path:
the same kernels in the same order, so the logits must be equal bit for bit, on the default model and on
tiny random Llama / Qwen2 (with q/k/v biases) models quantized at load."""

from __future__ import annotations

import random

import pytest
import torch
from test_model_runner import random_weights

from titan.config import ModelConfig
from titan.engine.model_runner import ModelRunner
from titan.engine.sampling_params import SamplingParams
from titan.engine.scheduler_output import ScheduledSequence, SchedulerOutput
from titan.kernels import native
from titan.kernels.quantize import quantize_state_dict
from titan.loader import load_model_files
from titan.model.native_attention import NATIVE_CHUNK_CEILING
from titan.model.native_decoder import NativeDecoderStack

pytestmark = pytest.mark.skipif(native() is None, reason="native kernels could not be built")

BLOCK_SIZE = 16
NUM_BLOCKS = 64

TINY = dict(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
            max_position_embeddings=512, tie_word_embeddings=False)


def tiny_weights(config: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """test_model_runner's random weights, plus q/k/v biases where the architecture has them."""
    weights = random_weights(config, seed)
    generator = torch.Generator().manual_seed(seed + 1)
    if config.attention_bias:
        widths = {"q": config.num_attention_heads * config.head_dim, "k": config.num_key_value_heads * config.head_dim}
        widths["v"] = widths["k"]
        for i in range(config.num_hidden_layers):
            for name, width in widths.items():
                weights[f"model.layers.{i}.self_attn.{name}_proj.bias"] = 0.2 * torch.randn(width, generator=generator)
    return weights


def runner_pair(config: ModelConfig, weights: dict,
                kv_cache_dtype: torch.dtype = torch.float32) -> tuple[ModelRunner, ModelRunner]:
    """Two runners on the same weights: the first runs the native stack, the second layer by layer."""
    made = [ModelRunner(config, weights, NUM_BLOCKS, BLOCK_SIZE, torch.device("cpu"), torch.float32,
                        sampler=None, kv_cache_dtype=kv_cache_dtype) for _ in range(2)]  # type: ignore[arg-type]
    made[1].model._native_stack = None
    return made[0], made[1]


def count_stack_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls = [0]
    original = NativeDecoderStack.__call__

    def counted(self: NativeDecoderStack, *args: object) -> torch.Tensor:
        calls[0] += 1
        return original(self, *args)

    monkeypatch.setattr(NativeDecoderStack, "__call__", counted)
    return calls


def step(seq_id: int, tokens: list[int], start: int, count: int, drafts: int = 0) -> ScheduledSequence:
    """Tokens [start, start + count) of a sequence whose pages are 4 * seq_id ... (4 pages each)."""
    end = start + count
    return ScheduledSequence(seq_id=seq_id, token_ids=tokens[start:end], start_position=start,
                             block_table=list(range(4 * seq_id, 4 * seq_id + -(-end // BLOCK_SIZE))), sample=False,
                             sampling_params=SamplingParams(temperature=0.0), prompt_token_ids=tokens[:end],
                             output_token_ids=[], draft_token_ids=tokens[end - drafts:end] if drafts else [])


def compare_steps(pair: tuple[ModelRunner, ModelRunner], steps: list[list[ScheduledSequence]]) -> None:
    for index, scheduled in enumerate(steps):
        native_logits, layer_logits = (r.compute_logits_for(SchedulerOutput(scheduled), all_tokens=True) for r in pair)
        assert torch.equal(native_logits, layer_logits), f"step {index}: max diff " \
            f"{(native_logits - layer_logits).abs().max().item()}"


def narrow_schedule(vocab: int, seed: int) -> tuple[list[list[ScheduledSequence]], int]:
    """Three sequences: chunks of 1-16 rows, decode steps of all three with a verify run of 4 rows, a
    20-row chunk with a short context (titan.model.native_attention.takes_native); then a fourth sequence's
    65-row chunk, which no native run takes. Returns the steps and how many of them are narrow (all but
    that last one)."""
    rng = random.Random(seed)
    texts = [[rng.randrange(vocab) for _ in range(80)] for _ in range(4)]
    steps = [[step(0, texts[0], 0, 16)], [step(1, texts[1], 0, 7)], [step(2, texts[2], 0, 1)],
             [step(0, texts[0], 16, 3), step(1, texts[1], 7, 9)]]
    positions = [19, 16, 1]
    for _ in range(6):
        steps.append([step(0, texts[0], positions[0], 1), step(1, texts[1], positions[1], 4, drafts=3),
                      step(2, texts[2], positions[2], 1)])
        positions = [positions[0] + 1, positions[1] + 4, positions[2] + 1]
    narrow = len(steps)
    steps.append([step(2, texts[2], positions[2], 20)])  # 20 rows with a short context: the stack takes them
    narrow = len(steps)
    steps.append([step(3, texts[3], 0, NATIVE_CHUNK_CEILING + 1)])  # longer than any chunk the kernel takes
    return steps, narrow


@pytest.mark.parametrize(("architecture", "quantization"), [("LlamaForCausalLM", "int4"), ("LlamaForCausalLM", "int8"),
                                                            ("Qwen2ForCausalLM", "int4")])
def test_tiny_models_native_stack_equals_layer_path(architecture: str, quantization: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    config = ModelConfig(architecture=architecture, attention_bias=architecture == "Qwen2ForCausalLM", **TINY)
    weights = quantize_state_dict(tiny_weights(config, seed=3), quantization)
    calls = count_stack_calls(monkeypatch)
    steps, narrow = narrow_schedule(config.vocab_size, seed=5)
    compare_steps(runner_pair(config, weights), steps)
    assert calls[0] == narrow  # every narrow step ran natively; the 65-row chunk did not


def test_float16_kv_cache_native_stack_equals_layer_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """An fp16 KV cache (--kv-cache-dtype float16) keeps the native stack, and its numbers are still the layer
    path's, verify rows and the long chunk's SDPA included."""
    config = ModelConfig(architecture="LlamaForCausalLM", **TINY)
    weights = quantize_state_dict(tiny_weights(config, seed=4), "int4")
    calls = count_stack_calls(monkeypatch)
    steps, narrow = narrow_schedule(config.vocab_size, seed=6)
    pair = runner_pair(config, weights, torch.float16)
    assert all(cache.dtype == torch.float16 for layer in pair[0].kv_caches for cache in layer)
    compare_steps(pair, steps)
    assert calls[0] == narrow


def test_float_weights_keep_the_layer_path() -> None:
    config = ModelConfig(architecture="LlamaForCausalLM", **TINY)
    runner = ModelRunner(config, tiny_weights(config, seed=1), NUM_BLOCKS, BLOCK_SIZE, torch.device("cpu"),
                         torch.float32, sampler=None)  # type: ignore[arg-type]
    runner.compute_logits_for(SchedulerOutput([step(0, list(range(20)), 0, 4)]))
    assert runner.model._native_stack is None


def test_default_model_native_stack_equals_layer_path(monkeypatch: pytest.MonkeyPatch) -> None:
    files = load_model_files("default", "auto")
    calls = count_stack_calls(monkeypatch)
    steps, narrow = narrow_schedule(files.config.vocab_size, seed=11)
    compare_steps(runner_pair(files.config, files.weights), steps)
    assert calls[0] == narrow
