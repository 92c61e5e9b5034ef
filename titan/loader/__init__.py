"""Model loading: resolve `--model`, read a GGUF (through the conversion cache) or an HF folder."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from titan.config import ModelConfig
from titan.kernels import QuantizedTensor
from titan.kernels.quantize import FORMATS, quantize_state_dict
from titan.loader.cache import load_gguf_cached
from titan.loader.hf_quantized import convert_quantized_checkpoint, quantization_method
from titan.loader.hf_weights import load_hf_config, load_hf_weights
from titan.loader.resolve import ModelNotFoundError, resolve_model_path

__all__ = ["ModelFiles", "ModelNotFoundError", "load_model_files", "resolve_model_path"]

logger = logging.getLogger("titan.loader")


@dataclass
class ModelFiles:
    config: ModelConfig
    # HF names, CPU tensors: GGUF matrices stay QuantizedTensor under --quantization auto (float32 under
    # none); HF folders keep their stored dtype.
    weights: dict[str, torch.Tensor | QuantizedTensor]
    folder: Path  # HF-style folder with config + tokenizer files (the cache folder for a GGUF)
    name: str  # served model name: GGUF file stem, or the HF folder's name
    source: Path  # the resolved path the user gave


def load_model_files(model: str | None = "default", quantization: str = "auto") -> ModelFiles:
    """Load config and weights for `model` ('default'/None, a .gguf file or an HF folder).

    quantization: auto keeps a GGUF's block formats (and an HF GPTQ / AWQ checkpoint's, repacked); none
    dequantizes them to float32 at load; int8 / int4 quantize float matrices at load (Q8_0 / Q4_1 groups
    of 32; a GGUF is dequantized first)."""
    if quantization not in ("auto", "none", *FORMATS):
        raise ValueError(f"unknown quantization {quantization!r}")
    start = time.perf_counter()
    source = resolve_model_path(model)
    if source.is_dir():
        files = ModelFiles(load_hf_config(source), load_hf_weights(source), source, source.name, source)
        how = "Hugging Face folder"
        qconfig = quantization_method(json.loads((source / "config.json").read_text(encoding="utf-8")))
        if qconfig is not None:
            # GPTQ / AWQ integers repacked into Q4_0 / Q4_1 blocks (auto, int8, int4), or dequantized (none).
            keep = quantization != "none"
            files.weights = convert_quantized_checkpoint(files.weights, qconfig, keep_quantized=keep)
            how += f", {qconfig['quant_method']} 4-bit " + ("kept quantized" if keep else "dequantized to float32")
    else:
        converted = load_gguf_cached(source, quantized=quantization == "auto")
        files = ModelFiles(converted.config, converted.weights, converted.folder, source.stem, source)
        how = f"GGUF, cache {'hit' if converted.cache_hit else 'miss (converted)'} at {converted.folder}"
        how += ", quantized" if quantization == "auto" else ", dequantized to float32"
    if quantization in FORMATS:
        files.weights = quantize_state_dict(files.weights, quantization)
        how += f", quantized at load to {quantization} ({FORMATS[quantization].name})"
    logger.info("loaded model %s in %.2f s (%s)", files.name, time.perf_counter() - start, how)
    return files
