"""Quantized matrix products and lookups: the native kernels where they load, else PyTorch."""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

from titan.kernels import fallback
from titan.kernels.build import native
from titan.kernels.quantized import QuantizedTensor

# Dequantized weight tile of a wide step: ~4 MiB of float32, so it stays in L2/L3 while the GEMM reads it.
TILE_FLOATS = 1 << 20
# Rows up to which the fused kernel beats dequantize-then-GEMM (measured; see README "Quantized weights").
FUSED_MAX_ROWS = 16
# Wide steps multiply in bfloat16 where the CPU has native bf16 dot products (measured ~2x faster than
# float32 at 64+ rows on Zen 4); elsewhere float32. TITAN_WIDE_BF16=0/1 forces it.
WIDE_BF16_ENV = "TITAN_WIDE_BF16"
NATIVE_BF16_FEATURES = ("avx512bf16", "amx-bf16")


@functools.cache
def wide_bf16() -> bool:
    forced = os.environ.get(WIDE_BF16_ENV, "auto")
    if forced in ("0", "1"):
        return forced == "1"
    module = native()
    return module is not None and any(f in module.cpu_features() for f in NATIVE_BF16_FEATURES)


def quantized_linear(x: torch.Tensor, weight: QuantizedTensor) -> torch.Tensor:
    """x [..., cols] @ weight.T -> [..., rows], in x's dtype."""
    module = native()
    flat = x.reshape(-1, weight.cols)
    if module is None or flat.dtype != torch.float32 or flat.device.type != "cpu":
        dense = fallback.dequantize_rows(weight.data, weight.ggml_type, weight.cols)
        return F.linear(x, dense.to(device=x.device, dtype=x.dtype))
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    rows = flat.shape[0]
    if rows <= FUSED_MAX_ROWS:
        out = module.gemv(flat, weight.data, weight.ggml_type, weight.cols)
    else:
        tile = max(16, TILE_FLOATS // weight.cols)
        out = module.gemm(flat.contiguous(), weight.data, weight.ggml_type, weight.cols, tile, wide_bf16())
    return out.reshape(*x.shape[:-1], weight.rows)


def dequantize(weight: QuantizedTensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """float32 of all rows, or of the given row indices only (an embedding lookup)."""
    module = native()
    if module is not None:
        return module.dequantize(weight.data, weight.ggml_type, weight.cols, rows)
    data = weight.data if rows is None else weight.data[rows.to(torch.long).cpu()]
    return fallback.dequantize_rows(data, weight.ggml_type, weight.cols)


def embedding(ids: torch.Tensor, weight: QuantizedTensor) -> torch.Tensor:
    """Rows `ids` (any shape) of a quantized embedding matrix, dequantized: [*ids.shape, cols]."""
    flat = ids.reshape(-1)
    return dequantize(weight, flat).reshape(*ids.shape, weight.cols)
