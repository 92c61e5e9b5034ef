"""GGUF reading on tiny synthetic files: dequantization per type, llama.cpp's q/k permutation, config, rope.

Each file is written the way llama.cpp's converter would write an HF checkpoint (names, q/k row interleave,
quantized blocks), then read back with `titan.loader.gguf_weights` and checked against the HF originals and
against transformers' own GGUF loader.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from titan.config import ModelConfig
from titan.kernels import weights_equal
from titan.loader import load_model_files
from titan.loader.cache import _convert_atomically, cache_folder_for, dequantize_state_dict, load_gguf_cached
from titan.loader.gguf_rope import llama3_rope_scaling_from_factors
from titan.loader.gguf_weights import load_gguf

Q = gguf.GGMLQuantizationType

_LAYER_PARTS = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_name(hf_name: str) -> str:
    fixed = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf_name in fixed:
        return fixed[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    part, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_LAYER_PARTS[part]}.{kind}"


def interleave_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to llama q/k rows: per head, rows (j, j+d/2) become (2j, 2j+1)."""
    return (
        weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


# --- Hand-made K-quant blocks (gguf-py can dequantize these types but not quantize them). ---
# Layouts follow ggml's block_q4_K / block_q6_K; a layout mistake shows up as errors of the weights' size.


def _f16(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16)


def quantize_q4_k(rows: np.ndarray) -> np.ndarray:
    """block_q4_K: f16 d, f16 dmin, 12 bytes of packed 6-bit scales/mins, 128 bytes of 4-bit values."""
    blocks = rows.reshape(-1, 8, 32).astype(np.float64)  # 8 sub-blocks of 32 per 256-value super-block
    low = np.minimum(blocks.min(-1), 0.0)
    scales, mins = (blocks.max(-1) - low) / 15, -low
    d, dmin = _f16(scales.max(-1) / 63), _f16(mins.max(-1) / 63)
    d64, dmin64 = d.astype(np.float64)[:, None], dmin.astype(np.float64)[:, None]
    scale_codes = np.clip(np.round(scales / np.where(d64 > 0, d64, 1)), 0, 63).astype(np.uint8)
    min_codes = np.clip(np.round(mins / np.where(dmin64 > 0, dmin64, 1)), 0, 63).astype(np.uint8)
    step = (d64 * scale_codes)[..., None]
    offset = (dmin64 * min_codes)[..., None]
    values = np.clip(np.round((blocks + offset) / np.where(step > 0, step, 1)), 0, 15).astype(np.uint8)
    packed = np.zeros((blocks.shape[0], 12), dtype=np.uint8)
    packed[:, 0:4] = (scale_codes[:, :4] & 63) | ((scale_codes[:, 4:] >> 4) << 6)
    packed[:, 4:8] = (min_codes[:, :4] & 63) | ((min_codes[:, 4:] >> 4) << 6)
    packed[:, 8:12] = (scale_codes[:, 4:] & 15) | ((min_codes[:, 4:] & 15) << 4)
    pairs = values.reshape(-1, 4, 2, 32)  # sub-blocks 2c and 2c+1 share 32 bytes: low and high nibbles
    nibbles = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(-1, 128)
    out = np.concatenate(
        [d.reshape(-1, 1).view(np.uint8), dmin.reshape(-1, 1).view(np.uint8), packed, nibbles], 1
    )
    return out.reshape(rows.shape[0], -1)


def quantize_q6_k(rows: np.ndarray) -> np.ndarray:
    """block_q6_K: 128 bytes low nibbles, 64 bytes high 2-bit pairs, 16 int8 scales, f16 d."""
    blocks = rows.reshape(-1, 16, 16).astype(np.float64)  # 16 sub-blocks of 16 per super-block
    extreme = np.take_along_axis(blocks, np.abs(blocks).argmax(-1)[..., None], -1)[..., 0]
    scales = extreme / -32
    d = _f16(np.abs(scales).max(-1) / 127)
    d64 = d.astype(np.float64)[:, None]
    scale_codes = np.clip(np.round(scales / np.where(d64 > 0, d64, 1)), -127, 127).astype(np.int8)
    step = (d64 * scale_codes)[..., None]
    values = np.clip(np.round(blocks / np.where(step != 0, step, 1)), -32, 31) + 32
    values = values.astype(np.uint8).reshape(-1, 2, 128)  # two halves of 128 values
    low = (values[..., :64] & 15) | ((values[..., 64:] & 15) << 4)
    high = values >> 4
    high = high[..., 0:32] | (high[..., 32:64] << 2) | (high[..., 64:96] << 4) | (high[..., 96:128] << 6)
    out = np.concatenate(
        [
            low.reshape(-1, 128),
            high.reshape(-1, 64),
            scale_codes.view(np.uint8),
            d.reshape(-1, 1).view(np.uint8),
        ],
        1,
    )
    return out.reshape(rows.shape[0], -1)


def encode(weight: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    if qtype == Q.Q4_K:
        return quantize_q4_k(weight)
    if qtype == Q.Q6_K:
        return quantize_q6_k(weight)
    return gguf.quants.quantize(weight, qtype)


def byte_level_characters() -> list[str]:
    """GPT-2's printable stand-in character for each byte value."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    characters, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            characters[byte] = chr(byte)
        else:
            characters[byte] = chr(256 + extra)
            extra += 1
    return [characters[byte] for byte in range(256)]


def add_tiny_tokenizer(writer: gguf.GGUFWriter, vocab_size: int) -> None:
    """A byte-level BPE vocabulary of exactly `vocab_size` tokens, so the cache can write tokenizer files."""
    tokens = byte_level_characters()
    letters = "abcdefghijklmnop"
    merges = [f"{first} {second}" for first in letters for second in letters][: vocab_size - 257]
    tokens += [merge.replace(" ", "") for merge in merges] + ["<|endoftext|>"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (len(tokens) - 1) + [3])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(len(tokens) - 1)
    writer.add_eos_token_id(len(tokens) - 1)


def write_gguf(
    path: Path,
    arch: str,
    hf_config: LlamaConfig | Qwen2Config,
    state_dict: dict[str, torch.Tensor],
    matrix_type: gguf.GGMLQuantizationType = Q.F32,
    extra_tensors: dict[str, np.ndarray] | None = None,
    permute: bool = True,
    tokenizer: bool = False,
) -> None:
    writer = gguf.GGUFWriter(path, arch)
    if tokenizer:
        add_tiny_tokenizer(writer, hf_config.vocab_size)
    writer.add_name(f"tiny {arch}")
    writer.add_block_count(hf_config.num_hidden_layers)
    writer.add_context_length(hf_config.max_position_embeddings)
    writer.add_embedding_length(hf_config.hidden_size)
    writer.add_feed_forward_length(hf_config.intermediate_size)
    writer.add_head_count(hf_config.num_attention_heads)
    writer.add_head_count_kv(hf_config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(hf_config.rms_norm_eps)
    writer.add_rope_freq_base(hf_config.rope_parameters["rope_theta"])
    writer.add_rope_dimension_count(hf_config.hidden_size // hf_config.num_attention_heads)
    writer.add_vocab_size(hf_config.vocab_size)
    for name, tensor in state_dict.items():
        weight = tensor.detach().float().numpy()
        if permute and name.endswith("q_proj.weight"):
            weight = interleave_rope_rows(weight, hf_config.num_attention_heads)
        elif permute and name.endswith("k_proj.weight"):
            weight = interleave_rope_rows(weight, hf_config.num_key_value_heads)
        if weight.ndim == 2 and matrix_type != Q.F32:
            writer.add_tensor(gguf_name(name), encode(weight, matrix_type), raw_dtype=matrix_type)
        else:
            writer.add_tensor(gguf_name(name), weight)
    for name, array in (extra_tensors or {}).items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def tiny_llama(tie_word_embeddings: bool = False) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=320,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=tie_word_embeddings,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # norms are ones at init; make them informative
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.uniform_(0.5, 1.5)
    return model


def tiny_qwen2() -> Qwen2ForCausalLM:
    torch.manual_seed(1)
    config = Qwen2Config(
        vocab_size=300,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
    )
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias"):
                parameter.normal_(0, 0.5)
    return model


def saved_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    state = dict(model.state_dict())
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight")
    return state


def transformers_gguf_tensors(path: Path, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    with torch.device("meta"):
        skeleton = type(model)(model.config)
    return load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=skeleton)["tensors"]


def expected_config(model: torch.nn.Module) -> ModelConfig:
    # A fresh model's config has no `architectures` yet (save_pretrained fills it in).
    return ModelConfig.from_hf_config({**model.config.to_dict(), "architectures": [type(model).__name__]})


# Worst error allowed per block, as a fraction of the block's largest magnitude (block: 32 or 256 values).
# From the formats: half a quantization step, plus f16 rounding of scales, plus clamping for Q4_0/Q6_K.
QUANT_TOLERANCE = {
    Q.Q8_0: (32, 0.6 / 127),
    Q.Q4_0: (32, 1.1 / 8),
    Q.Q4_1: (32, 1.1 / 15),
    Q.Q4_K: (256, 1.1 / 15),
    Q.Q6_K: (256, 1.1 / 32),
}


@pytest.mark.parametrize(
    "matrix_type",
    [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q6_K],
    ids=lambda qtype: qtype.name,
)
def test_dequantized_llama_matches_original_weights(tmp_path: Path, matrix_type: gguf.GGMLQuantizationType):
    model = tiny_llama()
    original = saved_state(model)
    path = tmp_path / f"tiny.{matrix_type.name}.gguf"
    write_gguf(path, "llama", model.config, original, matrix_type)

    config, weights = load_gguf(path)

    assert config == expected_config(model)
    assert weights.keys() == original.keys()
    for name, expected in original.items():
        actual = weights[name]
        assert actual.dtype == torch.float32 and actual.shape == expected.shape, name
        if expected.ndim == 1 or matrix_type == Q.F32:
            torch.testing.assert_close(actual, expected, rtol=0, atol=0, msg=name)
        elif matrix_type == Q.F16:
            torch.testing.assert_close(actual, expected.half().float(), rtol=0, atol=0, msg=name)
        elif matrix_type == Q.BF16:
            torch.testing.assert_close(actual, expected.bfloat16().float(), rtol=0, atol=0, msg=name)
        else:
            block, fraction = QUANT_TOLERANCE[matrix_type]
            error = (actual - expected).abs().reshape(-1, block).amax(-1)
            bound = fraction * expected.abs().reshape(-1, block).amax(-1)
            assert bool((error <= bound + 1e-9).all()), (
                f"{name}: error {float((error / bound).max()):.2f}x bound"
            )
            assert float(error.max()) > 0  # really quantized, so the bound was tested

    # transformers' GGUF loader (its own name map and un-permutation) must agree bit for bit.
    reference = transformers_gguf_tensors(path, model)
    assert reference.keys() == weights.keys()
    for name, tensor in reference.items():
        assert torch.equal(weights[name], tensor), name


def test_llama_q_k_permutation_is_undone(tmp_path: Path):
    model = tiny_llama()
    original = saved_state(model)
    path = tmp_path / "tiny.gguf"
    write_gguf(path, "llama", model.config, original)
    stored = gguf.GGUFReader(path).tensors
    stored_q = next(tensor for tensor in stored if tensor.name == "blk.0.attn_q.weight").data
    assert not np.array_equal(stored_q, original["model.layers.0.self_attn.q_proj.weight"].numpy())

    _, weights = load_gguf(path)

    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight"):
        assert torch.equal(weights[name], original[name])
    assert "lm_head.weight" in weights


def test_qwen2_keeps_row_order_and_biases(tmp_path: Path):
    model = tiny_qwen2()
    original = saved_state(model)
    path = tmp_path / "qwen.gguf"
    write_gguf(path, "qwen2", model.config, original, permute=False)

    config, weights = load_gguf(path)

    assert config == expected_config(model)
    assert config.architecture == "Qwen2ForCausalLM" and config.attention_bias and config.tie_word_embeddings
    assert weights.keys() == original.keys()
    assert "model.layers.1.self_attn.k_proj.bias" in weights and "lm_head.weight" not in weights
    for name, tensor in original.items():
        assert torch.equal(weights[name], tensor), name
    reference = transformers_gguf_tensors(path, model)
    for name, tensor in reference.items():
        assert torch.equal(weights[name], tensor), name


def hf_llama3_rope_freqs(rope_parameters: dict, head_dim: int) -> np.ndarray:
    """The `rope_freqs` divisors implied by transformers' own llama3 frequency computation."""
    config = LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, rope_parameters=rope_parameters)
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    base = 1.0 / (rope_parameters["rope_theta"] ** (torch.arange(0, head_dim, 2).float() / head_dim))
    return (base / scaled).numpy().astype(np.float32)


@pytest.mark.parametrize("factor", [8.0, 32.0])
def test_llama3_rope_scaling_recovered_from_rope_freqs(factor: float):
    parameters = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    freqs = hf_llama3_rope_freqs(parameters, head_dim=128)

    scaling = llama3_rope_scaling_from_factors(freqs, rope_theta=500000.0, head_dim=128)

    assert scaling == {key: value for key, value in parameters.items() if key != "rope_theta"}
    rebuilt = hf_llama3_rope_freqs({**scaling, "rope_theta": 500000.0}, head_dim=128)
    np.testing.assert_allclose(rebuilt, freqs, rtol=1e-6)


def test_rope_scaling_in_config(tmp_path: Path):
    model = tiny_llama()
    head_dim = 64
    parameters = {
        "rope_type": "llama3",
        "rope_theta": 10000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256,
    }
    freqs = hf_llama3_rope_freqs(parameters, head_dim)
    assert 1.0 < freqs.min() or freqs.max() > 1.0
    path = tmp_path / "llama3.gguf"
    write_gguf(path, "llama", model.config, saved_state(model), extra_tensors={"rope_freqs.weight": freqs})

    config, weights = load_gguf(path)

    assert config.rope_scaling == {key: value for key, value in parameters.items() if key != "rope_theta"}
    assert "rope_freqs.weight" not in weights and not any("rope" in name for name in weights)


def test_linear_rope_scaling_from_metadata(tmp_path: Path):
    model = tiny_llama()
    path = tmp_path / "linear.gguf"
    writer_path = tmp_path / "plain.gguf"
    write_gguf(writer_path, "llama", model.config, saved_state(model))
    # Rewrite with two extra metadata keys; everything else identical.
    reader = gguf.GGUFReader(writer_path)
    writer = gguf.GGUFWriter(path, "llama")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        value_type = field.types[0]
        writer.add_key_value(field.name, field.contents(), value_type)
    writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    writer.add_rope_scaling_factor(4.0)
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, np.array(tensor.data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    config, _ = load_gguf(path)

    assert config.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    assert config.max_position_embeddings == 512 and math.isclose(config.rope_theta, 10000.0)


def test_unsupported_architecture_is_rejected(tmp_path: Path):
    model = tiny_llama()
    path = tmp_path / "gemma.gguf"
    write_gguf(path, "gemma", model.config, saved_state(model))
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'gemma'"):
        load_gguf(path)


def test_unknown_tensor_is_rejected(tmp_path: Path):
    model = tiny_llama()
    path = tmp_path / "extra.gguf"
    write_gguf(
        path,
        "llama",
        model.config,
        saved_state(model),
        extra_tensors={"blk.0.ffn_gate_exps.weight": np.zeros((4, 256), dtype=np.float32)},
    )
    with pytest.raises(ValueError, match="unexpected GGUF tensor 'blk.0.ffn_gate_exps.weight'"):
        load_gguf(path)


# --- The conversion cache on a tiny GGUF (the default model's cache is tested in test_loader.py) ---


@pytest.fixture
def tiny_gguf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, dict[str, torch.Tensor]]:
    monkeypatch.setenv("TITAN_CACHE_DIR", str(tmp_path / "cache"))
    model = tiny_llama(tie_word_embeddings=True)
    original = saved_state(model)
    path = tmp_path / "Tiny-Llama.Q8_0.gguf"
    write_gguf(path, "llama", model.config, original, Q.Q8_0, tokenizer=True)
    return path, original


def test_gguf_cache_miss_then_hit(tiny_gguf: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path):
    path, original = tiny_gguf
    first = load_model_files(str(path))
    folder = first.folder
    assert folder.parent == tmp_path / "cache" and first.name == "Tiny-Llama.Q8_0" and first.source == path
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {file.name for file in folder.iterdir()}
    assert first.weights.keys() == original.keys()

    second = load_model_files(str(path))

    assert second.folder == folder and second.config == first.config
    for name, tensor in first.weights.items():
        assert weights_equal(second.weights[name], tensor), name
    assert load_gguf_cached(path).cache_hit


def test_cached_path_does_not_read_the_gguf(tiny_gguf: tuple[Path, dict[str, torch.Tensor]]):
    path, original = tiny_gguf
    first = load_model_files(str(path))
    # Zero the GGUF's last tensor bytes but keep its size and mtime: the cache key stays the same, so the
    # next load must come from the cached folder alone and still return the original weights.
    stat = path.stat()
    data = bytearray(path.read_bytes())
    data[-4096:] = bytes(4096)
    path.write_bytes(bytes(data))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    _, corrupted = load_gguf(path)
    assert not torch.equal(corrupted["model.norm.weight"], original["model.norm.weight"])

    again = load_model_files(str(path))

    assert again.folder == first.folder
    for name, tensor in first.weights.items():
        assert weights_equal(again.weights[name], tensor), name
    assert torch.equal(again.weights["model.norm.weight"], original["model.norm.weight"])


def test_losing_a_conversion_race_is_tolerated(tiny_gguf: tuple[Path, dict[str, torch.Tensor]]):
    path, _ = tiny_gguf
    winner = load_gguf_cached(path)
    before = (winner.folder / "model.safetensors").stat().st_mtime_ns
    # The folder already exists, as if another process renamed its conversion into place first.
    config, weights = _convert_atomically(path, winner.folder)
    assert config == winner.config
    assert (winner.folder / "model.safetensors").stat().st_mtime_ns == before  # the winner's files stay
    assert not [entry for entry in winner.folder.parent.iterdir() if entry.name.startswith(".")]
    for name, tensor in dequantize_state_dict(weights).items():
        assert torch.equal(winner.weights[name], tensor), name


def test_concurrent_first_loads_agree(tiny_gguf: tuple[Path, dict[str, torch.Tensor]]):
    path, _ = tiny_gguf
    script = (
        "import sys; from titan.loader import load_model_files; print(load_model_files(sys.argv[1]).folder)"
    )
    processes = [
        subprocess.Popen([sys.executable, "-c", script, str(path)], stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    folders = {process.communicate(timeout=120)[0].strip() for process in processes}
    assert all(process.returncode == 0 for process in processes)
    assert folders == {str(cache_folder_for(path))}
    assert not [entry for entry in cache_folder_for(path).parent.iterdir() if entry.name.startswith(".")]


def test_incomplete_cache_folder_is_rebuilt(tiny_gguf: tuple[Path, dict[str, torch.Tensor]]):
    path, original = tiny_gguf
    folder = cache_folder_for(path)
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")  # what a writer that bypassed the atomic rename might leave
    converted = load_gguf_cached(path)
    assert not converted.cache_hit and (folder / "model.safetensors").is_file()
    assert load_gguf_cached(path).cache_hit
