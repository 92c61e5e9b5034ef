"""Read a GGUF file into a `ModelConfig` and an HF-named state dict (quantized or float32)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from titan.config import ModelConfig
from titan.kernels import SUPPORTED_TYPES, QuantizedTensor
from titan.loader.gguf_rope import llama3_rope_scaling_from_factors, rope_scaling_from_metadata

# llama.cpp writes Mistral checkpoints with the "llama" architecture too.
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}

# Architectures whose converter interleaves q/k rows for GGML's rope (Qwen2 keeps the HF order).
_PERMUTED_ARCHITECTURES = ("llama",)

_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_TENSOR_PATTERN = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_ROPE_FREQS = "rope_freqs.weight"


def load_gguf(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Open `path` and return its config and dequantized HF-named weights."""
    reader = gguf.GGUFReader(path)
    config = read_gguf_config(reader)
    return config, read_gguf_state_dict(reader, config)


def read_gguf_fields(reader: gguf.GGUFReader) -> dict[str, Any]:
    """Scalar metadata as plain Python values (arrays such as the vocabulary are skipped: they are slow)."""
    fields: dict[str, Any] = {}
    for name, field in reader.fields.items():
        if field.types and field.types[0] != gguf.GGUFValueType.ARRAY:
            fields[name] = field.contents()
    return fields


def read_gguf_config(reader: gguf.GGUFReader) -> ModelConfig:
    fields = read_gguf_fields(reader)
    arch = fields.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"unsupported GGUF architecture {arch!r}; supported: {', '.join(sorted(GGUF_ARCHITECTURES))}"
        )
    tensors = {tensor.name: tensor for tensor in reader.tensors}

    def required(key: str) -> Any:
        value = fields.get(f"{arch}.{key}")
        if value is None:
            raise ValueError(f"GGUF metadata lacks {arch}.{key}")
        return value

    hidden_size = int(required("embedding_length"))
    num_heads = int(required("attention.head_count"))
    head_dim = int(fields.get(f"{arch}.attention.key_length") or hidden_size // num_heads)
    rotary_dims = fields.get(f"{arch}.rope.dimension_count")
    if rotary_dims is not None and int(rotary_dims) != head_dim:
        raise ValueError(f"partial rotary embeddings ({rotary_dims} of {head_dim} dims) are not supported")
    rope_theta = _float32_to_float(fields.get(f"{arch}.rope.freq_base", 10000.0))
    rope_scaling = rope_scaling_from_metadata(fields, arch)
    if rope_scaling is None and _ROPE_FREQS in tensors:
        factors = gguf.quants.dequantize(tensors[_ROPE_FREQS].data, tensors[_ROPE_FREQS].tensor_type)
        rope_scaling = llama3_rope_scaling_from_factors(factors, rope_theta, head_dim)
    if "token_embd.weight" not in tensors:
        raise ValueError("GGUF has no token_embd.weight tensor")
    return ModelConfig(
        architecture=GGUF_ARCHITECTURES[arch],
        # The embedding matrix is authoritative; `vocab_size` metadata is optional in GGUF.
        vocab_size=int(tensors["token_embd.weight"].shape[-1]),
        hidden_size=hidden_size,
        intermediate_size=int(required("feed_forward_length")),
        num_hidden_layers=int(required("block_count")),
        num_attention_heads=num_heads,
        num_key_value_heads=int(fields.get(f"{arch}.attention.head_count_kv") or num_heads),
        head_dim=head_dim,
        rms_norm_eps=_float32_to_float(required("attention.layer_norm_rms_epsilon")),
        rope_theta=rope_theta,
        max_position_embeddings=int(fields.get(f"{arch}.context_length") or 2048),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        rope_scaling=rope_scaling,
    )


def read_gguf_state_dict(reader: gguf.GGUFReader, config: ModelConfig) -> dict[str, torch.Tensor]:
    """Dequantize every tensor to float32 under its HF name, undoing llama.cpp's q/k row permutation."""
    return _read_state_dict(reader, config, quantized=False)  # type: ignore[return-value]


def read_gguf_quantized_state_dict(
    reader: gguf.GGUFReader, config: ModelConfig
) -> dict[str, torch.Tensor | QuantizedTensor]:
    """As `read_gguf_state_dict`, but matrices of a kernel-supported GGML type stay `QuantizedTensor`
    (their raw block bytes; the q/k permutation moves whole rows, so it applies to the bytes as well).
    Vectors, float32 matrices and types the kernels lack come back as float32 tensors."""
    return _read_state_dict(reader, config, quantized=True)


def _read_state_dict(
    reader: gguf.GGUFReader, config: ModelConfig, quantized: bool
) -> dict[str, torch.Tensor | QuantizedTensor]:
    arch = reader.fields["general.architecture"].contents()
    state_dict: dict[str, torch.Tensor | QuantizedTensor] = {}
    for tensor in reader.tensors:
        if tensor.name == _ROPE_FREQS:
            continue  # folded into config.rope_scaling
        name = hf_tensor_name(tensor.name)
        keep = quantized and len(tensor.shape) == 2 and tensor.tensor_type in SUPPORTED_TYPES
        keep = keep and tensor.tensor_type != gguf.GGMLQuantizationType.F32
        weight = QuantizedTensor.from_gguf(tensor) if keep else dequantize_tensor(tensor)
        if arch in _PERMUTED_ARCHITECTURES:
            if ".self_attn.q_proj." in name:
                weight = unpermute_rope_rows(weight, config.num_attention_heads)
            elif ".self_attn.k_proj." in name:
                weight = unpermute_rope_rows(weight, config.num_key_value_heads)
        state_dict[name] = weight
    return state_dict


def hf_tensor_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    match = _LAYER_TENSOR_PATTERN.fullmatch(gguf_name)
    if match is None or match.group(2) not in _LAYER_TENSORS:
        raise ValueError(f"unexpected GGUF tensor {gguf_name!r} for a Llama-family model")
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{_LAYER_TENSORS[part]}.{kind}"


def dequantize_tensor(tensor: gguf.ReaderTensor) -> torch.Tensor:
    """A float32 torch tensor in HF shape ([out_features, in_features] for matrices)."""
    try:
        array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError:
        raise ValueError(
            f"tensor {tensor.name} uses GGML type {tensor.tensor_type.name}, which cannot be dequantized"
        ) from None
    # F32 comes back as a view of the read-only memory map; everything else is already a fresh array.
    array = np.array(array, dtype=np.float32, copy=tensor.tensor_type == gguf.GGMLQuantizationType.F32)
    return torch.from_numpy(array)


def unpermute_rope_rows(weight: torch.Tensor | QuantizedTensor, num_heads: int) -> torch.Tensor | QuantizedTensor:
    """Undo llama.cpp's per-head row interleave: GGML rope pairs rows (2j, 2j+1), HF pairs (j, j+d/2)."""
    if isinstance(weight, QuantizedTensor):
        return weight.with_rows(unpermute_rope_rows(weight.data, num_heads))
    rows = weight.shape[0]
    head_dim = rows // num_heads
    return (
        weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:])
        .transpose(1, 2)
        .reshape(weight.shape)
        .contiguous()
    )


def _float32_to_float(value: float) -> float:
    """GGUF stores float32: 1e-5 reads back as 9.99999974e-06, so keep the shortest float32 spelling."""
    return float(str(np.float32(value)))
