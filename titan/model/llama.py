"""Llama-family decoder (Llama, Mistral, Qwen2) over one flattened batch with a paged KV cache.

Projections are fused at load time (q/k/v into one, gate/up into one): fewer, wider GEMMs are much
faster than many narrow ones, especially on CPU.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from titan.config import ModelConfig
from titan.kernels import QuantizedTensor, cat_rows
from titan.kernels.ops import interleave
from titan.model.attention import AttentionMetadata, paged_attention
from titan.model.layers import Embedding, Linear, RMSNorm, silu_and_mul
from titan.model.native_decoder import NativeDecoderStack
from titan.model.rope import RotaryEmbedding, apply_rotary

Device = torch.device | str | None


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, device: Device, dtype: torch.dtype | None) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = self.head_dim**-0.5
        qkv_width = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        self.qkv_proj = Linear(config.hidden_size, qkv_width, config.attention_bias, device, dtype)
        # HF Llama puts the bias on o_proj too; Qwen2 only on q/k/v.
        output_bias = config.attention_bias and config.architecture != "Qwen2ForCausalLM"
        self.o_proj = Linear(self.num_heads * self.head_dim, config.hidden_size, output_bias, device, dtype)
        self.kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        if self.kv_cache is None:
            raise RuntimeError("no KV cache bound; call bind_kv_cache first")
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        query_key_width = (self.num_heads + self.num_kv_heads) * self.head_dim
        # q and k are adjacent in the fused output: rotate both with one pass.
        query_key = apply_rotary(
            qkv[:, :query_key_width].view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim),
            cos,
            sin,
        )
        query, key = query_key[:, : self.num_heads], query_key[:, self.num_heads :]
        value = qkv[:, query_key_width:].view(num_tokens, self.num_kv_heads, self.head_dim)
        key_cache, value_cache = self.kv_cache
        out = paged_attention(query, key, value, key_cache, value_cache, metadata, self.scale)
        return self.o_proj(out)


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, device: Device, dtype: torch.dtype | None) -> None:
        super().__init__()
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, False, device, dtype)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, False, device, dtype)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(hidden)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, device: Device, dtype: torch.dtype | None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, device, dtype)
        self.self_attn = LlamaAttention(config, device, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, device, dtype)
        self.mlp = LlamaMLP(config, device, dtype)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's MLP output, the residual stream before it is added).

        Deferring the residual add to the next layer lets the first layer start from the embeddings.
        """
        if residual is None:
            residual, normed = hidden, self.input_layernorm(hidden)
        else:
            normed, residual = self.input_layernorm.add_and_norm(hidden, residual)
        hidden = self.self_attn(normed, cos, sin, metadata)
        normed, residual = self.post_attention_layernorm.add_and_norm(hidden, residual)
        return self.mlp(normed), residual


# HF tensor name -> (our parameter name, shard index within the fused parameter).
_FUSED_SHARDS = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}
_LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")


