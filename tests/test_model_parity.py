"""Logit parity of the paged-KV model runner with HF transformers on tiny random-weight models.

Every way of feeding a sequence (whole prompt, chunks over several steps, one token at a time,
several sequences batched with shuffled non-contiguous blocks) must reproduce HF's full forward.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config
from transformers import Qwen2ForCausalLM as HFQwen2ForCausalLM

from titan.config import ModelConfig
from titan.engine.model_runner import ModelRunner
from titan.engine.sampling_params import SamplingParams
from titan.engine.scheduler_output import ScheduledSequence, SchedulerOutput

BLOCK_SIZE = 4
NUM_BLOCKS = 96

NEEDS_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
# (device, dtype, atol). Half precision is checked against the fp32 reference with a tolerance
# measured on CPU (fp16 errors ~0.03, bf16 ~0.25 on logits of magnitude ~5).
DEVICES = [
    pytest.param(("cpu", torch.float32, 1e-4), id="cpu-fp32"),
    pytest.param(("cpu", torch.float16, 0.1), id="cpu-fp16"),
    pytest.param(("cpu", torch.bfloat16, 0.6), id="cpu-bf16"),
    pytest.param(("cuda", torch.float32, 2e-3), id="cuda-fp32", marks=NEEDS_CUDA),
    pytest.param(("cuda", torch.float16, 0.1), id="cuda-fp16", marks=NEEDS_CUDA),
    pytest.param(("cuda", torch.bfloat16, 0.6), id="cuda-bf16", marks=NEEDS_CUDA),
]

SMALL = dict(vocab_size=160, hidden_size=64, intermediate_size=112, num_hidden_layers=3, max_position_embeddings=256)
MODELS = {
    "llama-gqa-tied": (
        LlamaForCausalLM,
        LlamaConfig(**SMALL, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    ),
    "llama-untied-llama3-rope-bias": (
        LlamaForCausalLM,
        LlamaConfig(
            **{**SMALL, "hidden_size": 96},
            num_attention_heads=6,
            num_key_value_heads=2,
            head_dim=16,
            tie_word_embeddings=False,
            attention_bias=True,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        ),
    ),
    "qwen2-bias-mqa": (
        HFQwen2ForCausalLM,
        Qwen2Config(**SMALL, num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=False),
    ),
    "mistral-mha": (
        MistralForCausalLM,
        MistralConfig(**SMALL, num_attention_heads=4, num_key_value_heads=4, sliding_window=None),
    ),
}


@dataclass
class Reference:
    hf_model: torch.nn.Module
    config: ModelConfig
    weights: dict[str, torch.Tensor]

    def logits(self, token_ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return self.hf_model(torch.tensor([token_ids])).logits[0].float()


@pytest.fixture(scope="module", params=list(MODELS))
def reference(request: pytest.FixtureRequest) -> Reference:
    model_class, hf_config = MODELS[request.param]
    hf_config.architectures = [model_class.__name__]
    torch.manual_seed(0)
    model = model_class(hf_config).eval()
    # Default init (std 0.02) gives near-zero logits that would hide mistakes; make every weight matter.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.3 * torch.randn_like(param))
            else:
                param.copy_(0.15 * torch.randn_like(param))
    config = ModelConfig.from_hf_config(hf_config.to_dict())
    weights = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    return Reference(model, config, weights)


class GreedySampler:
    """Stands in for titan's Sampler: argmax, and it keeps what it was given."""

    def __init__(self) -> None:
        self.calls: list[tuple[torch.Tensor, list[int]]] = []

    def __call__(self, logits: torch.Tensor, requests: list[ScheduledSequence]) -> tuple[list[int], list[None]]:
        self.calls.append((logits.clone(), [r.seq_id for r in requests]))
        return logits.argmax(dim=-1).tolist(), [None] * len(requests)


def make_runner(reference: Reference, device: str, dtype: torch.dtype) -> ModelRunner:
    return ModelRunner(
        reference.config, reference.weights, NUM_BLOCKS, BLOCK_SIZE, torch.device(device), dtype, GreedySampler()
    )


