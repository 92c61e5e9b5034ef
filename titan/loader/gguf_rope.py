"""Rope scaling stored in a GGUF, translated back to the HF `rope_scaling` dict.

llama.cpp keeps linear/yarn scaling as metadata, but Llama 3 scaling only as a `rope_freqs` tensor of
per-frequency divisors. We fit the HF llama3 parameters to that tensor and check the fit reproduces it.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

# Llama 3.x checkpoints all use these; only used when the tensor has too few points to fit them.
_LLAMA3_FALLBACK = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def rope_scaling_from_metadata(fields: dict[str, Any], arch: str) -> dict[str, Any] | None:
    """Linear / yarn scaling from `{arch}.rope.scaling.*` keys; None when absent or "none"."""
    scaling_type = fields.get(f"{arch}.rope.scaling.type")
    factor = fields.get(f"{arch}.rope.scaling.factor")
    if scaling_type in (None, "none") or factor is None or float(factor) == 1.0:
        return None
    scaling: dict[str, Any] = {"rope_type": scaling_type, "factor": float(factor)}
    original_context = fields.get(f"{arch}.rope.scaling.original_context_length")
    if original_context:
        scaling["original_max_position_embeddings"] = int(original_context)
    return scaling


def inverse_frequencies(rope_theta: float, head_dim: int) -> np.ndarray:
    """The unscaled RoPE inverse frequencies, computed in float32 like the converter does."""
    exponents = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
    return (1.0 / np.power(np.float32(rope_theta), exponents)).astype(np.float32)


def llama3_rope_factors(rope_scaling: dict[str, Any], rope_theta: float, head_dim: int) -> np.ndarray:
    """The `rope_freqs` divisors llama.cpp's converter writes for HF llama3 scaling parameters."""
    factor = float(rope_scaling["factor"])
    low_freq_factor = float(rope_scaling["low_freq_factor"])
    high_freq_factor = float(rope_scaling["high_freq_factor"])
    old_context = float(rope_scaling["original_max_position_embeddings"])
    wavelengths = 2 * math.pi / inverse_frequencies(rope_theta, head_dim).astype(np.float64)
    smooth = (old_context / wavelengths - low_freq_factor) / (high_freq_factor - low_freq_factor)
    factors = 1.0 / ((1.0 - smooth) / factor + smooth)
    factors = np.where(wavelengths < old_context / high_freq_factor, 1.0, factors)
    factors = np.where(wavelengths > old_context / low_freq_factor, factor, factors)
    return factors.astype(np.float32)


def llama3_rope_scaling_from_factors(
    factors: np.ndarray, rope_theta: float, head_dim: int
) -> dict[str, Any] | None:
    """Recover HF llama3 `rope_scaling` from a `rope_freqs` tensor (None if it scales nothing)."""
    factors = np.asarray(factors, dtype=np.float64).reshape(-1)
    if factors.shape[0] != head_dim // 2:
        raise ValueError(f"rope_freqs has {factors.shape[0]} entries, expected head_dim/2 = {head_dim // 2}")
    factor = float(factors.max())
    if np.allclose(factors, 1.0):
        return None
    # In the smooth band 1/f = (1 - s)/factor + s with s linear in 1/wavelength:
    # s = (L/lf_gap) / wavelength - low/lf_gap, where lf_gap = high_freq_factor - low_freq_factor.
    # Only the slope and intercept are observable, so pin low_freq_factor = 1 (true for every Llama 3.x).
    wavelengths = 2 * math.pi / inverse_frequencies(rope_theta, head_dim).astype(np.float64)
    band = (factors > 1.0 + 1e-6) & (factors < factor * (1 - 1e-6))
    candidates = []
    if band.sum() >= 2:
        smooth = (1.0 / factors[band] - 1.0 / factor) / (1.0 - 1.0 / factor)
        slope, intercept = np.polyfit(1.0 / wavelengths[band], smooth, 1)
        if slope > 0 and intercept < 0:
            high_freq_factor = 1.0 - 1.0 / intercept
            candidates.append(
                {
                    "low_freq_factor": 1.0,
                    "high_freq_factor": round(high_freq_factor, 4),
                    "original_max_position_embeddings": round(slope * (high_freq_factor - 1.0)),
                }
            )
    candidates.append(dict(_LLAMA3_FALLBACK))
    for candidate in candidates:
        scaling = {"rope_type": "llama3", "factor": round(factor, 4), **candidate}
        rebuilt = llama3_rope_factors(scaling, rope_theta, head_dim)
        if np.allclose(rebuilt, factors, rtol=1e-3, atol=1e-5):
            return scaling
    raise ValueError("the GGUF's rope_freqs tensor does not match Llama 3 rope scaling; cannot load it")
