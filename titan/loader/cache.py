"""Cold-start fast path: convert a GGUF once into an HF-style folder and reuse it.

Opening a GGUF (~3-5 s of metadata parsing) on every start is wasted work, so the first load writes
`config.json`, tokenizer files and `model.safetensors` holding the *same quantized bytes* (uint8 rows of
GGML blocks; their type and shape in the safetensors metadata, the q/k row permutation already undone) to
a cache folder; later loads read that folder only. Float32 is produced only on request (`--quantization
none`), at load, never stored. The folder is keyed by the GGUF's absolute path, size and mtime, so replacing the
file invalidates it, and bumping `CACHE_FORMAT_VERSION` invalidates every folder written by older code.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from titan.config import ModelConfig
from titan.kernels import QuantizedTensor
from titan.loader.hf_weights import load_hf_config

logger = logging.getLogger("titan.loader")

CACHE_FORMAT_VERSION = 2  # 2: quantized bytes instead of float32
QUANTIZED_KEY = "titan.quantized"  # safetensors metadata: {name: [ggml_type, rows, cols]}
WEIGHTS_FILE = "model.safetensors"
SOURCE_FILE = "titan_source.json"  # what the folder was converted from, for people inspecting the cache
_REQUIRED_FILES = ("config.json", WEIGHTS_FILE, SOURCE_FILE)


@dataclass
class ConvertedGguf:
    folder: Path
    config: ModelConfig
    weights: dict[str, torch.Tensor | QuantizedTensor]
    cache_hit: bool


def cache_root() -> Path:
    configured = os.environ.get("TITAN_CACHE_DIR")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "titan"


def cache_folder_for(gguf_path: Path) -> Path:
    """The cache folder for this exact file version (path, size, mtime) and cache format."""
    absolute = gguf_path.resolve()
    stat = absolute.stat()
    identity = f"{absolute}\0{stat.st_size}\0{stat.st_mtime_ns}\0{CACHE_FORMAT_VERSION}"
    digest = hashlib.sha256(identity.encode()).hexdigest()[:16]
    return cache_root() / f"{absolute.stem}-{digest}"


def load_gguf_cached(gguf_path: Path, quantized: bool = False) -> ConvertedGguf:
    """Config and weights of `gguf_path`, from its cache folder, converting it first if needed.

    quantized: matrices stay `QuantizedTensor`; otherwise every tensor is dequantized to float32."""
    folder = cache_folder_for(gguf_path)
    if _is_complete(folder):
        weights, cache_hit = read_cached_weights(folder), True
        config = load_hf_config(folder)
    else:
        if folder.exists():
            logger.warning("cache folder %s is incomplete; converting again", folder)
            shutil.rmtree(folder, ignore_errors=True)
        (config, weights), cache_hit = _convert_atomically(gguf_path, folder), False
    return ConvertedGguf(folder, config, weights if quantized else dequantize_state_dict(weights), cache_hit)


def dequantize_state_dict(weights: dict[str, torch.Tensor | QuantizedTensor]) -> dict[str, torch.Tensor]:
    return {name: t.dequantize() if isinstance(t, QuantizedTensor) else t for name, t in weights.items()}


def read_cached_weights(folder: Path) -> dict[str, torch.Tensor | QuantizedTensor]:
    from safetensors import safe_open

    weights: dict[str, torch.Tensor | QuantizedTensor] = {}
    with safe_open(str(folder / WEIGHTS_FILE), framework="pt") as file:
        quantized = json.loads((file.metadata() or {}).get(QUANTIZED_KEY, "{}"))
        for name in file.keys():
            tensor = file.get_tensor(name)
            if name in quantized:
                ggml_type, rows, cols = quantized[name]
                weights[name] = QuantizedTensor(tensor, ggml_type, rows, cols)
            else:
                weights[name] = tensor
    return weights


def _is_complete(folder: Path) -> bool:
    return all((folder / name).is_file() for name in _REQUIRED_FILES)


def _convert_atomically(
    gguf_path: Path, folder: Path
) -> tuple[ModelConfig, dict[str, torch.Tensor | QuantizedTensor]]:
    """Write into a temporary sibling, then rename it into place so readers never see half a folder."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    temporary = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", suffix=".tmp", dir=folder.parent))
    try:
        config, weights = convert_gguf_to_folder(gguf_path, temporary)
        try:
            os.rename(temporary, folder)
        except OSError:
            if not _is_complete(folder):
                raise
            # Another process finished the same conversion first; its folder is equivalent to ours.
            logger.info("another process already converted %s", gguf_path)
    finally:
        if temporary.exists():
            shutil.rmtree(temporary, ignore_errors=True)
    return config, weights


def convert_gguf_to_folder(
    gguf_path: Path, out_dir: Path
) -> tuple[ModelConfig, dict[str, torch.Tensor | QuantizedTensor]]:
    """Write config, quantized weights and tokenizer files of a GGUF into `out_dir` (an existing folder)."""
    # Imported here so the cached path never pays for gguf (or a tokenizer module that may be absent).
    import gguf
    from safetensors.torch import save_file

    from titan.loader.gguf_weights import read_gguf_config, read_gguf_quantized_state_dict
    from titan.tokenizer.gguf_convert import write_tokenizer_files

    reader = gguf.GGUFReader(gguf_path)
    config = read_gguf_config(reader)
    weights = read_gguf_quantized_state_dict(reader, config)
    write_tokenizer_files(reader, out_dir)
    tensors = {name: t.data if isinstance(t, QuantizedTensor) else t for name, t in weights.items()}
    quantized = {
        name: [t.ggml_type, t.rows, t.cols] for name, t in weights.items() if isinstance(t, QuantizedTensor)
    }
    metadata = {"format": "pt", QUANTIZED_KEY: json.dumps(quantized)}
    save_file(tensors, str(out_dir / WEIGHTS_FILE), metadata=metadata)
    with open(out_dir / "config.json", "w", encoding="utf-8") as file:
        json.dump(config.to_hf_config(), file, indent=2)
    stat = gguf_path.stat()
    source = {
        "gguf": str(gguf_path.resolve()),
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
        "cache_format_version": CACHE_FORMAT_VERSION,
    }
    with open(out_dir / SOURCE_FILE, "w", encoding="utf-8") as file:
        json.dump(source, file, indent=2)
    return config, weights
