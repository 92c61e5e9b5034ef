"""Quantized matrix products and lookups: the native kernels where they load, else PyTorch."""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from types import ModuleType

import torch
import torch.nn.functional as F

from titan.kernels import fallback
from titan.kernels.build import activation_bits, native
from titan.kernels.quantized import QuantizedTensor

# Dequantized weight tile of a wide step: ~4 MiB of float32, so it stays in L2/L3 while the GEMM reads it.
TILE_FLOATS = 1 << 20
# Rows up to which the fused kernel beats dequantize-then-GEMM (measured; see README "Quantized weights").
FUSED_MAX_ROWS = 16
# Wide steps multiply in float32 by default. A bfloat16 GEMM (TITAN_WIDE_BF16=1) measured ~2x faster at
# 64+ rows on Zen 4 (native AVX512-BF16), but torch's CPU bf16 GEMM also rounds its output to bf16, and
# teacher-forced top-1 agreement with the float32 model fell to 97.4% (float32 tiles: 100%), below the
# 99% bar; so it stays opt-in (tests/test_quantized_model.py measures both).
WIDE_BF16_ENV = "TITAN_WIDE_BF16"
# Opt-in (TITAN_WIDE_BF32=1): steps of at least WIDE_BF32_MIN_ROWS rows multiply dequantized weight tiles in
# oneDNN's bf32 mode (bfloat16 products, on the AMX tiles where the CPU has them; float32 sums and output)
# instead of the integer kernel. The activations are rounded to the same integer grid first
# (TITAN_ACTIVATION_BITS), then each to bfloat16 (a relative error of at most 2^-8). Side by side on an AMX
# Xeon (benchmarks/wide_bf32.py), prompts of random tokens, against the integer kernel: 1 thread 1.15x at
# 128 tokens, 1.33x at 256, 1.27x at 512; 2 threads 0.85x at 128, 1.02x at 192, 1.20x at 256, 1.27x at 512.
# Top-1 agreement with the float32 model: 1,021 of 1,024 positions, the integer kernels' 1,024. Not the
# default: a row's numbers would depend on the width of the step it rides in, which the integer kernels
# never let happen (tests/test_kernels.py). Without AMX or AVX512-BF16 oneDNN computes it in float32.
WIDE_BF32_MIN_ROWS = 192
WIDE_BF32_ENV = "TITAN_WIDE_BF32"
# 0 keeps Q4_0 / Q4_1 / Q8_0 weights in their row layout (the row kernels run): for A/B measurements.
INTERLEAVE_ENV = "TITAN_INTERLEAVE"


@functools.cache
def wide_bf16() -> bool:
    return os.environ.get(WIDE_BF16_ENV, "0") == "1"


@functools.cache
def wide_bf32() -> bool:
    return os.environ.get(WIDE_BF32_ENV, "0") == "1"


@contextlib.contextmanager
def _bf32_matmul() -> Iterator[None]:
    """float32 matmuls inside compute as oneDNN's bf32; the process-wide setting is restored after (while it
    holds, a float32 matmul on another thread computes in bf32 too: the semantic cache's embedder)."""
    matmul = torch.backends.mkldnn.matmul
    previous = matmul.fp32_precision
    matmul.fp32_precision = "bf16"
    try:
        yield
    finally:
        matmul.fp32_precision = previous


@functools.cache
def _activation_bits() -> int:
    return activation_bits()


