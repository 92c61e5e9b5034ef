"""Rotary position embedding (HF rotate-half convention) with optional Llama-3 / linear scaling."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from titan.kernels.ops import rotary as native_rotary


def rope_inverse_frequencies(head_dim: int, theta: float, rope_scaling: dict[str, Any] | None) -> torch.Tensor:
    """Per-pair rotation frequencies [head_dim // 2] in float32, computed exactly as HF does."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inverse_frequencies = 1.0 / (theta**exponents)
    if not rope_scaling:
        return inverse_frequencies
    rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    if rope_type == "default":
        return inverse_frequencies
    if rope_type == "linear":
        return inverse_frequencies / rope_scaling["factor"]
    if rope_type == "llama3":
        return _llama3_scaled(inverse_frequencies, rope_scaling)
    raise ValueError(f"unsupported rope_scaling type {rope_type!r} (supported: default, linear, llama3)")


def _llama3_scaled(inverse_frequencies: torch.Tensor, rope_scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 scaling: keep high frequencies, divide low ones by `factor`, blend in between."""
    factor = rope_scaling["factor"]
    low_freq_factor = rope_scaling["low_freq_factor"]
    high_freq_factor = rope_scaling["high_freq_factor"]
    original_context = rope_scaling["original_max_position_embeddings"]
    low_freq_wavelength = original_context / low_freq_factor
    high_freq_wavelength = original_context / high_freq_factor

    wavelengths = 2 * math.pi / inverse_frequencies
    scaled = torch.where(wavelengths > low_freq_wavelength, inverse_frequencies / factor, inverse_frequencies)
    smooth = (original_context / wavelengths - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelengths >= high_freq_wavelength) & (wavelengths <= low_freq_wavelength)
    return torch.where(is_medium, blended, scaled)


class RotaryEmbedding(nn.Module):
    """Caches cos/sin for every position once; a step indexes them with its position tensor.

    `cos_sin(positions)` is called once per step and its result shared by all layers, so the
    per-layer cost is only the rotation itself.
    """

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        rope_scaling: dict[str, Any] | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_positions = max_positions
        inverse_frequencies = rope_inverse_frequencies(head_dim, theta, rope_scaling)
        angles = torch.arange(max_positions, dtype=torch.float32)[:, None] * inverse_frequencies[None, :]
        # Only the half-width tables are stored: rotate-half uses the same angle for both halves.
        self.register_buffer("cos_cache", angles.cos().to(device=device, dtype=dtype), persistent=False)
        self.register_buffer("sin_cache", angles.sin().to(device=device, dtype=dtype), persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for each token, shaped [T, 1, head_dim // 2] to broadcast over heads."""
        return self.cos_cache[positions].unsqueeze(1), self.sin_cache[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate [T, heads, head_dim] by the per-token angles (rotate-half pairing: i with i + head_dim/2).

    `x` may be a strided view (e.g. the q/k part of a fused qkv output); the result is contiguous.
    """
    fused = native_rotary(x, cos, sin)
    if fused is not None:
        return fused
    half = x.shape[-1] // 2
    first, second = x[..., :half], x[..., half:]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    # out = x * cos + rotate_half(x) * sin, written half by half to avoid the cat of rotate_half.
    torch.mul(first, cos, out=out[..., :half]).addcmul_(second, sin, value=-1)
    torch.mul(second, cos, out=out[..., half:]).addcmul_(first, sin)
    return out
