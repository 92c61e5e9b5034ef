"""A weight kept in its GGML block format: raw bytes [rows, row_bytes] plus the type and logical shape."""

from __future__ import annotations

from dataclasses import dataclass

import gguf
import numpy as np
import torch

Q = gguf.GGMLQuantizationType

# Types the native kernels (and the PyTorch fallback) compute on directly.
SUPPORTED_TYPES = (Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K)


@dataclass
class QuantizedTensor:
    """`data` is uint8 [rows, row_bytes]: each row is `cols` elements in whole blocks of `ggml_type`.

    `interleaved`: the bytes are in the native kernels' 8-row layout (csrc/interleave.h, made by
    `titan.kernels.ops.interleave`): the same bytes per group of 8 rows, transposed, so rows are no longer
    slices of `data`; only the native kernels read such a tensor."""

    data: torch.Tensor
    ggml_type: int
    rows: int
    cols: int
    interleaved: bool = False

    def __post_init__(self) -> None:
        block, block_bytes = gguf.GGML_QUANT_SIZES[Q(self.ggml_type)]
        if self.cols % block:
            raise ValueError(f"{Q(self.ggml_type).name} rows must hold whole blocks of {block}")
        expected = (self.rows, self.cols // block * block_bytes)
        if self.data.dtype != torch.uint8 or tuple(self.data.shape) != expected:
            raise ValueError(f"expected uint8 data of shape {expected}, got {self.data.dtype} {tuple(self.data.shape)}")

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.rows, self.cols))

    @property
    def type_name(self) -> str:
        return Q(self.ggml_type).name

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    @classmethod
    def from_gguf(cls, tensor: gguf.ReaderTensor) -> QuantizedTensor:
        """Copy a 2-D GGUF tensor's bytes out of the reader's memory map (shape is [rows, row_bytes] there)."""
        cols, rows = (int(n) for n in tensor.shape)
        data = np.ascontiguousarray(tensor.data).view(np.uint8).reshape(rows, -1)
        return cls(torch.from_numpy(data.copy()), int(tensor.tensor_type), rows, cols)

    def with_rows(self, data: torch.Tensor) -> QuantizedTensor:
        """The same type and width over other rows of raw bytes (a permutation or a concatenation)."""
        if self.interleaved:
            raise ValueError("an interleaved tensor's rows are not slices of its bytes")
        return QuantizedTensor(data.contiguous(), self.ggml_type, data.shape[0], self.cols)

    def dequantize(self) -> torch.Tensor:
        """float32 [rows, cols]."""
        from titan.kernels.ops import dequantize

        return dequantize(self)


def cat_rows(parts: list[QuantizedTensor]) -> QuantizedTensor | None:
    """Stack parts of one type and width into one tensor (fused q/k/v, gate/up); None if they differ."""
    first = parts[0]
    if any(p.ggml_type != first.ggml_type or p.cols != first.cols or p.interleaved for p in parts):
        return None
    return first.with_rows(torch.cat([p.data for p in parts]))


def weights_equal(a: torch.Tensor | QuantizedTensor, b: torch.Tensor | QuantizedTensor) -> bool:
    """Equal float tensors, or quantized tensors of one type and shape with identical bytes."""
    if isinstance(a, QuantizedTensor) or isinstance(b, QuantizedTensor):
        return (
            isinstance(a, QuantizedTensor)
            and isinstance(b, QuantizedTensor)
            and (a.ggml_type, a.shape, a.interleaved) == (b.ggml_type, b.shape, b.interleaved)
            and torch.equal(a.data, b.data)
        )
    return torch.equal(a, b)
