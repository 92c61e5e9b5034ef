"""Paged attention through the native kernel (titan/kernels/csrc/attention_*.cpp) for decode rows and short
prefill chunks (speculative verify rows among them), on CPU float32.

At those sizes the arithmetic is a few microseconds per layer, and the PyTorch path (gather the context's
K/V out of the pages, pad, mask, SDPA) costs tens to thousands of microseconds around it. The kernel reads
K/V straight from the pages through the block table instead. Long prefill chunks stay on SDPA, which is
compute-bound there and good at it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from types import ModuleType

import torch

from titan.kernels.build import native

# Chunks of up to this many rows go to the native kernel; longer ones to SDPA, unless they are short and
# their context is too (NATIVE_CHUNK_MAX_PAIRS).
NATIVE_CHUNK_MAX_ROWS = 16
# A chunk of up to 64 rows whose rows x context (start + rows) is at most this also goes native: the whole
# step then stays in the native decoder stack (titan.model.native_decoder). benchmarks/native_chunks.py on
# an AVX-512 VNNI Xeon, 1 thread: a lone 20 / 32 / 64-token prompt 1.21x / 1.14x / 1.07x faster, 256 tokens
# in chunks of 24 / 32 1.17x / 1.12x; at a context of ~750 the kernel's per-row attention cost more than
# SDPA's (chunks of 32 all native: 0.88x), which the budget keeps out.
NATIVE_CHUNK_MAX_PAIRS = 8192
NATIVE_CHUNK_CEILING = 64

# 0 turns the native kernel off (the PyTorch path runs, as without native kernels): for A/B measurements.
NATIVE_ATTENTION_ENV = "TITAN_NATIVE_ATTENTION"


def takes_native(num_rows: int, start: int) -> bool:
    """Whether a chunk of `num_rows` rows from position `start` goes to the native kernel."""
    if num_rows <= NATIVE_CHUNK_MAX_ROWS:
        return True
    return num_rows <= NATIVE_CHUNK_CEILING and num_rows * (start + num_rows) <= NATIVE_CHUNK_MAX_PAIRS


@dataclass
class NativeRun:
    """Consecutive batch rows [row_start, row_end) made of whole sequences the kernel attends in one call."""

    row_start: int
    row_end: int
    block_size: int
    block_tables: torch.Tensor  # [B, max_blocks] int64
    query_starts: torch.Tensor  # [B + 1] int64, rows relative to row_start
    context_lens: torch.Tensor  # [B] int64, cache tokens of each sequence, its new rows included


NATIVE_CACHE_DTYPES = (torch.float32, torch.float16)


def native_attention_module(device: torch.device, dtype: torch.dtype,
                            cache_dtype: torch.dtype | None = None) -> ModuleType | None:
    """The native module when it is loaded, has the kernel, the tensors will be CPU float32 and the KV cache
    float32 or float16."""
    if device.type != "cpu" or dtype != torch.float32 or os.environ.get(NATIVE_ATTENTION_ENV, "1") == "0":
        return None
    if (cache_dtype or dtype) not in NATIVE_CACHE_DTYPES:
        return None
    module = native()
    return module if module is not None and hasattr(module, "paged_attention") else None


def plan_native_runs(
    num_new_tokens: list[int],
    start_positions: list[int],
    block_tables: list[list[int]],
    tables: torch.Tensor,
    block_size: int,
) -> tuple[list[NativeRun], list[int]]:
    """Native runs for the short sequences, and the indices of the sequences left to SDPA.

    Consecutive rows that continue one another on the same pages (the runner lays out a sequence's
    speculative verify rows as one-token rows) become one kernel sequence, so their shared context is read
    once for all of them.
    """
    runs: list[NativeRun] = []
    long_chunks: list[int] = []
    firsts: list[int] = []  # sequence index whose table each kernel sequence uses
    rows: list[int] = []
    contexts: list[int] = []
    row = run_start = 0

    def close_run() -> None:
        if not firsts:
            return
        whole = len(firsts) == tables.shape[0]  # the usual step: every sequence, none merged
        selected = tables if whole else tables[torch.tensor(firsts, dtype=torch.int64)]
        starts = [0]
        for count in rows:
            starts.append(starts[-1] + count)
        runs.append(NativeRun(run_start, row, block_size, selected, torch.tensor(starts, dtype=torch.int64),
                              torch.tensor(contexts, dtype=torch.int64)))
        firsts.clear()
        rows.clear()
        contexts.clear()

    for index, (n, start) in enumerate(zip(num_new_tokens, start_positions, strict=True)):
        if not takes_native(n, start):
            close_run()
            long_chunks.append(index)
            row += n
            run_start = row
            continue
        previous = firsts[-1] if firsts else -1
        if previous >= 0 and start == contexts[-1] and (
            block_tables[index] is block_tables[previous] or block_tables[index] == block_tables[previous]
        ):
            rows[-1] += n
            contexts[-1] = start + n
        else:
            firsts.append(index)
            rows.append(n)
            contexts.append(start + n)
        row += n
    close_run()
    return runs, long_chunks


def native_paged_attention(
    module: ModuleType,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    run: NativeRun,
    scale: float,
) -> torch.Tensor:
    """Rows [run.row_start, run.row_end) of the step's query [T, H, D] -> [rows, H * D]."""
    return module.paged_attention(query[run.row_start : run.row_end], key_cache, value_cache, run.block_tables,
                                  run.query_starts, run.context_lens, run.block_size, scale)
