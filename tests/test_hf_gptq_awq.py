"""HF GPTQ / AWQ 4-bit checkpoints: tiny folders built from random integers with a reference packer
written from the formats' documentation (AutoGPTQ: qweight packed along inputs, qzeros along outputs,
v1 stores zero - 1; AutoAWQ GEMM: both packed along outputs in the order 0 2 4 6 1 3 5 7), loaded
through `load_model_files` and compared with (q - zero) * scale computed from the unpacked integers."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from titan.kernels import QuantizedTensor
from titan.loader import load_model_files
from titan.model.attention import build_attention_metadata
from titan.model.llama import LlamaForCausalLM

HIDDEN, INTER, LAYERS, VOCAB, HEAD_DIM = 128, 256, 2, 96, 32  # 4 heads, 2 KV heads
SHAPES = {  # name -> (out N, in K)
    "self_attn.q_proj": (HIDDEN, HIDDEN), "self_attn.k_proj": (64, HIDDEN), "self_attn.v_proj": (64, HIDDEN),
    "self_attn.o_proj": (HIDDEN, HIDDEN), "mlp.gate_proj": (INTER, HIDDEN), "mlp.up_proj": (INTER, HIDDEN),
    "mlp.down_proj": (HIDDEN, INTER),
}
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def pack_along_rows(values: torch.Tensor) -> torch.Tensor:
    """[R*8, C] of 0..15 -> int32 [R, C]: value of row 8r + j in bits 4j..4j+3."""
    grouped = values.to(torch.int64).reshape(-1, 8, values.shape[1])
    packed = sum(grouped[:, j] << (4 * j) for j in range(8))
    return _to_int32(packed)


def pack_along_columns(values: torch.Tensor, order: list[int] | None = None) -> torch.Tensor:
    """[R, C*8] -> int32 [R, C]: column 8c + order[p] in bits 4p..4p+3 (order: identity by default)."""
    order = order or list(range(8))
    grouped = values.to(torch.int64).reshape(values.shape[0], -1, 8)
    packed = sum(grouped[:, :, order[p]] << (4 * p) for p in range(8))
    return _to_int32(packed)


def _to_int32(packed: torch.Tensor) -> torch.Tensor:
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)  # two's complement


def random_layer(n: int, k: int, group: int, symmetric: bool, generator: torch.Generator):
    groups = k // (k if group == -1 else group)
    q = torch.randint(0, 16, (k, n), generator=generator)
    # GPTQ v1 stores zero - 1 in 4 bits, so a zero of 0 cannot be written; real v1 checkpoints avoid it too.
    zeros = torch.full((groups, n), 8) if symmetric else torch.randint(1, 16, (groups, n), generator=generator)
    scales = (0.01 + 0.02 * torch.rand(groups, n, generator=generator)).to(torch.float16)
    group_of_input = torch.arange(k) // (k if group == -1 else group)
    reference = ((q - zeros[group_of_input]).float() * scales.float()[group_of_input]).T  # [N, K]
    return q, zeros, scales, reference


def write_checkpoint(folder: Path, method: str, group: int, symmetric: bool, checkpoint_format: str = "gptq"):
    """A tiny Llama whose projections are GPTQ / AWQ packed; returns the reference float32 weights."""
    generator = torch.Generator().manual_seed(0)
    folder.mkdir()
    tensors: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": torch.randn(VOCAB, HIDDEN, generator=generator).half(),
        "model.norm.weight": torch.ones(HIDDEN).half(),
        "lm_head.weight": (0.3 * torch.randn(VOCAB, HIDDEN, generator=generator)).half(),
    }
    references: dict[str, torch.Tensor] = {}
    for layer in range(LAYERS):
        prefix = f"model.layers.{layer}."
        tensors[prefix + "input_layernorm.weight"] = torch.ones(HIDDEN).half()
        tensors[prefix + "post_attention_layernorm.weight"] = torch.ones(HIDDEN).half()
        for name, (n, k) in SHAPES.items():
            q, zeros, scales, reference = random_layer(n, k, group, symmetric, generator)
            base = prefix + name
            references[base + ".weight"] = reference
            tensors[base + ".scales"] = scales
            if method == "gptq":
                stored_zeros = zeros - 1 if checkpoint_format == "gptq" else zeros
                tensors[base + ".qweight"] = pack_along_rows(q)
                tensors[base + ".qzeros"] = pack_along_columns(stored_zeros & 0xF)
                tensors[base + ".g_idx"] = (torch.arange(k) // (k if group == -1 else group)).to(torch.int32)
            else:
                tensors[base + ".qweight"] = pack_along_columns(q, AWQ_ORDER)
                tensors[base + ".qzeros"] = pack_along_columns(zeros, AWQ_ORDER)
    save_file(tensors, str(folder / "model.safetensors"))
    qconfig = {"quant_method": method, "bits": 4, "group_size": group}
    if method == "gptq":
        qconfig |= {"sym": symmetric, "desc_act": False, "checkpoint_format": checkpoint_format}
    else:
        qconfig |= {"zero_point": True, "version": "gemm"}
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB, "hidden_size": HIDDEN,
        "intermediate_size": INTER, "num_hidden_layers": LAYERS, "num_attention_heads": 4,
        "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 64,
        "tie_word_embeddings": False, "quantization_config": qconfig,
    }
    (folder / "config.json").write_text(json.dumps(config))
    return references


CASES = [
    pytest.param("gptq", 128, False, "gptq", id="gptq-g128-asym-v1"),
    pytest.param("gptq", 32, True, "gptq", id="gptq-g32-sym-v1"),
    pytest.param("gptq", -1, False, "gptq_v2", id="gptq-per-channel-v2"),
    pytest.param("awq", 128, False, "", id="awq-g128"),
    pytest.param("awq", -1, True, "", id="awq-per-channel"),
]


@pytest.mark.parametrize(("method", "group", "symmetric", "checkpoint_format"), CASES)
def test_checkpoint_maps_onto_ggml_blocks(tmp_path: Path, method: str, group: int, symmetric: bool,
                                          checkpoint_format: str, set_activation_bits: Callable[[int], None]) -> None:
    # Float activations: the forward pass below compares the mapping itself (the default int16 rounding of
    # activations is tested in test_kernels.py and test_quantized_model.py).
    set_activation_bits(0)
    references = write_checkpoint(tmp_path / "ckpt", method, group, symmetric, checkpoint_format or "gptq")
    files = load_model_files(str(tmp_path / "ckpt"), "auto")
    for name, reference in references.items():
        weight = files.weights[name]
        assert isinstance(weight, QuantizedTensor), name
        assert weight.type_name == ("Q4_0" if symmetric else "Q4_1")
        if symmetric:  # d = scale exactly: the checkpoint's own numbers
            assert torch.equal(weight.dequantize(), reference), name
        else:  # m = -zero * scale rounded to fp16: within 2^-11 of |m| <= 15 * 0.03
            assert (weight.dequantize() - reference).abs().max() <= 15 * 0.03 * 2**-11 + 1e-6, name
    assert not any(name.endswith((".qweight", ".qzeros", ".scales", ".g_idx")) for name in files.weights)

    # --quantization none: the same numbers as float32; and a forward pass agrees between the two.
    plain = load_model_files(str(tmp_path / "ckpt"), "none")
    for name, reference in references.items():
        assert torch.allclose(plain.weights[name], reference, atol=1e-6), name
    outputs = []
    for loaded in (files, plain):
        model = LlamaForCausalLM(loaded.config)
        model.load_weights(loaded.weights)
        model.bind_kv_cache([(torch.zeros(65, 2, HEAD_DIM), torch.zeros(65, 2, HEAD_DIM)) for _ in range(LAYERS)])
        metadata, positions = build_attention_metadata([6], [0], [[0, 1, 2, 3]], 16, torch.device("cpu"),
                                                       null_slot=64)
        with torch.inference_mode():
            outputs.append(model.compute_logits(model(torch.tensor([1, 5, 9, 30, 2, 77]), positions, metadata)))
    # Symmetric: identical weights, so only summation order differs; asymmetric: fp16-rounded minimums.
    error = ((outputs[0] - outputs[1]).abs().max() / outputs[1].abs().max()).item()
    assert error < (1e-5 if symmetric else 1e-2)


def test_act_order_layers_fall_back_to_float(tmp_path: Path) -> None:
    write_checkpoint(tmp_path / "ckpt", "gptq", 32, True)
    from safetensors.torch import load_file

    tensors = load_file(str(tmp_path / "ckpt" / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj.g_idx"
    tensors[name] = (torch.arange(INTER) % (INTER // 32)).to(torch.int32)  # act-order: groups interleaved
    save_file(tensors, str(tmp_path / "ckpt" / "model.safetensors"))
    files = load_model_files(str(tmp_path / "ckpt"), "auto")
    assert isinstance(files.weights["model.layers.0.mlp.down_proj.weight"], torch.Tensor)
    assert isinstance(files.weights["model.layers.0.mlp.up_proj.weight"], QuantizedTensor)


def test_unsupported_quantization_config_is_refused(tmp_path: Path) -> None:
    write_checkpoint(tmp_path / "ckpt", "awq", 128, False)
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "bits": 4}
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="bitsandbytes"):
        load_model_files(str(tmp_path / "ckpt"), "auto")
