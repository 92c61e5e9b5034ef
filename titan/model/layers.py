"""Building blocks of a Llama-family decoder: linear projection, RMSNorm and the gated SiLU."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    """`y = x @ weight.T + bias`, with weight stored [out_features, in_features] as in HF checkpoints.

    This is the one seam where quantized-weight kernels plug in later, so every projection of the
    model goes through it. Parameters are allocated uninitialized: they are always overwritten by
    `load_weights`, and random init of a large model would cost seconds for nothing.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, device=device, dtype=dtype), requires_grad=False
        )
        self.bias: nn.Parameter | None = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class RMSNorm(nn.Module):
    """Root-mean-square norm; statistics in float32 like HF so half-precision runs stay faithful."""

    def __init__(
        self,
        hidden_size: int,
        eps: float,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            # One fused kernel instead of five elementwise passes.
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        normed = x.float()
        normed = normed * torch.rsqrt(normed.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU activation on a fused [.., 2 * intermediate] gate/up projection output."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)