def shuffled_blocks(count: int, seed: int) -> list[list[int]]:
    """`count` disjoint lists of 16 physical blocks each, scattered over the cache."""
    blocks = list(range(NUM_BLOCKS))
    random.Random(seed).shuffle(blocks)
    return [blocks[i * 16 : (i + 1) * 16] for i in range(count)]


def step(
    seq_id: int, tokens: list[int], start: int, end: int, table: list[int], sample: bool | None = None
) -> ScheduledSequence:
    """`tokens[start:end]` of a sequence; by default it samples when the chunk reaches the end."""
    return ScheduledSequence(
        seq_id=seq_id,
        token_ids=tokens[start:end],
        start_position=start,
        block_table=table[: -(-end // BLOCK_SIZE)],
        sample=end == len(tokens) if sample is None else sample,
        sampling_params=SamplingParams(temperature=0.0),
        prompt_token_ids=tokens[:end],
        output_token_ids=[],
    )


def random_tokens(count: int, seed: int, vocab: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (count,), generator=generator).tolist()


def assert_close(actual: torch.Tensor, expected: torch.Tensor, tolerance: float) -> None:
    torch.testing.assert_close(actual.float().cpu(), expected, atol=tolerance, rtol=0.0)


@pytest.mark.parametrize("device_setup", DEVICES)
def test_whole_prompt_in_one_step(reference: Reference, device_setup: tuple) -> None:
    device, dtype, tolerance = device_setup
    runner = make_runner(reference, device, dtype)
    tokens = random_tokens(37, seed=1, vocab=reference.config.vocab_size)
    table = shuffled_blocks(1, seed=1)[0]
    logits = runner.compute_logits_for(SchedulerOutput([step(0, tokens, 0, len(tokens), table)]), all_tokens=True)
    assert logits.shape == (len(tokens), reference.config.vocab_size)
    assert logits.dtype == torch.float32
    assert_close(logits, reference.logits(tokens), tolerance)


@pytest.mark.parametrize("device_setup", DEVICES)
def test_chunked_prefill_then_decode(reference: Reference, device_setup: tuple) -> None:
    device, dtype, tolerance = device_setup
    runner = make_runner(reference, device, dtype)
    tokens = random_tokens(60, seed=2, vocab=reference.config.vocab_size)
    table = shuffled_blocks(1, seed=2)[0]
    # Chunks that start and end mid-block, including a one-token chunk (served by the decode path).
    boundaries = [0, 7, 8, 17, 30, 45]
    rows = []
    for start, end in zip(boundaries, boundaries[1:], strict=False):
        output = SchedulerOutput([step(0, tokens, start, end, table)])
        rows.append(runner.compute_logits_for(output, all_tokens=True))
    for position in range(45, len(tokens)):
        output = SchedulerOutput([step(0, tokens, position, position + 1, table, sample=True)])
        rows.append(runner.compute_logits_for(output))
    assert_close(torch.cat([r.float().cpu() for r in rows]), reference.logits(tokens), tolerance)


@pytest.mark.parametrize("device_setup", DEVICES)
def test_batched_sequences_mixed_steps(reference: Reference, device_setup: tuple) -> None:
    """Four sequences of different lengths progress at different paces, sharing every step."""
    device, dtype, tolerance = device_setup
    runner = make_runner(reference, device, dtype)
    vocab = reference.config.vocab_size
    sequences = [random_tokens(length, seed=10 + i, vocab=vocab) for i, length in enumerate([29, 11, 40, 3])]
    tables = shuffled_blocks(len(sequences), seed=3)
    chunk_sizes = [[29], [5, 6], [16, 16, 8], [1, 1, 1]]
    # Prompts are then extended one token per step (teacher-forced decodes) to these lengths.
    final_lengths = [34, 18, 43, 9]
    full = [random_tokens(n, seed=20 + i, vocab=vocab) for i, n in enumerate(final_lengths)]
    for i, prompt in enumerate(sequences):
        full[i][: len(prompt)] = prompt

    progress = [0] * len(sequences)
    collected: list[list[torch.Tensor]] = [[] for _ in sequences]
    step_index = 0
    while any(progress[i] < final_lengths[i] for i in range(len(sequences))):
        batch, owners = [], []
        for i in range(len(sequences)):
            if progress[i] >= final_lengths[i]:
                continue
            chunks = chunk_sizes[i]
            size = chunks[step_index] if step_index < len(chunks) else 1
            end = progress[i] + size
            batch.append(step(i, full[i], progress[i], end, tables[i]))
            owners.append((i, progress[i], end))
            progress[i] = end
        # Put prefills before decodes on odd steps: the runner must reorder and map rows back.
        if step_index % 2:
            order = sorted(range(len(batch)), key=lambda k: batch[k].num_new_tokens == 1)
            batch, owners = [batch[k] for k in order], [owners[k] for k in order]
        logits = runner.compute_logits_for(SchedulerOutput(batch), all_tokens=True).float().cpu()
        row = 0
        for i, start, end in owners:
            collected[i].append(logits[row : row + end - start])
            row += end - start
        step_index += 1

    for i, tokens in enumerate(full):
        assert_close(torch.cat(collected[i]), reference.logits(tokens), tolerance)


@pytest.mark.parametrize("device_setup", DEVICES)
def test_execute_samples_in_scheduled_order(reference: Reference, device_setup: tuple) -> None:
    device, dtype, tolerance = device_setup
    runner = make_runner(reference, device, dtype)
    vocab = reference.config.vocab_size
    tables = shuffled_blocks(3, seed=4)
    prompts = [random_tokens(n, seed=30 + i, vocab=vocab) for i, n in enumerate([13, 9, 21])]
    # Step 1: seq 0 whole prompt (samples), seq 1 first chunk (no sample), seq 2 first chunk (no sample).
    runner.execute(
        SchedulerOutput(
            [
                step(0, prompts[0], 0, 13, tables[0]),
                step(1, prompts[1], 0, 8, tables[1]),
                step(2, prompts[2], 0, 10, tables[2]),
            ]
        )
    )
    sampler = runner.sampler
    assert [seq_ids for _, seq_ids in sampler.calls] == [[0]]
    # Step 2: a prefill chunk first, then a decode, then a one-token prompt completion: all sample.
    decode_tokens = prompts[0] + [sampler.calls[0][0].argmax().item()]
    batch = [
        step(2, prompts[2], 10, 21, tables[2]),
        step(0, decode_tokens, 13, 14, tables[0]),
        step(1, prompts[1], 8, 9, tables[1]),
    ]
    result = runner.execute(SchedulerOutput(batch))
    assert result.seq_ids == [2, 0, 1]
    logits, seq_ids = sampler.calls[-1]
    assert seq_ids == [2, 0, 1]
    expected = torch.stack(
        [reference.logits(prompts[2])[-1], reference.logits(decode_tokens)[-1], reference.logits(prompts[1])[-1]]
    )
    assert_close(logits, expected, tolerance)
    assert result.token_ids == logits.argmax(dim=-1).tolist()
    assert result.logprobs == [None, None, None]


@pytest.mark.parametrize("device_setup", DEVICES)
def test_parity_after_warmup(reference: Reference, device_setup: tuple) -> None:
    device, dtype, tolerance = device_setup
    runner = make_runner(reference, device, dtype)
    runner.warmup(max_num_batched_tokens=64, max_num_seqs=8)
    runner.sampler.calls.clear()
    tokens = random_tokens(25, seed=5, vocab=reference.config.vocab_size)
    table = shuffled_blocks(1, seed=5)[0]
    first = runner.compute_logits_for(SchedulerOutput([step(0, tokens, 0, 20, table)]), all_tokens=True)
    rest = [
        runner.compute_logits_for(SchedulerOutput([step(0, tokens, p, p + 1, table, sample=True)]))
        for p in range(20, 25)
    ]
    assert_close(
        torch.cat([first.float().cpu()] + [r.float().cpu() for r in rest]), reference.logits(tokens), tolerance
    )
