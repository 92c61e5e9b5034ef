"""--quantization int8 / int4: float matrices quantized at load into Q8_0 / Q4_1 blocks, checked against
gguf's reference dequantization of the bytes we wrote."""

from __future__ import annotations

import os

import gguf
import numpy as np
import pytest
import torch

from titan.kernels import QuantizedTensor
from titan.kernels.quantize import quantize_q4_1, quantize_q8_0, quantize_state_dict
from titan.loader import load_model_files

Q = gguf.GGMLQuantizationType


def reference_dequantize(tensor: QuantizedTensor) -> torch.Tensor:
    return torch.from_numpy(np.array(gguf.quants.dequantize(tensor.data.numpy(), Q(tensor.ggml_type)), np.float32))


@pytest.mark.parametrize(("quantize", "kind", "bound"), [(quantize_q8_0, Q.Q8_0, 0.01), (quantize_q4_1, Q.Q4_1, 0.1)])
def test_blocks_follow_the_ggml_layout(quantize, kind: Q, bound: float) -> None:
    weight = torch.randn(48, 320, generator=torch.Generator().manual_seed(0))
    weight[3] = 0.0  # an all-zero group must not divide by zero
    quantized = quantize(weight)
    assert quantized.type_name == kind.name and quantized.shape == weight.shape
    restored = reference_dequantize(quantized)
    assert torch.equal(quantized.dequantize(), restored)  # our kernels read what gguf's reference reads
    assert torch.equal(restored[3], torch.zeros(320))
    # Round-to-nearest: within half a quantization step of each group (plus fp16 rounding of the minimum).
    assert ((restored - weight).norm() / weight.norm()).item() < bound
    groups = weight.reshape(-1, 32)
    span = groups.abs().amax(1) * 2 / 255 if kind == Q.Q8_0 else (groups.amax(1) - groups.amin(1)) / 15
    assert ((restored - weight).reshape(-1, 32).abs().amax(1) <= span * 0.5 + 1e-3).all()


def test_state_dict_keeps_vectors_and_output_precision() -> None:
    weights = {
        "model.embed_tokens.weight": torch.randn(64, 32),
        "model.layers.0.mlp.down_proj.weight": torch.randn(32, 64),
        "model.layers.0.input_layernorm.weight": torch.ones(32),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(32, 40),  # 40 is not a multiple of 32
    }
    out = quantize_state_dict(weights, "int4")
    assert out["model.embed_tokens.weight"].type_name == "Q8_0"
    assert out["model.layers.0.mlp.down_proj.weight"].type_name == "Q4_1"
    assert out["model.layers.0.input_layernorm.weight"] is weights["model.layers.0.input_layernorm.weight"]
    assert isinstance(out["model.layers.0.self_attn.q_proj.weight"], torch.Tensor)


def test_default_model_int8_at_load() -> None:
    files = load_model_files("default", "int8")
    kinds = {t.type_name for t in files.weights.values() if isinstance(t, QuantizedTensor)}
    assert kinds == {"Q8_0"}
    assert sum(isinstance(t, QuantizedTensor) for t in files.weights.values()) == 1 + 30 * 7


def test_engine_config_and_flags_validate_quantization_and_threads() -> None:
    import argparse

    from titan.config import EngineConfig
    from titan.config_flags import add_engine_arguments, engine_config_from_args
    from titan.kernels.threads import physical_cores

    assert EngineConfig().quantization == "auto" and EngineConfig().threads is None
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(quantization="fp8")
    with pytest.raises(ValueError, match="threads"):
        EngineConfig(threads=0)
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    config = engine_config_from_args(parser.parse_args(["--quantization", "int4", "--threads", "3"]))
    assert (config.quantization, config.threads) == ("int4", 3)
    assert 1 <= physical_cores() <= (os.cpu_count() or 1)


def test_default_threads_follow_omp_num_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    # Replicas sharing a host are split with OMP_NUM_THREADS (the chaos fleet, the router benchmarks, the
    # Kubernetes manifests); a default that ignored it oversubscribed the cores.
    import torch

    from titan.kernels.threads import configure_threads, physical_cores

    before = torch.get_num_threads()
    try:
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        assert configure_threads(None) == 1 and torch.get_num_threads() == 1
        assert configure_threads(2) == 2  # --threads wins
        monkeypatch.setenv("OMP_NUM_THREADS", "garbage")
        assert configure_threads(None) == physical_cores()
        monkeypatch.delenv("OMP_NUM_THREADS")
        assert configure_threads(None) == physical_cores()
    finally:
        torch.set_num_threads(before)