class LlamaForCausalLM(nn.Module):
    """`forward` gives final-normed hidden states [T, hidden]; `compute_logits` maps chosen rows to vocab."""

    def __init__(self, config: ModelConfig, device: Device = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, device, dtype)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, device, dtype) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, device, dtype)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, False, device, dtype)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = RotaryEmbedding(
            config.head_dim,
            config.max_position_embeddings,
            config.rope_theta,
            config.rope_scaling,
            device=device,
            dtype=dtype or torch.get_default_dtype(),
        )
        # Built on the first step after weights and caches are in place (None: it cannot run here).
        self._native_stack: NativeDecoderStack | None | bool = False

    def bind_kv_cache(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Attach each layer's (key_cache, value_cache) [num_slots, num_kv_heads, head_dim]."""
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"expected {len(self.layers)} KV cache pairs, got {len(kv_caches)}")
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            layer.self_attn.kv_cache = kv_cache
        self._native_stack = False

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attention_metadata: AttentionMetadata
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(positions)
        if self._native_stack is False:
            self._native_stack = NativeDecoderStack.for_model(self)
        stack = self._native_stack
        if isinstance(stack, NativeDecoderStack) and stack.applies(hidden, attention_metadata):
            return stack(hidden, cos, sin, attention_metadata)
        residual: torch.Tensor | None = None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, cos, sin, attention_metadata)
        return self.norm(hidden) if residual is None else self.norm.add_and_norm(hidden, residual)[0]

    def compute_logits(self, hidden_rows: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> float32 logits [N, vocab]; call it only on rows that sample."""
        return self.lm_head(hidden_rows).float()

    def load_weights(self, weights: dict[str, torch.Tensor | QuantizedTensor]) -> None:
        """Load HF-named tensors, fusing q/k/v and gate/up; raises on missing, unexpected or misshaped.

        `QuantizedTensor` matrices stay in their GGML format (the tied lm_head shares the embedding's);
        anything else is copied in as a float parameter."""
        params = dict(self.named_parameters())
        shards: dict[str, dict[int, torch.Tensor | QuantizedTensor]] = {}
        unexpected: list[str] = []
        for name, tensor in weights.items():
            if name.endswith("rotary_emb.inv_freq"):
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue  # some tied checkpoints still ship a copy
            target, shard = self._target_of(name)
            if target not in params:
                unexpected.append(name)
                continue
            shards.setdefault(target, {})[shard] = tensor
        if unexpected:
            raise ValueError(f"unexpected weights: {', '.join(sorted(unexpected)[:10])}")

        missing = []
        for target, param in params.items():
            parts = shards.get(target)
            expected_shards = 3 if ".qkv_proj." in target else 2 if ".gate_up_proj." in target else 1
            if parts is None or len(parts) != expected_shards:
                missing.append(target)
                continue
            ordered = [parts[i] for i in range(expected_shards)]
            if any(isinstance(part, QuantizedTensor) for part in ordered):
                if self._load_quantized(target, param, ordered):
                    continue
                ordered = [p.dequantize() if isinstance(p, QuantizedTensor) else p for p in ordered]
            tensor = ordered[0] if expected_shards == 1 else torch.cat(ordered)
            if tensor.shape != param.shape:
                raise ValueError(f"{target}: expected shape {tuple(param.shape)}, got {tuple(tensor.shape)}")
            param.data = tensor.to(device=param.device, dtype=param.dtype).contiguous()
        if missing:
            raise ValueError(f"missing weights for: {', '.join(missing[:10])}")
        self._native_stack = False

    def _load_quantized(self, target: str, param: nn.Parameter, parts: list) -> bool:
        """Hand quantized parts to their Linear/Embedding; False if they must be dequantized instead
        (mixed with float shards, not a projection matrix, or a device/dtype the kernels do not run on)."""
        if param.device.type != "cpu" or param.dtype != torch.float32:
            return False
        if not all(isinstance(p, QuantizedTensor) for p in parts):
            return False
        module = self.get_submodule(target.rsplit(".", 1)[0])
        if not target.endswith(".weight") or not isinstance(module, Linear | Embedding):
            return False
        shape = torch.Size((sum(p.rows for p in parts), parts[0].cols))
        if shape != param.shape:
            raise ValueError(f"{target}: expected shape {tuple(param.shape)}, got {tuple(shape)}")
        # The native kernels' 8-row layout where they have it (titan.kernels.ops.interleave); a tied
        # lm_head shares the embedding's interleaved bytes, which lookups read through the inverse.
        if isinstance(module, Embedding):
            table = interleave(parts[0])
            module.load_quantized(table)
            if self.config.tie_word_embeddings:
                self.lm_head.load_quantized([table])
            return True
        fused = cat_rows(parts)
        module.load_quantized([interleave(part) for part in ([fused] if fused is not None else parts)])
        return True

    @staticmethod
    def _target_of(name: str) -> tuple[str, int]:
        match = _LAYER_NAME.match(name)
        if match is None:
            return name.removeprefix("model."), 0
        index, module, kind = match.groups()
        if module in _FUSED_SHARDS:
            fused, shard = _FUSED_SHARDS[module]
            return f"layers.{index}.{fused}.{kind}", shard
        return f"layers.{index}.{module}.{kind}", 0
