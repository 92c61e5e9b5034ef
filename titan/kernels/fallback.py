"""Pure-PyTorch dequantization, used when the native kernels cannot be built (and for devices other
than the CPU). The formats of the default model are vectorized in torch; the K-quants go through the
`gguf` package's reference NumPy code."""

from __future__ import annotations

import gguf
import numpy as np
import torch

Q = gguf.GGMLQuantizationType


def _scales(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The fp16 field at byte `offset` of every block, as float32 [n_blocks, 1]."""
    return blocks[:, offset : offset + 2].contiguous().view(torch.float16).float()


# Weight types whose products take rounded activations (see TITAN_ACTIVATION_BITS in build.py).
ROUNDS_ACTIVATIONS = (Q.Q4_0, Q.Q4_1, Q.Q8_0)


def round_activations(x: torch.Tensor, bits: int = 16) -> torch.Tensor:
    """x [..., K] rounded per block of 32 to `bits`-bit integers and back, with the native kernels' exact
    float ops: d = max |x| / qmax, q = round-half-even(x * (1 / d)), q * d; bits 0 returns x."""
    if bits == 0:
        return x
    blocks = x.float().reshape(*x.shape[:-1], x.shape[-1] // 32, 32)
    scale = blocks.abs().amax(-1, keepdim=True) / float(2 ** (bits - 1) - 1)
    # A block below the smallest normal scale rounds to zeros, as in the native kernels (1 / scale would be inf).
    inverse = torch.where(scale >= torch.finfo(torch.float32).tiny, 1.0 / scale, torch.zeros_like(scale))
    return (torch.round(blocks * inverse) * scale).reshape(x.shape).to(x.dtype)


def dequantize_rows(data: torch.Tensor, ggml_type: int, cols: int) -> torch.Tensor:
    """uint8 [rows, row_bytes] of `ggml_type` -> float32 [rows, cols]."""
    rows = data.shape[0]
    kind = Q(ggml_type)
    if kind == Q.F32:
        return data.contiguous().view(torch.float32).reshape(rows, cols).clone()
    if kind in (Q.F16, Q.BF16):
        return data.contiguous().view(torch.float16 if kind == Q.F16 else torch.bfloat16).reshape(rows, cols).float()
    block, block_bytes = gguf.GGML_QUANT_SIZES[kind]
    blocks = data.reshape(-1, block_bytes)
    if kind == Q.Q8_0:
        values = blocks[:, 2:].contiguous().view(torch.int8).float() * _scales(blocks, 0)
    elif kind in (Q.Q4_0, Q.Q4_1):
        start = 2 if kind == Q.Q4_0 else 4
        packed = blocks[:, start:]
        nibbles = torch.cat([packed & 0xF, packed >> 4], dim=1).float()
        if kind == Q.Q4_0:
            values = (nibbles - 8) * _scales(blocks, 0)
        else:
            values = nibbles * _scales(blocks, 0) + _scales(blocks, 2)
    else:
        array = gguf.quants.dequantize(data.numpy(), kind)
        return torch.from_numpy(np.array(array, dtype=np.float32)).reshape(rows, cols)
    return values.reshape(rows, cols)
