"""The model on quantized weights: mixed GGML types within one fused projection, tied and untied heads,
and float shards mixed with quantized ones, each against the same model loaded with the dequantized
numbers (so any mismatch is in the loading/fusing, not in the rounding)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import gguf
import numpy as np
import pytest
import torch

from titan.config import ModelConfig
from titan.kernels import QuantizedTensor
from titan.model.attention import build_attention_metadata
from titan.model.llama import LlamaForCausalLM

Q = gguf.GGMLQuantizationType
CONFIG = ModelConfig(
    architecture="LlamaForCausalLM",
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    max_position_embeddings=64,
    tie_word_embeddings=False,
)
# A Q4_K_M-like mix: each projection's own type, q/k/v (and gate/up) of different types in one fused matrix.
TYPES = {
    "self_attn.q_proj": Q.Q4_1,
    "self_attn.k_proj": Q.Q8_0,
    "self_attn.v_proj": Q.F16,
    "self_attn.o_proj": Q.Q4_0,
    "mlp.gate_proj": Q.BF16,
    "mlp.up_proj": Q.BF16,
    "mlp.down_proj": Q.Q8_0,
}


def to_quantized(weight: torch.Tensor, kind: Q) -> QuantizedTensor:
    raw = np.ascontiguousarray(gguf.quants.quantize(weight.numpy(), kind)).view(np.uint8).reshape(weight.shape[0], -1)
    return QuantizedTensor(torch.from_numpy(raw.copy()), int(kind), *weight.shape)


def model_weights(config: ModelConfig, float_shard: str | None = None) -> dict[str, torch.Tensor | QuantizedTensor]:
    generator = torch.Generator().manual_seed(0)
    weights: dict[str, torch.Tensor | QuantizedTensor] = {
        "model.embed_tokens.weight": to_quantized(torch.randn(config.vocab_size, 64, generator=generator), Q.Q8_0),
        "model.norm.weight": 1 + 0.1 * torch.randn(64, generator=generator),
    }
    if not config.tie_word_embeddings:
        head = 0.3 * torch.randn(config.vocab_size, 64, generator=generator)
        weights["lm_head.weight"] = to_quantized(head, Q.Q4_1)
    shapes = {"self_attn.q_proj": (64, 64), "self_attn.k_proj": (32, 64), "self_attn.v_proj": (32, 64),
              "self_attn.o_proj": (64, 64), "mlp.gate_proj": (96, 64), "mlp.up_proj": (96, 64),
              "mlp.down_proj": (64, 96)}
    for layer in range(config.num_hidden_layers):
        prefix = f"model.layers.{layer}."
        weights[prefix + "input_layernorm.weight"] = 1 + 0.1 * torch.randn(64, generator=generator)
        weights[prefix + "post_attention_layernorm.weight"] = 1 + 0.1 * torch.randn(64, generator=generator)
        for name, shape in shapes.items():
            weight = 0.2 * torch.randn(*shape, generator=generator)
            weights[prefix + name + ".weight"] = weight if name == float_shard else to_quantized(weight, TYPES[name])
    return weights


def dequantized(weights: dict[str, torch.Tensor | QuantizedTensor]) -> dict[str, torch.Tensor]:
    return {name: t.dequantize() if isinstance(t, QuantizedTensor) else t for name, t in weights.items()}


def logits(model: LlamaForCausalLM, tokens: list[int]) -> torch.Tensor:
    cache_shape = (65, CONFIG.num_key_value_heads, CONFIG.head_dim)
    model.bind_kv_cache([(torch.zeros(cache_shape), torch.zeros(cache_shape)) for _ in model.layers])
    metadata, positions = build_attention_metadata([len(tokens)], [0], [[0, 1, 2, 3]], 16, torch.device("cpu"),
                                                   null_slot=64)
    with torch.inference_mode():
        return model.compute_logits(model(torch.tensor(tokens), positions, metadata))


@pytest.fixture(params=[0, 16], ids=["float-activations", "int16-activations"])
def activation_bits(request: pytest.FixtureRequest, set_activation_bits: Callable[[int], None]) -> int:
    set_activation_bits(request.param)
    return request.param


# Float activations: the quantized layers compute what float layers with the dequantized weights do, up to
# summation order. Rounded to int16 per block of 32 (the default), the Q4_1 / Q8_0 shards add that rounding.
TWIN_TOLERANCE = {0: 1e-4, 16: 1e-2}


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("float_shard", [None, "self_attn.v_proj"])
def test_quantized_model_matches_its_dequantized_twin(
    tied: bool, float_shard: str | None, activation_bits: int
) -> None:
    config = dataclasses.replace(CONFIG, tie_word_embeddings=tied)
    weights = model_weights(config, float_shard)
    quantized_model, float_model = LlamaForCausalLM(config), LlamaForCausalLM(config)
    quantized_model.load_weights(weights)
    float_model.load_weights(dequantized(weights))

    qkv = quantized_model.layers[0].self_attn.qkv_proj
    if float_shard is None:
        assert qkv.quantized is not None and [p.type_name for p in qkv.quantized] == ["Q4_1", "Q8_0", "F16"]
    else:
        assert qkv.quantized is None  # a float shard among quantized ones: the fused matrix is float
    assert [p.type_name for p in quantized_model.layers[1].mlp.gate_up_proj.quantized] == ["BF16"]  # one type: fused
    if tied:
        assert quantized_model.lm_head.quantized[0] is quantized_model.embed_tokens.quantized

    tokens = [3, 17, 5, 90, 41, 41, 8, 60, 2, 33]
    tolerance = TWIN_TOLERANCE[activation_bits]
    torch.testing.assert_close(logits(quantized_model, tokens), logits(float_model, tokens), atol=tolerance,
                               rtol=tolerance)


def test_misshaped_quantized_weight_is_rejected() -> None:
    weights = model_weights(CONFIG)
    name = "model.layers.0.mlp.down_proj.weight"
    weights[name] = to_quantized(torch.randn(64, 64), Q.Q8_0)  # expects [64, 96]
    with pytest.raises(ValueError, match="down_proj"):
        LlamaForCausalLM(CONFIG).load_weights(weights)
