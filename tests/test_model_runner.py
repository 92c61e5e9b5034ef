"""Paged KV slot mapping and gathers, rope scaling, weight loading and the runner's step contract."""

from __future__ import annotations

import math
import random

import pytest
import torch
import torch.nn.functional as F

from titan.config import ModelConfig
from titan.engine.model_runner import ModelRunner
from titan.engine.sampling_params import SamplingParams
from titan.engine.scheduler_output import ScheduledSequence, SchedulerOutput
from titan.model.attention import build_attention_metadata, paged_attention
from titan.model.llama import LlamaForCausalLM
from titan.model.native_attention import native_attention_module
from titan.model.rope import RotaryEmbedding, apply_rotary, rope_inverse_frequencies

DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda", id="cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")),
]

CONFIG = ModelConfig(
    architecture="LlamaForCausalLM",
    vocab_size=97,
    hidden_size=48,
    intermediate_size=80,
    num_hidden_layers=2,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=8,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    max_position_embeddings=128,
    tie_word_embeddings=False,
)


def random_weights(config: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)

    def normal(*shape: int) -> torch.Tensor:
        return 0.2 * torch.randn(*shape, generator=generator)

    hidden, heads, kv_heads, head_dim = (
        config.hidden_size,
        config.num_attention_heads,
        config.num_key_value_heads,
        config.head_dim,
    )
    weights = {
        "model.embed_tokens.weight": normal(config.vocab_size, hidden),
        "model.norm.weight": 1 + normal(hidden),
        "lm_head.weight": normal(config.vocab_size, hidden),
    }
    for i in range(config.num_hidden_layers):
        prefix = f"model.layers.{i}."
        weights |= {
            prefix + "input_layernorm.weight": 1 + normal(hidden),
            prefix + "post_attention_layernorm.weight": 1 + normal(hidden),
            prefix + "self_attn.q_proj.weight": normal(heads * head_dim, hidden),
            prefix + "self_attn.k_proj.weight": normal(kv_heads * head_dim, hidden),
            prefix + "self_attn.v_proj.weight": normal(kv_heads * head_dim, hidden),
            prefix + "self_attn.o_proj.weight": normal(hidden, heads * head_dim),
            prefix + "mlp.gate_proj.weight": normal(config.intermediate_size, hidden),
            prefix + "mlp.up_proj.weight": normal(config.intermediate_size, hidden),
            prefix + "mlp.down_proj.weight": normal(hidden, config.intermediate_size),
        }
    return weights


class RecordingGreedySampler:
    def __init__(self) -> None:
        self.calls: list[tuple[torch.Tensor, list[int]]] = []

    def __call__(self, logits: torch.Tensor, requests: list[ScheduledSequence]) -> tuple[list[int], list[None]]:
        self.calls.append((logits.clone(), [r.seq_id for r in requests]))
        return logits.argmax(dim=-1).tolist(), [None] * len(requests)


def scheduled(
    seq_id: int, token_ids: list[int], start: int, table: list[int], sample: bool = True
) -> ScheduledSequence:
    return ScheduledSequence(
        seq_id=seq_id,
        token_ids=token_ids,
        start_position=start,
        block_table=table,
        sample=sample,
        sampling_params=SamplingParams(temperature=0.0),
        prompt_token_ids=token_ids,
        output_token_ids=[],
    )


