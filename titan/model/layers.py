"""Building blocks of a Llama-family decoder: linear projection, RMSNorm and the gated SiLU."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from titan.kernels import QuantizedTensor, embedding, quantized_linear
from titan.kernels.ops import add_rms_norm, rms_norm
from titan.kernels.ops import silu_and_mul as native_silu_and_mul


class Linear(nn.Module):
    """`y = x @ weight.T + bias`, with weight stored [out_features, in_features] as in HF checkpoints.

    This is the one seam where quantized-weight kernels plug in: `load_quantized` replaces the float
    weight with GGML-format parts (one per fused shard type) that the kernels read directly. Parameters
    are allocated uninitialized: they are always overwritten by `load_weights`, and random init of a
    large model would cost seconds for nothing.
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
        self.quantized: list[QuantizedTensor] | None = None

    def load_quantized(self, parts: list[QuantizedTensor]) -> None:
        """Compute on these row blocks (stacked in order) instead of a float weight."""
        if sum(p.rows for p in parts) != self.out_features or any(p.cols != self.in_features for p in parts):
            raise ValueError(f"quantized parts do not make a [{self.out_features}, {self.in_features}] weight")
        self.quantized = parts
        # An empty placeholder keeps the parameter name without holding a float copy.
        self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quantized is None:
            return F.linear(x, self.weight, self.bias)
        if len(self.quantized) == 1:
            out = quantized_linear(x, self.quantized[0])
        else:
            out = torch.cat([quantized_linear(x, part) for part in self.quantized], dim=-1)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        kinds = "" if self.quantized is None else f", quantized={'+'.join(p.type_name for p in self.quantized)}"
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}{kinds}"


class Embedding(nn.Module):
    """Token embedding; a quantized table dequantizes only the rows it looks up."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.weight = nn.Parameter(
            torch.empty(num_embeddings, embedding_dim, device=device, dtype=dtype), requires_grad=False
        )
        self.quantized: QuantizedTensor | None = None

    def load_quantized(self, table: QuantizedTensor) -> None:
        if table.shape != (self.num_embeddings, self.embedding_dim):
            expected = (self.num_embeddings, self.embedding_dim)
            raise ValueError(f"embedding: expected shape {expected}, got {tuple(table.shape)}")
        self.quantized = table
        self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.quantized is None:
            return F.embedding(ids, self.weight)
        return embedding(ids.cpu(), self.quantized).to(device=ids.device, dtype=self.weight.dtype)

    def extra_repr(self) -> str:
        kind = "" if self.quantized is None else f", quantized={self.quantized.type_name}"
        return f"{self.num_embeddings}, {self.embedding_dim}{kind}"


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
            # The native kernel where it loads (decode-sized rows cost ~1 us there, ~30 us in torch),
            # else one fused torch op instead of five elementwise passes.
            native = rms_norm(x, self.weight, self.eps)
            return native if native is not None else F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        normed = x.float()
        normed = normed * torch.rsqrt(normed.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x): the residual add fused into the norm where native."""
        fused = add_rms_norm(x, residual, self.weight, self.eps)
        if fused is not None:
            return fused
        total = residual + x
        return self(total), total

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU activation on a fused [.., 2 * intermediate] gate/up projection output."""
    fused = native_silu_and_mul(gate_up)
    if fused is not None:
        return fused
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)
