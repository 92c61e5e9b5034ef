"""Quantized weights: GGML block formats kept as bytes, and the kernels that compute on them."""

from titan.kernels.build import backend_name, native, native_error
from titan.kernels.ops import dequantize, embedding, quantized_linear
from titan.kernels.quantized import SUPPORTED_TYPES, QuantizedTensor, cat_rows, weights_equal

__all__ = [
    "SUPPORTED_TYPES",
    "QuantizedTensor",
    "backend_name",
    "cat_rows",
    "dequantize",
    "embedding",
    "native",
    "native_error",
    "quantized_linear",
    "weights_equal",
]
