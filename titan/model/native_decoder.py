"""The whole decoder stack of a narrow step (decode rows, short chunks, speculative verify rows) in one
native call (titan/kernels/csrc/decoder.cpp), on CPU float32 with every projection quantized.

Layer by layer from Python, a decode step of the default model makes ~300 small native calls, and the
interpreter and module dispatch around them cost ~2 ms of a ~7.5 ms step. The native stack runs the same
kernels in the same order, so its numbers are the layer-by-layer path's, bit for bit.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING

import torch

from titan.kernels import ops
from titan.kernels.build import native
from titan.kernels.ops import FUSED_MAX_ROWS
from titan.model.attention import AttentionMetadata
from titan.model.native_attention import NATIVE_CACHE_DTYPES

if TYPE_CHECKING:
    from titan.model.llama import LlamaForCausalLM

# 0 keeps the layer-by-layer path (the same numbers, slower): for A/B measurements and the parity test.
NATIVE_DECODER_ENV = "TITAN_NATIVE_DECODER"


@dataclass
class NativeDecoderStack:
    """The model's weights, norms and KV caches flattened in the order `decode_stack` takes them."""

    module: ModuleType
    weights: list[torch.Tensor]
    types: list[int]
    interleaved: list[bool]
    biases: list[torch.Tensor | None]
    norms: list[torch.Tensor]
    key_caches: list[torch.Tensor]
    value_caches: list[torch.Tensor]
    num_heads: int
    num_kv_heads: int
    scale: float
    eps: float

    @classmethod
    def for_model(cls, model: LlamaForCausalLM) -> NativeDecoderStack | None:
        """The stack when every layer can run natively: one quantized part per projection, float32 norms,
        KV caches bound; else None (the layer-by-layer path runs)."""
        module = native()
        if module is None or not hasattr(module, "decode_stack") or os.environ.get(NATIVE_DECODER_ENV, "1") == "0":
            return None
        weights: list[torch.Tensor] = []
        types: list[int] = []
        interleaved: list[bool] = []
        biases: list[torch.Tensor | None] = []
        norms: list[torch.Tensor] = []
        key_caches: list[torch.Tensor] = []
        value_caches: list[torch.Tensor] = []
        for layer in model.layers:
            attention = layer.self_attn
            for linear in (attention.qkv_proj, attention.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
                if linear.quantized is None or len(linear.quantized) != 1:
                    return None
                weights.append(linear.quantized[0].data)
                types.append(linear.quantized[0].ggml_type)
                interleaved.append(linear.quantized[0].interleaved)
                biases.append(linear.bias)
            norms += [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
            if attention.kv_cache is None:
                return None
            key_caches.append(attention.kv_cache[0])
            value_caches.append(attention.kv_cache[1])
        norms.append(model.norm.weight)
        tensors = norms + [b for b in biases if b is not None]
        if any(t.dtype != torch.float32 or t.device.type != "cpu" for t in tensors):
            return None
        caches = key_caches + value_caches
        if any(t.dtype not in NATIVE_CACHE_DTYPES or t.device.type != "cpu" for t in caches):
            return None
        first = model.layers[0].self_attn
        return cls(module, weights, types, interleaved, biases, norms, key_caches, value_caches, first.num_heads,
                   first.num_kv_heads, first.scale, model.layers[0].input_layernorm.eps)

    @functools.cached_property
    def max_rows(self) -> int:
        """Rows the stack takes: any number where every product has the interleaved integer kernel (it
        is the fastest at every width), else a narrow step's (wider ones go to the GEMM path)."""
        return 1 << 30 if all(self.interleaved) else FUSED_MAX_ROWS

    def applies(self, hidden: torch.Tensor, metadata: AttentionMetadata) -> bool:
        """A step whose rows are all one native attention run (decode and short-chunk rows only)."""
        if hidden.shape[0] > self.max_rows or metadata.prefills or len(metadata.native_runs) != 1:
            return False
        if hidden.shape[0] >= ops.WIDE_BF32_MIN_ROWS and ops.wide_bf32():
            return False  # the layer-by-layer path multiplies such steps on the AMX tiles (titan.kernels.ops)
        run = metadata.native_runs[0]
        return run.row_start == 0 and run.row_end == hidden.shape[0] and hidden.dtype == torch.float32

    def __call__(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 metadata: AttentionMetadata) -> torch.Tensor:
        run = metadata.native_runs[0]
        return self.module.decode_stack(
            hidden.contiguous(), cos.reshape(cos.shape[0], -1).contiguous(), sin.reshape(sin.shape[0], -1).contiguous(),
            self.weights, self.types, self.interleaved, self.biases, self.norms, self.key_caches, self.value_caches,
            metadata.slot_mapping, run.block_tables, run.query_starts, run.context_lens, run.block_size,
            self.num_heads, self.num_kv_heads, self.scale, self.eps)
