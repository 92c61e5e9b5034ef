"""The native paged attention kernel against a straightforward PyTorch reference (gather the context through
the block table, float64 softmax with the causal mask), on every ISA path this CPU can run, and the model's
attention with the native plan against its PyTorch path.

Error bound: max |out - reference| < 1e-5 (reference in float64; values and outputs are O(1)). The kernel
accumulates in float32 and its exp is a degree-6 polynomial (relative error ~1e-7); measured ~1e-6.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator

import pytest
import torch

from titan.kernels import native
from titan.model.attention import build_attention_metadata, paged_attention
from titan.model.native_attention import (
    NATIVE_CHUNK_CEILING,
    NATIVE_CHUNK_MAX_PAIRS,
    NATIVE_CHUNK_MAX_ROWS,
    plan_native_runs,
    takes_native,
)

NATIVE = native()
NEEDS_NATIVE = pytest.mark.skipif(NATIVE is None, reason="native kernels could not be built")
FEATURES = set(NATIVE.cpu_features()) if NATIVE is not None else set()
ISAS = [
    pytest.param("generic", marks=NEEDS_NATIVE),
    pytest.param("avx2", marks=[NEEDS_NATIVE, pytest.mark.skipif("avx2" not in FEATURES, reason="CPU lacks AVX2")]),
    pytest.param("avx512", marks=[NEEDS_NATIVE,
                                  pytest.mark.skipif("avx512bw" not in FEATURES, reason="CPU lacks AVX-512")]),
]
BOUND = 1e-5


@pytest.fixture(params=ISAS)
def isa(request: pytest.FixtureRequest) -> Iterator[str]:
    assert NATIVE.set_isa(request.param) == request.param
    yield request.param
    NATIVE.set_isa("auto")


@pytest.fixture(params=[1, 4], ids=["1-thread", "4-threads"])
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    """4 threads (whatever the cores) makes the kernel split long contexts and merge the parts."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def random_case(contexts: list[int], rows: list[int], heads: int, kv_heads: int, head_dim: int, block_size: int,
                seed: int) -> dict:
    """Caches full of random K/V (and NaN in every slot no sequence owns), shuffled block tables."""
    rng = random.Random(seed)
    generator = torch.Generator().manual_seed(seed)
    needed = [(c + block_size - 1) // block_size for c in contexts]
    num_blocks = sum(needed) + 3
    blocks = list(range(num_blocks))
    rng.shuffle(blocks)
    tables, used = [], 0
    for count in needed:
        tables.append(blocks[used : used + count])
        used += count
    slots = num_blocks * block_size
    key_cache = torch.full((slots, kv_heads, head_dim), math.nan)
    value_cache = torch.full((slots, kv_heads, head_dim), math.nan)
    for table, context in zip(tables, contexts, strict=True):
        for p in range(context):
            slot = table[p // block_size] * block_size + p % block_size
            key_cache[slot] = torch.randn(kv_heads, head_dim, generator=generator)
            value_cache[slot] = torch.randn(kv_heads, head_dim, generator=generator)
    starts = [0]
    for n in rows:
        starts.append(starts[-1] + n)
    query = torch.randn(starts[-1], heads, head_dim, generator=generator)
    return {"query": query, "key_cache": key_cache, "value_cache": value_cache, "tables": tables,
            "starts": starts, "contexts": contexts, "block_size": block_size}


def reference(case: dict, scale: float) -> torch.Tensor:
    query, block_size = case["query"].double(), case["block_size"]
    total, heads, head_dim = query.shape
    group = heads // case["key_cache"].shape[1]
    out = torch.empty(total, heads * head_dim, dtype=torch.float64)
    for b, (table, context) in enumerate(zip(case["tables"], case["contexts"], strict=True)):
        r0, r1 = case["starts"][b], case["starts"][b + 1]
        positions = torch.arange(context)
        slots = torch.tensor(table)[positions // block_size] * block_size + positions % block_size
        keys = case["key_cache"][slots].double().repeat_interleave(group, dim=1)
        values = case["value_cache"][slots].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", query[r0:r1], keys) * scale
        visible = positions[None, :] <= torch.arange(context - (r1 - r0), context)[:, None]
        probabilities = scores.masked_fill(~visible, -math.inf).softmax(dim=-1)
        out[r0:r1] = torch.einsum("hqk,khd->qhd", probabilities, values).reshape(r1 - r0, heads * head_dim)
    return out


def run_kernel(case: dict, scale: float, table_dtype: torch.dtype = torch.int64) -> torch.Tensor:
    width = max(len(t) for t in case["tables"])
    tables = torch.tensor([t + [0] * (width - len(t)) for t in case["tables"]], dtype=table_dtype)
    return NATIVE.paged_attention(case["query"], case["key_cache"], case["value_cache"], tables,
                                  torch.tensor(case["starts"]), torch.tensor(case["contexts"]), case["block_size"],
                                  scale)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize(("heads", "kv_heads"), [(3, 3), (9, 3), (8, 2)], ids=["mha", "group3", "group4"])
def test_kernel_matches_reference(isa: str, threads: int, heads: int, kv_heads: int, head_dim: int) -> None:
    # Contexts 1, 17, 300, 2000 with 1..16 new rows each (a row count never exceeds its context).
    contexts = [1, 17, 300, 2000, 16, 301]
    rows = [1, 16, 5, 1, 16, 3]
    case = random_case(contexts, rows, heads, kv_heads, head_dim, 16, seed=head_dim + heads)
    scale = head_dim**-0.5
    out = run_kernel(case, scale, torch.int32 if heads == 9 else torch.int64)
    assert out.shape == (sum(rows), heads * head_dim) and out.dtype == torch.float32
    assert (out.double() - reference(case, scale)).abs().max().item() < BOUND


@pytest.mark.parametrize("head_dim", [8, 24, 72, 256])
def test_kernel_head_dims_and_block_sizes(isa: str, head_dim: int) -> None:
    """Widths that leave a vector tail (72 on AVX-512 runs at 8 wide), odd block sizes, a split at 4 threads."""
    torch.set_num_threads(4)
    try:
        for block_size in (1, 5, 32):
            case = random_case([2000, 9, 2], [3, 9, 1], 4, 2, head_dim, block_size, seed=block_size)
            out = run_kernel(case, 0.3)
            assert (out.double() - reference(case, 0.3)).abs().max().item() < BOUND, block_size
    finally:
        torch.set_num_threads(1)


def test_a_rows_numbers_do_not_depend_on_the_step_it_rides_in(isa: str) -> None:
    """Bit for bit: a query at position p gives the same output alone, at 1 or 4 threads, beside other
    sequences, and as any row of a verify chunk, around and across the split grid's part boundaries. This
    is what makes speculative decoding exact and a greedy request's tokens independent of the load."""
    contexts = [1100, 700, 2000, 40]
    case = random_case(contexts, [1] * len(contexts), 9, 3, 64, 16, seed=7)
    width = max(len(t) for t in case["tables"])
    tables = torch.tensor([t + [0] * (width - len(t)) for t in case["tables"]])
    positions = torch.randn(1100, 9, 64, generator=torch.Generator().manual_seed(8))
    others = torch.randn(3, 9, 64, generator=torch.Generator().manual_seed(9))

    def attend(query: torch.Tensor, sequences: list[int], rows: list[int], ends: list[int]) -> torch.Tensor:
        starts = torch.tensor([0, *torch.tensor(rows).cumsum(0).tolist()])
        return NATIVE.paged_attention(query, case["key_cache"], case["value_cache"], tables[sequences], starts,
                                      torch.tensor(ends), 16, 0.125)

    before = torch.get_num_threads()
    try:
        for p in (5, 300, 510, 511, 512, 513, 515, 700, 1023, 1024, 1030, 1099):
            torch.set_num_threads(1)
            alone = attend(positions[p:p + 1], [0], [1], [p + 1])
            torch.set_num_threads(4)
            assert torch.equal(attend(positions[p:p + 1], [0], [1], [p + 1]), alone), p
            beside = attend(torch.cat([others, positions[p:p + 1]]), [1, 2, 3, 0], [1, 1, 1, 1], [700, 2000, 40, p + 1])
            assert torch.equal(beside[-1:], alone), p
            for before_p in range(min(p, 5) + 1):  # p as row `before_p` of a 6-row (or shorter) verify chunk
                first, end = p - before_p, min(p - before_p + 6, 1100)
                chunk = attend(positions[first:end], [0], [end - first], [end])
                assert torch.equal(chunk[before_p:before_p + 1], alone), (p, before_p)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("rows", range(1, NATIVE_CHUNK_MAX_ROWS + 1))
def test_every_chunk_length_on_one_long_sequence(isa: str, threads: int, rows: int) -> None:
    case = random_case([1500], [rows], 9, 3, 64, 16, seed=rows)
    assert (run_kernel(case, 0.125).double() - reference(case, 0.125)).abs().max().item() < BOUND


def test_float16_cache_reads_as_its_float32_values(isa: str, threads: int) -> None:
    """An fp16 cache gives, bit for bit, what a float32 cache holding the same (rounded) values gives: the
    kernel widens each tile exactly and computes as before."""
    case = random_case([1, 17, 300, 2000, 16], [1, 16, 5, 1, 3], 9, 3, 64, 16, seed=21)
    half = case | {"key_cache": case["key_cache"].half(), "value_cache": case["value_cache"].half()}
    rounded = case | {"key_cache": half["key_cache"].float(), "value_cache": half["value_cache"].float()}
    assert torch.equal(run_kernel(half, 0.125), run_kernel(rounded, 0.125))


@NEEDS_NATIVE
def test_kernel_rejects_bad_arguments() -> None:
    case = random_case([40], [2], 4, 2, 64, 16, seed=0)
    args = (case["query"], case["key_cache"], case["value_cache"])
    good = (torch.tensor([0, 2]), torch.tensor([40]), 16, 0.1)
    with pytest.raises(RuntimeError, match="outside the cache"):
        NATIVE.paged_attention(*args, torch.tensor([[0, 99, 0]]), *good)
    with pytest.raises(RuntimeError, match="outside the cache"):
        NATIVE.paged_attention(*args, torch.tensor([[-1, 0, 0]]), *good)
    with pytest.raises(RuntimeError, match="outside the cache"):  # page x block_size wrapped past the check
        NATIVE.paged_attention(*args, torch.tensor([[2**63 - 2**39]]), torch.tensor([0, 2]), torch.tensor([2]), 2,
                               0.1)
    with pytest.raises(RuntimeError, match="positive multiple"):  # no query heads: a division by zero
        NATIVE.paged_attention(case["query"][:, :0], case["key_cache"], case["value_cache"],
                               torch.tensor([case["tables"][0]]), *good)
    table = torch.tensor([case["tables"][0]])
    with pytest.raises(RuntimeError, match="context"):  # more context than the table maps
        NATIVE.paged_attention(*args, table, torch.tensor([0, 2]), torch.tensor([90]), 16, 0.1)
    with pytest.raises(RuntimeError, match="context"):  # fewer cache tokens than new rows
        NATIVE.paged_attention(*args, table, torch.tensor([0, 2]), torch.tensor([1]), 16, 0.1)
    with pytest.raises(RuntimeError, match="query_starts"):
        NATIVE.paged_attention(*args, table, torch.tensor([0, 1]), torch.tensor([40]), 16, 0.1)
    with pytest.raises(RuntimeError, match="multiple of 8"):
        NATIVE.paged_attention(case["query"][..., :12], case["key_cache"][..., :12].contiguous(),
                               case["value_cache"][..., :12].contiguous(), table, *good)
    with pytest.raises(RuntimeError, match="float32"):
        NATIVE.paged_attention(case["query"].double(), case["key_cache"], case["value_cache"], table, *good)


@NEEDS_NATIVE
def test_write_kv_matches_index_copy() -> None:
    generator = torch.Generator().manual_seed(3)
    wide = torch.randn(5, 7, 16, generator=generator)  # strided views, as the fused qkv output gives them
    key, value = wide[:, 1:3], wide[:, 4:6]
    slots = torch.tensor([9, 0, 3, 12, 4])
    expected_k, expected_v = torch.zeros(13, 2, 16), torch.zeros(13, 2, 16)
    expected_k.index_copy_(0, slots, key)
    expected_v.index_copy_(0, slots, value)
    actual_k, actual_v = torch.zeros(13, 2, 16), torch.zeros(13, 2, 16)
    NATIVE.write_kv(key, value, actual_k, actual_v, slots)
    assert torch.equal(actual_k, expected_k) and torch.equal(actual_v, expected_v)
    with pytest.raises(RuntimeError, match="outside the cache"):
        NATIVE.write_kv(key, value, actual_k, actual_v, torch.tensor([9, 0, 3, 13, 4]))
    # An fp16 cache holds what torch's rounding to float16 gives.
    half_k, half_v = torch.zeros(13, 2, 16, dtype=torch.float16), torch.zeros(13, 2, 16, dtype=torch.float16)
    NATIVE.write_kv(key, value, half_k, half_v, slots)
    assert torch.equal(half_k, expected_k.half()) and torch.equal(half_v, expected_v.half())
    with pytest.raises(RuntimeError, match="float32 or float16"):
        NATIVE.write_kv(key, value, half_k, actual_v, slots)


# --- the model's attention: the native plan against the PyTorch path ------------------------------------------


def test_short_chunks_with_short_contexts_take_the_kernel() -> None:
    """Up to 16 rows always; up to 64 while rows x context stays within the pair budget (the kernel's
    per-row attention over a long context costs more than SDPA's); longer chunks never."""
    assert takes_native(NATIVE_CHUNK_MAX_ROWS, 5000)
    assert takes_native(NATIVE_CHUNK_MAX_ROWS + 1, 0) and takes_native(NATIVE_CHUNK_CEILING, 0)
    assert not takes_native(NATIVE_CHUNK_CEILING + 1, 0)
    rows = 32
    fits = NATIVE_CHUNK_MAX_PAIRS // rows - rows  # the last start position whose context keeps it native
    assert takes_native(rows, fits) and not takes_native(rows, fits + 1)


def test_plan_merges_verify_rows_and_leaves_long_chunks_to_sdpa() -> None:
    verify_table = [7, 8]
    # Two decodes, three verify rows of one sequence (one-token rows on one table), a long chunk (its context
    # too long for the kernel), a short one.
    lengths = [1, 1, 1, 1, 1, NATIVE_CHUNK_MAX_ROWS + 1, 4]
    starts = [3, 9, 20, 21, 22, 600, 8]
    assert not takes_native(lengths[5], starts[5])
    tables = [[0], [1, 2], verify_table, verify_table, verify_table, [3, 4], [5, 6]]
    padded = torch.tensor([t + [0] * (2 - len(t)) for t in tables])
    runs, long_chunks = plan_native_runs(lengths, starts, tables, padded, 16)
    assert long_chunks == [5]
    first, second = runs
    assert (first.row_start, first.row_end, second.row_start, second.row_end) == (0, 5, 22, 26)
    assert first.query_starts.tolist() == [0, 1, 2, 5] and first.context_lens.tolist() == [4, 10, 23]
    assert first.block_tables.tolist() == [[0, 0], [1, 2], [7, 8]]
    assert second.query_starts.tolist() == [0, 4] and second.context_lens.tolist() == [12]


@NEEDS_NATIVE
@pytest.mark.parametrize("isa_name", ["generic", "auto"])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16], ids=["float32-cache", "float16-cache"])
def test_native_plan_matches_pytorch_path(isa_name: str, cache_dtype: torch.dtype) -> None:
    """One step of everything at once: decodes, verify rows, a long chunk between two short ones; with an
    fp16 cache both paths write the same rounded K/V and read them back alike."""
    NATIVE.set_isa(isa_name)
    try:
        block_size, heads, kv_heads, head_dim = 4, 6, 2, 64
        lengths = [1, 1, 1, 1, 5, NATIVE_CHUNK_CEILING + 1, 3]  # the 65-row chunk is SDPA's
        starts = [0, 30, 12, 13, 0, 9, 40]
        tables = [[0], list(range(1, 9)), list(range(9, 13)), None, [13, 14], list(range(15, 34)),
                  list(range(34, 45))]
        tables[3] = tables[2]
        generator = torch.Generator().manual_seed(0)
        slots = 45 * block_size + 1
        history_k = torch.randn(slots, kv_heads, head_dim, generator=generator)
        history_v = torch.randn(slots, kv_heads, head_dim, generator=generator)
        total = sum(lengths)
        query = torch.randn(total, heads, head_dim, generator=generator)
        key = torch.randn(total, kv_heads, head_dim, generator=generator)
        value = torch.randn(total, kv_heads, head_dim, generator=generator)
        results = []
        for use_native in (False, True):
            key_cache, value_cache = history_k.to(cache_dtype, copy=True), history_v.to(cache_dtype, copy=True)
            key_cache[-1], value_cache[-1] = 0.0, 0.0  # the null slot
            metadata, _ = build_attention_metadata(lengths, starts, tables, block_size, torch.device("cpu"),
                                                   null_slot=slots - 1, native=use_native)
            assert bool(metadata.native_runs) == use_native and (not use_native or not metadata.decode_buckets)
            out = paged_attention(query, key, value, key_cache, value_cache, metadata, 0.125)
            results.append((out, key_cache, value_cache))
        (torch_out, torch_keys, torch_values), (native_out, native_keys, native_values) = results
        torch.testing.assert_close(native_out, torch_out, atol=BOUND, rtol=BOUND)
        assert torch.equal(native_keys, torch_keys) and torch.equal(native_values, torch_values)
    finally:
        NATIVE.set_isa("auto")