def slot_of(table: list[int], position: int, block_size: int) -> int:
    return table[position // block_size] * block_size + position % block_size


# --- KV slot mapping and gathers ---------------------------------------------------------------


def test_metadata_slot_mapping_and_decode_gather_with_shuffled_blocks() -> None:
    block_size = 4
    blocks = list(range(40))
    random.Random(0).shuffle(blocks)
    tables = [blocks[0:3], blocks[3:5], blocks[5:12], blocks[12:16]]
    # Two decodes (contexts 9 and 6), then a fresh prefill and a chunk at an offset.
    new_tokens, starts = [1, 1, 26, 5], [8, 5, 0, 10]
    metadata, positions = build_attention_metadata(new_tokens, starts, tables, block_size, torch.device("cpu"))

    expected_positions = [8, 5, *range(26), *range(10, 15)]
    assert positions.tolist() == expected_positions
    owners = [0, 1] + [2] * 26 + [3] * 5
    expected_slots = [slot_of(tables[o], p, block_size) for o, p in zip(owners, expected_positions, strict=True)]
    assert metadata.slot_mapping.tolist() == expected_slots
    assert len(set(expected_slots)) == len(expected_slots)

    (bucket,) = metadata.decode_buckets
    assert metadata.num_decodes == 2 and bucket.max_context == 9 and (bucket.row_start, bucket.row_end) == (0, 2)
    gather = bucket.slots.view(2, 9)
    mask = bucket.mask.view(2, 9)
    for row, (table, context) in enumerate([(tables[0], 9), (tables[1], 6)]):
        assert gather[row, :context].tolist() == [slot_of(table, p, block_size) for p in range(context)]
        assert mask[row].tolist() == [p < context for p in range(9)]

    fresh, offset = metadata.prefills
    assert (fresh.token_start, fresh.token_end, fresh.context_slots, fresh.mask) == (2, 28, None, None)
    assert (offset.token_start, offset.token_end, offset.start_position) == (28, 33, 10)
    assert offset.context_slots.tolist() == [slot_of(tables[3], p, block_size) for p in range(15)]
    assert offset.mask.tolist() == [[key <= 10 + query for key in range(15)] for query in range(5)]


def test_metadata_rejects_decode_after_prefill() -> None:
    with pytest.raises(ValueError, match="first"):
        build_attention_metadata([3, 1], [0, 4], [[0], [1, 2]], 4, torch.device("cpu"))


@pytest.mark.parametrize("native", [False, pytest.param(True, id="native-kernel")])
@pytest.mark.parametrize("device", DEVICES)
def test_paged_attention_matches_dense_attention(device: str, native: bool) -> None:
    """Random history already in a shuffled cache plus new tokens: equals per-sequence dense attention (also
    through the native kernel's plan, on CPU float32 where it is built)."""
    if native and native_attention_module(torch.device(device), torch.float32) is None:
        pytest.skip("the native attention kernel needs the native kernels and a CPU")
    torch.manual_seed(0)
    block_size, num_blocks, heads, kv_heads, head_dim = 4, 48, 6, 2, 8
    blocks = list(range(num_blocks))
    random.Random(1).shuffle(blocks)
    tables = [blocks[0:5], blocks[5:8], blocks[8:20], blocks[20:26]]
    new_tokens, starts = [1, 1, 13, 7], [17, 4, 0, 14]
    key_cache = torch.randn(num_blocks * block_size, kv_heads, head_dim, device=device)
    value_cache = torch.randn(num_blocks * block_size, kv_heads, head_dim, device=device)
    # Dense per-sequence K/V histories, written into the cache at their physical slots.
    histories = []
    for table, start in zip(tables, starts, strict=True):
        keys, values = torch.randn(start, kv_heads, head_dim), torch.randn(start, kv_heads, head_dim)
        slots = torch.tensor([slot_of(table, p, block_size) for p in range(start)], dtype=torch.int64)
        key_cache[slots.to(device)] = keys.to(device)
        value_cache[slots.to(device)] = values.to(device)
        histories.append((keys, values))

    total = sum(new_tokens)
    query = torch.randn(total, heads, head_dim)
    key, value = torch.randn(total, kv_heads, head_dim), torch.randn(total, kv_heads, head_dim)
    metadata, _ = build_attention_metadata(new_tokens, starts, tables, block_size, torch.device(device), native=native)
    assert bool(metadata.native_runs) == native
    scale = head_dim**-0.5
    out = paged_attention(
        query.to(device), key.to(device), value.to(device), key_cache, value_cache, metadata, scale
    ).cpu()
    assert out.shape == (total, heads * head_dim)

    row = 0
    for index, (n, start) in enumerate(zip(new_tokens, starts, strict=True)):
        keys = torch.cat([histories[index][0], key[row : row + n]]).repeat_interleave(heads // kv_heads, dim=1)
        values = torch.cat([histories[index][1], value[row : row + n]]).repeat_interleave(heads // kv_heads, dim=1)
        scores = torch.einsum("qhd,khd->hqk", query[row : row + n], keys) * scale
        visible = torch.arange(start + n)[None, :] <= torch.arange(start, start + n)[:, None]
        probabilities = scores.masked_fill(~visible, -math.inf).softmax(dim=-1)
        expected = torch.einsum("hqk,khd->qhd", probabilities, values).reshape(n, heads * head_dim)
        torch.testing.assert_close(out[row : row + n], expected, atol=1e-5, rtol=1e-5)
        # The new K/V landed at their slots.
        slots = [slot_of(tables[index], p, block_size) for p in range(start, start + n)]
        torch.testing.assert_close(key_cache[slots].cpu(), key[row : row + n])
        torch.testing.assert_close(value_cache[slots].cpu(), value[row : row + n])
        row += n


# --- rotary embedding ----------------------------------------------------------------------------


def test_llama3_rope_frequencies_match_transformers() -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    hf_config = LlamaConfig(hidden_size=4096, num_attention_heads=32, rope_theta=500000.0, rope_scaling=scaling)
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_config)
    actual = rope_inverse_frequencies(128, 500000.0, scaling)
    torch.testing.assert_close(actual, expected, atol=0, rtol=0)
    # Scaling really changes the low frequencies and leaves the high ones alone.
    plain = rope_inverse_frequencies(128, 500000.0, None)
    assert actual[0] == plain[0] and actual[-1] == pytest.approx(plain[-1] / 8.0)
    with pytest.raises(ValueError, match="unsupported"):
        rope_inverse_frequencies(128, 10000.0, {"rope_type": "yarn", "factor": 4.0})


def test_rotary_matches_rotate_half_formula() -> None:
    torch.manual_seed(0)
    rotary = RotaryEmbedding(head_dim=8, max_positions=64, theta=10000.0)
    positions = torch.tensor([0, 5, 63, 17])
    x = torch.randn(4, 3, 8)
    cos, sin = rotary.cos_sin(positions)
    angles = positions[:, None].float() * rope_inverse_frequencies(8, 10000.0, None)[None, :]
    full_cos, full_sin = torch.cat([angles, angles], -1).cos()[:, None], torch.cat([angles, angles], -1).sin()[:, None]
    rotated_half = torch.cat([-x[..., 4:], x[..., :4]], dim=-1)
    torch.testing.assert_close(apply_rotary(x, cos, sin), x * full_cos + rotated_half * full_sin)
    # A strided input (a column slice of a wider tensor) gives the same answer.
    wide = torch.randn(4, 5, 8)
    wide[:, 1:4] = x
    torch.testing.assert_close(apply_rotary(wide[:, 1:4], cos, sin), apply_rotary(x, cos, sin))


# --- weights -------------------------------------------------------------------------------------


def test_load_weights_fuses_projections_and_rejects_bad_sets() -> None:
    weights = random_weights(CONFIG)
    model = LlamaForCausalLM(CONFIG)
    model.load_weights(weights)
    attention = model.layers[1].self_attn
    torch.testing.assert_close(
        attention.qkv_proj.weight,
        torch.cat([weights[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"]),
    )
    assert attention.o_proj.bias is None and attention.qkv_proj.bias is None
    torch.testing.assert_close(model.lm_head.weight, weights["lm_head.weight"])

    missing = dict(weights)
    del missing["model.layers.0.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match="missing.*layers.0.mlp.gate_up_proj"):
        LlamaForCausalLM(CONFIG).load_weights(missing)
    with pytest.raises(ValueError, match="unexpected"):
        LlamaForCausalLM(CONFIG).load_weights(weights | {"model.layers.0.self_attn.q_proj.bias": torch.zeros(48)})
    wrong = weights | {"model.norm.weight": torch.ones(7)}
    with pytest.raises(ValueError, match="shape"):
        LlamaForCausalLM(CONFIG).load_weights(wrong)


def test_tied_embeddings_share_one_tensor() -> None:
    config = ModelConfig(**{**CONFIG.__dict__, "tie_word_embeddings": True})
    weights = random_weights(config)
    model = LlamaForCausalLM(config)
    model.load_weights(weights)  # the shipped lm_head copy is ignored
    assert model.lm_head.weight is model.embed_tokens.weight
    torch.testing.assert_close(model.lm_head.weight, weights["model.embed_tokens.weight"])


# --- runner contract -----------------------------------------------------------------------------


def make_runner(device: str = "cpu", num_blocks: int = 32, block_size: int = 4) -> ModelRunner:
    return ModelRunner(
        CONFIG,
        random_weights(CONFIG),
        num_blocks,
        block_size,
        torch.device(device),
        torch.float32,
        RecordingGreedySampler(),
    )


def test_kv_cache_bytes_per_block() -> None:
    expected = 2 * CONFIG.num_hidden_layers * 16 * CONFIG.num_key_value_heads * CONFIG.head_dim * 2
    assert ModelRunner.kv_cache_bytes_per_block(CONFIG, 16, torch.bfloat16) == expected
    assert ModelRunner.kv_cache_bytes_per_block(CONFIG, 16, torch.float32) == 2 * expected
    runner = make_runner(num_blocks=8, block_size=16)
    cache_bytes = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in runner.kv_caches)
    null_slot_bytes = 2 * CONFIG.num_hidden_layers * CONFIG.num_key_value_heads * CONFIG.head_dim * 4
    assert cache_bytes == 8 * ModelRunner.kv_cache_bytes_per_block(CONFIG, 16, torch.float32) + null_slot_bytes


def test_garbage_in_unused_cache_slots_never_leaks_into_decodes() -> None:
    """The pool is allocated uninitialized; padded decode columns must read only the zero null slot."""
    clean = make_runner(num_blocks=8, block_size=4)
    dirty = make_runner(num_blocks=8, block_size=4)
    for key_cache, value_cache in dirty.kv_caches:
        key_cache[: dirty.null_slot].fill_(float("nan"))
        value_cache[: dirty.null_slot].fill_(float("nan"))
    prefill = SchedulerOutput([scheduled(0, [5, 6, 7, 8, 9, 10], 0, [0, 1], sample=False),
                               scheduled(1, [11, 12], 0, [2], sample=False)])
    decode = SchedulerOutput([scheduled(0, [13], 6, [0, 1], sample=True), scheduled(1, [14], 2, [2], sample=True)])
    results = []
    for runner in (clean, dirty):
        runner.execute(prefill)
        results.append(runner.compute_logits_for(decode))
    assert torch.isfinite(results[1]).all()
    torch.testing.assert_close(results[1], results[0])


def test_empty_step_and_step_without_sampling() -> None:
    runner = make_runner()
    assert runner.execute(SchedulerOutput()).seq_ids == []
    result = runner.execute(SchedulerOutput([scheduled(0, [1, 2, 3, 4, 5], 0, [3, 1], sample=False)]))
    assert (result.seq_ids, result.token_ids, result.logprobs) == ([], [], [])
    assert runner.sampler.calls == []


@pytest.mark.parametrize("device", DEVICES)
def test_batching_does_not_change_results(device: str) -> None:
    """A sequence's logits are the same alone or batched with others, whatever the scheduled order."""
    prompts = {0: [5, 9, 13, 2, 7, 7, 1], 1: [3, 3, 8], 2: [11, 40, 41, 42, 43, 44, 45, 46, 47, 48]}
    tables = {0: [6, 2], 1: [9], 2: [0, 14, 3]}
    alone = {}
    for seq_id, prompt in prompts.items():
        runner = make_runner(device)
        runner.execute(SchedulerOutput([scheduled(seq_id, prompt[:-1], 0, tables[seq_id], sample=False)]))
        alone[seq_id] = runner.compute_logits_for(
            SchedulerOutput([scheduled(seq_id, prompt[-1:], len(prompt) - 1, tables[seq_id])])
        )[0]

    runner = make_runner(device)
    runner.execute(SchedulerOutput([scheduled(i, prompts[i][:-1], 0, tables[i], sample=False) for i in (2, 0, 1)]))
    result = runner.execute(
        SchedulerOutput([scheduled(i, prompts[i][-1:], len(prompts[i]) - 1, tables[i]) for i in (1, 2, 0)])
    )
    logits, seq_ids = runner.sampler.calls[-1]
    assert result.seq_ids == seq_ids == [1, 2, 0]
    for row, seq_id in enumerate(seq_ids):
        torch.testing.assert_close(logits[row].cpu(), alone[seq_id].cpu(), atol=1e-5, rtol=1e-5)
        assert result.token_ids[row] == int(alone[seq_id].argmax())


def test_warmup_leaves_no_trace() -> None:
    prompt = [4, 8, 15, 16, 23, 42, 1, 2, 3]
    table = [5, 0, 7]
    fresh = make_runner()
    expected = fresh.compute_logits_for(SchedulerOutput([scheduled(0, prompt, 0, table)]), all_tokens=True)
    warmed = make_runner()
    warmed.warmup(max_num_batched_tokens=200, max_num_seqs=6)  # more tokens than the cache holds: capped
    assert [len(seq_ids) for _, seq_ids in warmed.sampler.calls] == [1, 6]
    actual = warmed.compute_logits_for(SchedulerOutput([scheduled(0, prompt, 0, table)]), all_tokens=True)
    torch.testing.assert_close(actual, expected)
    # Decoding against the cache the warmup scribbled on still only sees this sequence's K/V.
    fresh_next = fresh.compute_logits_for(SchedulerOutput([scheduled(0, [9], len(prompt), table)]))
    warmed_next = warmed.compute_logits_for(SchedulerOutput([scheduled(0, [9], len(prompt), table)]))
    torch.testing.assert_close(warmed_next, fresh_next)


def test_cpu_float32_output_is_deterministic() -> None:
    runner = make_runner()
    output = SchedulerOutput([scheduled(0, [1, 2, 3], 0, [4])])
    first = runner.compute_logits_for(output)
    second = runner.compute_logits_for(output)
    assert torch.equal(first, second)
    assert first.shape == (1, CONFIG.vocab_size)
    assert not F.softmax(first, dim=-1).isnan().any()


def test_decode_buckets_follow_the_sum_of_contexts_not_count_times_longest() -> None:
    from titan.model.attention import decode_buckets

    # Fifteen short conversations and one long one: the long one gets its own bucket.
    short_and_long = [100] * 15 + [4000]
    buckets = decode_buckets(short_and_long)
    assert buckets == [(0, 15), (15, 16)]
    padded = sum((end - start) * max(short_and_long[start:end]) for start, end in buckets)
    assert padded == sum(short_and_long)
    # Similar contexts, or only short ones, stay one bucket (each bucket is one more SDPA call per layer).
    assert decode_buckets([500, 520, 610, 700]) == [(0, 4)]
    assert decode_buckets([10, 300, 600, 900]) == [(0, 4)]
    assert decode_buckets([]) == []
    # Every row is in exactly one bucket, in order, whatever the input order.
    mixed = [3000, 20, 20, 5000, 40, 4000, 30]
    ranges = decode_buckets(mixed)
    assert [row for start, end in ranges for row in range(start, end)] == list(range(len(mixed)))
