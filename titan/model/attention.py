"""Paged KV cache attention over one flattened batch of decodes and prefill chunks.

KV cache layout (per layer): key and value tensors [num_blocks * block_size, num_kv_heads, head_dim];
the K/V of position `p` of a sequence live at physical slot
`block_table[p // block_size] * block_size + p % block_size`.

Every step's tokens are flattened into one batch, decodes first (sequences with exactly one new
token), then prefill chunks. `AttentionMetadata` is built once per step on the host and shared by
all layers, so the layer loop itself never syncs with the device.

On CPU float32 with the native kernels loaded, decode rows and short chunks (`takes_native`: up to 16 rows,
or up to 64 with a short context) go to the native paged attention kernel (see native_attention.py) and only
longer chunks to SDPA.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from titan.kernels.build import native
from titan.model.native_attention import NativeRun, native_paged_attention, plan_native_runs


@dataclass
class PrefillChunk:
    """A run of consecutive new tokens of one sequence, at rows [token_start, token_end) of the batch."""

    token_start: int
    token_end: int
    start_position: int
    # Slots of all context positions [0, start_position + n) and the [n, context] causal mask;
    # both None for a chunk that starts the sequence (its own fresh K/V suffice, plain causal).
    context_slots: torch.Tensor | None = None
    mask: torch.Tensor | None = None


@dataclass
class DecodeBucket:
    """Decode rows [row_start, row_end) padded to their longest context: a flattened [n * max_context]
    slot gather index and the [n, 1, 1, max_context] mask."""

    row_start: int
    row_end: int
    slots: torch.Tensor
    mask: torch.Tensor
    max_context: int


@dataclass
class AttentionMetadata:
    """Per-step attention inputs shared by every layer."""

    slot_mapping: torch.Tensor  # [T] physical cache slot of every new token
    num_decodes: int = 0  # the first `num_decodes` rows are one-token sequences
    decode_buckets: list[DecodeBucket] = field(default_factory=list)
    prefills: list[PrefillChunk] = field(default_factory=list)
    # Rows the native kernel attends (then decode_buckets is empty and prefills holds only long chunks).
    native_runs: list[NativeRun] = field(default_factory=list)


# A decode bucket may pad up to this share of its real context columns (or this many columns, whichever
# is more) before the next row starts a bucket of its own: padding every row to the longest context would
# make one long conversation slow down a batch of short ones, while each bucket costs one more SDPA call.
PAD_SHARE = 0.5
PAD_COLUMNS = 2048


def decode_buckets(context_lengths: list[int]) -> list[tuple[int, int]]:
    """Contiguous row ranges whose padded size stays within the allowance (rows come sorted by context
    from the runner, so the split is close to the sum of contexts)."""
    buckets: list[tuple[int, int]] = []
    start, longest, total = 0, 0, 0
    for row, context in enumerate(context_lengths):
        new_longest, new_total = max(longest, context), total + context
        padded = (row - start + 1) * new_longest
        if row > start and padded - new_total > max(PAD_COLUMNS, PAD_SHARE * new_total):
            buckets.append((start, row))
            start, new_longest, new_total = row, context, context
        longest, total = new_longest, new_total
    if context_lengths:
        buckets.append((start, len(context_lengths)))
    return buckets


def build_attention_metadata(
    num_new_tokens: list[int],
    start_positions: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device,
    null_slot: int | None = None,
    native: bool = False,
) -> tuple[AttentionMetadata, torch.Tensor]:
    """Metadata and the [T] position tensor for sequences already ordered decodes first.

    Every index is computed with a handful of vectorized ops on the host, then copied to `device`.
    `null_slot`, when given, is a cache slot that always holds zeros: padded decode columns read it, so
    the rest of the cache may hold garbage (it is allocated uninitialized, which costs no memory
    until used). `native` (CPU float32 only: see `native_attention_module`) plans the native kernel's runs
    instead of decode buckets and short chunks' slot/mask tensors.
    """
    num_sequences = len(num_new_tokens)
    num_decodes = 0
    while num_decodes < num_sequences and num_new_tokens[num_decodes] == 1:
        num_decodes += 1
    if any(n == 1 for n in num_new_tokens[num_decodes:]):
        raise ValueError("one-token sequences must come first in the batch")

    max_blocks = max(len(table) for table in block_tables)
    tables = torch.tensor([table + [0] * (max_blocks - len(table)) for table in block_tables], dtype=torch.int64)
    positions = torch.tensor(
        [p for start, n in zip(start_positions, num_new_tokens, strict=True) for p in range(start, start + n)],
        dtype=torch.int64,
    )
    sequence_of_token = torch.repeat_interleave(
        torch.arange(num_sequences), torch.tensor(num_new_tokens, dtype=torch.int64)
    )
    slot_mapping = tables[sequence_of_token, positions // block_size] * block_size + positions % block_size
    metadata = AttentionMetadata(slot_mapping=slot_mapping.to(device, non_blocking=True), num_decodes=num_decodes)
    if native:
        metadata.native_runs, long_chunks = plan_native_runs(num_new_tokens, start_positions, block_tables, tables,
                                                             block_size)
        for index in long_chunks:
            row_start = sum(num_new_tokens[:index])
            metadata.prefills.append(_prefill_chunk(index, row_start, num_new_tokens[index], start_positions[index],
                                                    tables, block_size, device))
        return metadata, positions.to(device, non_blocking=True)

    contexts = [start + 1 for start in start_positions[:num_decodes]]
    for row_start, row_end in decode_buckets(contexts):
        # Pad each bucket's contexts to its longest; padded columns are masked.
        context_lengths = torch.tensor(contexts[row_start:row_end], dtype=torch.int64)
        max_context = max(contexts[row_start:row_end])
        columns = torch.arange(max_context)
        slots = tables[row_start:row_end, columns // block_size] * block_size + columns % block_size
        mask = columns[None, :] < context_lengths[:, None]
        if null_slot is not None:
            # A masked column still enters probability × value as 0 × value: it must not be NaN.
            slots = torch.where(mask, slots, null_slot)
        metadata.decode_buckets.append(DecodeBucket(
            row_start, row_end, slots.reshape(-1).to(device, non_blocking=True),
            mask[:, None, None, :].to(device, non_blocking=True), max_context))

    token_start = num_decodes
    for index in range(num_decodes, num_sequences):
        n, start = num_new_tokens[index], start_positions[index]
        metadata.prefills.append(_prefill_chunk(index, token_start, n, start, tables, block_size, device))
        token_start += n
    return metadata, positions.to(device, non_blocking=True)


def _prefill_chunk(
    index: int, token_start: int, n: int, start: int, tables: torch.Tensor, block_size: int, device: torch.device
) -> PrefillChunk:
    chunk = PrefillChunk(token_start=token_start, token_end=token_start + n, start_position=start)
    if start > 0:
        columns = torch.arange(start + n)
        slots = tables[index, columns // block_size] * block_size + columns % block_size
        chunk.context_slots = slots.to(device, non_blocking=True)
        # Query i sits at position start + i and sees every key up to and including itself.
        mask = columns[None, :] <= torch.arange(start, start + n)[:, None]
        chunk.mask = mask.to(device, non_blocking=True)
    return chunk


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Write the new K/V into the cache, then attend. query [T, H, D], key/value [T, Hkv, D] -> [T, H * D]."""
    _, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    group = num_heads // num_kv_heads
    module = native() if metadata.native_runs else None
    if metadata.native_runs and (module is None or query.device.type != "cpu" or query.dtype != torch.float32):
        raise ValueError("attention metadata planned for the native kernel, but it cannot run on these tensors")
    if module is not None:
        module.write_kv(key, value, key_cache, value_cache, metadata.slot_mapping)  # ~1 us; index_copy_ x2 ~5 us
    else:
        key_cache.index_copy_(0, metadata.slot_mapping, key.to(key_cache.dtype))
        value_cache.index_copy_(0, metadata.slot_mapping, value.to(value_cache.dtype))

    outputs: list[torch.Tensor] = []
    for run in metadata.native_runs:
        outputs.append(native_paged_attention(module, query, key_cache, value_cache, run, scale))
    for bucket in metadata.decode_buckets:
        batch, context = bucket.row_end - bucket.row_start, bucket.max_context
        keys = key_cache.index_select(0, bucket.slots).to(query.dtype).view(batch, context, num_kv_heads, head_dim)
        values = value_cache.index_select(0, bucket.slots).to(query.dtype).view(batch, context, num_kv_heads, head_dim)
        # With one query token per sequence, a kv head's query group can ride in the query-length
        # dimension: no kv expansion and one SDPA call for the whole bucket.
        grouped_query = query[bucket.row_start:bucket.row_end].reshape(batch, num_kv_heads, group, head_dim)
        out = F.scaled_dot_product_attention(
            grouped_query,
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=bucket.mask,
            scale=scale,
        )
        outputs.append(out.reshape(batch, num_heads * head_dim))

    for chunk in metadata.prefills:
        chunk_query = query[chunk.token_start : chunk.token_end].transpose(0, 1).unsqueeze(0)
        if chunk.context_slots is None:
            # Its own fresh rows, rounded as the cache holds them: a prompt's numbers do not depend on how it
            # was chunked or which kernel ran it (a no-op with a cache of the model's dtype).
            keys = key[chunk.token_start : chunk.token_end].to(key_cache.dtype).to(query.dtype)
            values = value[chunk.token_start : chunk.token_end].to(value_cache.dtype).to(query.dtype)
        else:
            keys = key_cache.index_select(0, chunk.context_slots).to(query.dtype)
            values = value_cache.index_select(0, chunk.context_slots).to(query.dtype)
        out = F.scaled_dot_product_attention(
            chunk_query,
            keys.transpose(0, 1).unsqueeze(0),
            values.transpose(0, 1).unsqueeze(0),
            attn_mask=chunk.mask,
            is_causal=chunk.mask is None,
            scale=scale,
            enable_gqa=group > 1,
        )
        outputs.append(out[0].transpose(0, 1).reshape(-1, num_heads * head_dim))

    if len(outputs) == 1:
        return outputs[0]
    if metadata.native_runs and metadata.prefills:  # a long chunk may sit between native runs: row order
        starts = [run.row_start for run in metadata.native_runs] + [chunk.token_start for chunk in metadata.prefills]
        outputs = [out for _, out in sorted(zip(starts, outputs, strict=True), key=lambda pair: pair[0])]
    return torch.cat(outputs, dim=0)
