"""HF GPTQ and AWQ 4-bit checkpoints (`quantization_config.quant_method` gptq / awq) mapped onto the GGML
block formats the kernels run: the integers are repacked, never requantized.

Layouts (GPTQ as written by AutoGPTQ / GPTQModel, AWQ as written by AutoAWQ's GEMM version), for a linear
layer with K inputs, N outputs and groups of G inputs (G = -1: one group spanning K):
- GPTQ: `qweight` int32 [K/8, N], 8 nibbles packed along K (nibble j of row i is input 8i + j);
  `qzeros` int32 [K/G, N/8] packed along N in plain order; `scales` [K/G, N]; `g_idx` [K] the group of
  each input. Checkpoint format "gptq" (v1) stores zero - 1, "gptq_v2" the zero itself.
- AWQ: `qweight` int32 [K, N/8] and `qzeros` int32 [K/G, N/8], packed along N with nibble p holding
  column 8c + (0, 2, 4, 6, 1, 3, 5, 7)[p]; `scales` [K/G, N].
Either way w = (q - zero) * scale. Blocks of 32 inputs lie inside one group when 32 divides G, so a block
becomes Q4_0 (d = scale) where every zero is 8 — exactly the checkpoint's numbers — and otherwise Q4_1
(d = scale, m = -zero * scale, m rounded to fp16: within 2^-11 |m|). GPTQ with act-order (a g_idx that
is not input // G) has no contiguous groups; those layers are dequantized to float32 instead.
"""

from __future__ import annotations

import logging
from typing import Any

import gguf
import torch

from titan.kernels import QuantizedTensor

logger = logging.getLogger("titan.loader")

Q = gguf.GGMLQuantizationType
SUPPORTED_METHODS = ("gptq", "awq")
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble p of an int32 holds column 8c + AWQ_PACK_ORDER[p]
_AWQ_UNPACK = [AWQ_PACK_ORDER.index(j) for j in range(8)]  # column j of 8 comes from this nibble
_PARTS = ("qweight", "qzeros", "scales", "g_idx")


def quantization_method(hf_config: dict[str, Any]) -> dict[str, Any] | None:
    """The checkpoint's quantization_config if it is one we map (4-bit GPTQ or AWQ); raises on others."""
    qconfig = hf_config.get("quantization_config")
    if not qconfig:
        return None
    method = str(qconfig.get("quant_method", "")).lower()
    if method not in SUPPORTED_METHODS:
        raise ValueError(f"quantization_config.quant_method {method!r} is not supported (gptq, awq)")
    bits = int(qconfig.get("bits", qconfig.get("w_bit", 4)))
    if bits != 4:
        raise ValueError(f"{method} with {bits} bits is not supported (4 only)")
    return qconfig


def _unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, C] -> [R * 8, C]: nibble j of row r becomes row 8r + j."""
    nibbles = (packed.to(torch.int32).unsqueeze(1) >> _SHIFTS.view(1, 8, 1)) & 0xF
    return nibbles.reshape(-1, packed.shape[1])


def _unpack_columns(packed: torch.Tensor, order: list[int] | None = None) -> torch.Tensor:
    """int32 [R, C] -> [R, C * 8]: nibble p of column c becomes column 8c + p (or as `order` says)."""
    nibbles = (packed.to(torch.int32).unsqueeze(2) >> _SHIFTS.view(1, 1, 8)) & 0xF
    if order is not None:
        nibbles = nibbles[:, :, order]
    return nibbles.reshape(packed.shape[0], -1)


def unpack_layer(
    parts: dict[str, torch.Tensor], method: str, qconfig: dict[str, Any]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q [K, N], zeros [groups, N], scales [groups, N] float32, group of each input [K])."""
    scales = parts["scales"].float()
    if method == "gptq":
        q = _unpack_rows(parts["qweight"])
        zeros = _unpack_columns(parts["qzeros"])
        if str(qconfig.get("checkpoint_format", "gptq")).lower() != "gptq_v2":
            zeros = zeros + 1
    else:
        q = _unpack_columns(parts["qweight"], _AWQ_UNPACK)
        zeros = _unpack_columns(parts["qzeros"], _AWQ_UNPACK)
    inputs = q.shape[0]
    group_size = int(qconfig.get("group_size", qconfig.get("q_group_size", 128)))
    group_size = inputs if group_size <= 0 else group_size
    groups = parts["g_idx"].to(torch.long) if "g_idx" in parts else torch.arange(inputs) // group_size
    return q, zeros, scales, groups


def dequantize_layer(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """The checkpoint's float32 weight [N, K]: (q - zero) * scale, per input's group."""
    return ((q - zeros[groups]).float() * scales[groups]).T.contiguous()


def to_blocks(
    q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, groups: torch.Tensor
) -> QuantizedTensor | None:
    """Repack as Q4_0 / Q4_1 rows [N, K]; None if 32-input blocks do not each lie in one group."""
    inputs, outputs = q.shape
    if inputs % 32 or not torch.equal(groups.view(-1, 32), groups.view(-1, 32)[:, :1].expand(-1, 32)):
        return None
    block_groups = groups.view(-1, 32)[:, 0]  # [K/32]
    d = scales[block_groups].T  # [N, K/32]
    z = zeros[block_groups].T
    nibbles = q.T.to(torch.uint8).reshape(outputs, inputs // 32, 32)
    packed = nibbles[..., :16] | (nibbles[..., 16:] << 4)

    def fp16_bytes(values: torch.Tensor) -> torch.Tensor:
        return values.to(torch.float16).contiguous().view(torch.uint8).reshape(outputs, inputs // 32, 2)

    if bool((z == 8).all()):
        blocks, kind = torch.cat([fp16_bytes(d), packed], dim=2), Q.Q4_0
    else:
        blocks, kind = torch.cat([fp16_bytes(d), fp16_bytes(-z.float() * d), packed], dim=2), Q.Q4_1
    return QuantizedTensor(blocks.reshape(outputs, -1).contiguous(), int(kind), outputs, inputs)


def convert_quantized_checkpoint(
    weights: dict[str, torch.Tensor], qconfig: dict[str, Any], keep_quantized: bool = True
) -> dict[str, torch.Tensor | QuantizedTensor]:
    """Replace each layer's qweight/qzeros/scales(/g_idx) by `<layer>.weight`: Q4_0/Q4_1 blocks, or float32
    where act-order prevents it or `keep_quantized` is False (--quantization none)."""
    method = str(qconfig["quant_method"]).lower()
    layers = sorted(name.removesuffix(".qweight") for name in weights if name.endswith(".qweight"))
    out: dict[str, torch.Tensor | QuantizedTensor] = dict(weights)
    dequantized = 0
    for layer in layers:
        parts = {part: out.pop(f"{layer}.{part}") for part in _PARTS if f"{layer}.{part}" in out}
        if "qzeros" not in parts or "scales" not in parts:
            raise ValueError(f"{layer}: a {method} layer needs qweight, qzeros and scales")
        q, zeros, scales, groups = unpack_layer(parts, method, qconfig)
        blocks = to_blocks(q, zeros, scales, groups) if keep_quantized else None
        if blocks is None:
            dequantized += 1
        out[f"{layer}.weight"] = blocks if blocks is not None else dequantize_layer(q, zeros, scales, groups)
    if dequantized and keep_quantized:
        logger.warning("%d %s layers have act-order groups; they run dequantized to float32", dequantized, method)
    return out
