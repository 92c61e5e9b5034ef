"""Quantize float weights at load (`--quantization int8|int4`) into the GGML block formats the kernels
already run: int8 -> Q8_0 (symmetric, one fp16 scale per group of 32), int4 -> Q4_1 (asymmetric, fp16
scale and minimum per group of 32). The tied embedding / lm_head stays Q8_0 under int4, as llama.cpp's
mixed recipes keep the output matrix at higher precision."""

from __future__ import annotations

import gguf
import torch

from titan.kernels.quantized import QuantizedTensor

Q = gguf.GGMLQuantizationType
GROUP = 32
FORMATS = {"int8": Q.Q8_0, "int4": Q.Q4_1}
_HIGH_PRECISION = ("model.embed_tokens.weight", "lm_head.weight")


def _fp16_bytes(values: torch.Tensor) -> torch.Tensor:
    return values.to(torch.float16).contiguous().view(torch.uint8).reshape(values.shape[0], 2)


def quantize_q8_0(weight: torch.Tensor) -> QuantizedTensor:
    rows, cols = weight.shape
    groups = weight.float().reshape(-1, GROUP)
    scale = groups.abs().amax(dim=1, keepdim=True) / 127.0
    # Quantize with the scale as stored (fp16), so dequantization reproduces exactly what was rounded.
    scale = scale.to(torch.float16).float()
    inverse = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    q = torch.clamp(torch.round(groups * inverse), -127, 127).to(torch.int8).view(torch.uint8)
    blocks = torch.cat([_fp16_bytes(scale), q], dim=1)
    return QuantizedTensor(blocks.reshape(rows, -1).contiguous(), int(Q.Q8_0), rows, cols)


def quantize_q4_1(weight: torch.Tensor) -> QuantizedTensor:
    rows, cols = weight.shape
    groups = weight.float().reshape(-1, GROUP)
    low, high = groups.amin(dim=1, keepdim=True), groups.amax(dim=1, keepdim=True)
    scale = ((high - low) / 15.0).to(torch.float16).float()
    low = low.to(torch.float16).float()
    inverse = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    q = torch.clamp(torch.round((groups - low) * inverse), 0, 15).to(torch.uint8)
    packed = q[:, :16] | (q[:, 16:] << 4)  # element j in the low nibble of byte j, j + 16 in the high one
    blocks = torch.cat([_fp16_bytes(scale), _fp16_bytes(low), packed], dim=1)
    return QuantizedTensor(blocks.reshape(rows, -1).contiguous(), int(Q.Q4_1), rows, cols)


_QUANTIZERS = {Q.Q8_0: quantize_q8_0, Q.Q4_1: quantize_q4_1}


def quantize_state_dict(
    weights: dict[str, torch.Tensor | QuantizedTensor], quantization: str
) -> dict[str, torch.Tensor | QuantizedTensor]:
    """Every float matrix whose rows split into groups of 32 becomes `FORMATS[quantization]`; vectors
    (norms, biases) and anything already quantized stay as they are."""
    target = FORMATS[quantization]
    out: dict[str, torch.Tensor | QuantizedTensor] = {}
    for name, tensor in weights.items():
        if isinstance(tensor, QuantizedTensor) or tensor.dim() != 2 or tensor.shape[1] % GROUP:
            out[name] = tensor
            continue
        kind = Q.Q8_0 if name in _HIGH_PRECISION else target
        out[name] = _QUANTIZERS[kind](tensor)
    return out