def _native_cpu_float32(*tensors: torch.Tensor) -> ModuleType | None:
    """The native module if it loaded and every tensor is a CPU float32 one (the fused ops' domain).
    A plain loop: this runs several times per layer of every step."""
    module = native()
    if module is None:
        return None
    for t in tensors:
        if t.dtype is not torch.float32 or t.device.type != "cpu":
            return None
    return module


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """The native RMSNorm for contiguous CPU float32 input, or None where it does not apply."""
    module = _native_cpu_float32(x, weight)
    return None if module is None else module.rms_norm(x.contiguous(), weight, eps)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """Native rotate-half rotation of [T, heads, head_dim] (see titan/model/rope.py), or None."""
    module = _native_cpu_float32(x, cos, sin)
    if module is None or x.stride(-1) != 1:
        return None
    return module.rotary(x, cos.contiguous(), sin.contiguous())


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """Native SwiGLU of a fused [T, 2 * I] gate/up output, or None."""
    module = _native_cpu_float32(gate_up)
    if module is None or gate_up.dim() != 2:
        return None
    return module.silu_and_mul(gate_up.contiguous())


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Native (rms_norm(residual + x) * weight, residual + x), or None."""
    module = _native_cpu_float32(x, residual, weight)
    if module is None or x.shape != residual.shape:
        return None
    normed, total = module.add_rms_norm(x.contiguous(), residual.contiguous(), weight, eps)
    return normed, total


def interleave(weight: QuantizedTensor) -> QuantizedTensor:
    """The weight in the native kernels' 8-row layout where they have it (Q4_0 / Q4_1 / Q8_0, rows a
    multiple of 8, an AVX2 or AVX-512 CPU): 1.6x faster decode products on one thread, and each extra row
    of a narrow step costs a fraction of the first. Otherwise the weight itself."""
    module = native()
    # The types with integer kernels are the ones whose activations are rounded.
    if module is None or weight.interleaved or weight.ggml_type not in fallback.ROUNDS_ACTIVATIONS \
            or weight.rows % 8 or module.get_isa() == "generic" or os.environ.get(INTERLEAVE_ENV, "1") == "0":
        return weight
    return QuantizedTensor(module.interleave(weight.data, weight.ggml_type, weight.cols), weight.ggml_type,
                           weight.rows, weight.cols, interleaved=True)


def quantized_linear(x: torch.Tensor, weight: QuantizedTensor) -> torch.Tensor:
    """x [..., cols] @ weight.T -> [..., rows], in x's dtype."""
    module = native()
    if module is not None and x.dim() == 2 and x.shape[0] <= FUSED_MAX_ROWS and x.dtype is torch.float32 \
            and x.device.type == "cpu" and x.stride(-1) == 1:  # decode: the hot path, first
        return module.gemv(x, weight.data, weight.ggml_type, weight.cols, weight.interleaved)
    flat = x.reshape(-1, weight.cols)
    if module is None or flat.dtype != torch.float32 or flat.device.type != "cpu":
        dense = dequantize(weight).to(device=x.device, dtype=x.dtype)
        if weight.ggml_type in fallback.ROUNDS_ACTIVATIONS:
            x = fallback.round_activations(x, _activation_bits())
        return F.linear(x, dense)
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    rows = flat.shape[0]
    # Interleaved weights take the integer kernel at every width (unless TITAN_WIDE_BF32, above): it beat
    # dequantized float32 tiles into a float32 GEMM from 1 to 512 rows (512: 477 vs 709 ms for all layers, 2
    # threads, avx512vnni).
    tile = max(16, TILE_FLOATS // weight.cols)
    if rows >= WIDE_BF32_MIN_ROWS and wide_bf32():
        with _bf32_matmul():
            out = module.gemm(flat, weight.data, weight.ggml_type, weight.cols, tile, False, weight.interleaved)
    elif rows <= FUSED_MAX_ROWS or weight.interleaved:
        out = module.gemv(flat, weight.data, weight.ggml_type, weight.cols, weight.interleaved)
    else:
        out = module.gemm(flat, weight.data, weight.ggml_type, weight.cols, tile, wide_bf16(), weight.interleaved)
    return out.reshape(*x.shape[:-1], weight.rows)


def dequantize(weight: QuantizedTensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """float32 of all rows, or of the given row indices only (an embedding lookup)."""
    module = native()
    if module is not None:
        return module.dequantize(weight.data, weight.ggml_type, weight.cols, rows, weight.interleaved)
    if weight.interleaved:
        raise RuntimeError("interleaved weights need the native kernels")
    data = weight.data if rows is None else weight.data[rows.to(torch.long).cpu()]
    return fallback.dequantize_rows(data, weight.ggml_type, weight.cols)


def embedding(ids: torch.Tensor, weight: QuantizedTensor) -> torch.Tensor:
    """Rows `ids` (any shape) of a quantized embedding matrix, dequantized: [*ids.shape, cols]."""
    flat = ids.reshape(-1)
    return dequantize(weight, flat).reshape(*ids.shape, weight.cols)
