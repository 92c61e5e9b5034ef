"""Model loading: resolve `--model`, read a GGUF (through the conversion cache) or an HF folder."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from titan.config import ModelConfig
from titan.loader.cache import load_gguf_cached
from titan.loader.hf_weights import load_hf_config, load_hf_weights
from titan.loader.resolve import ModelNotFoundError, resolve_model_path

__all__ = ["ModelFiles", "ModelNotFoundError", "load_model_files", "resolve_model_path"]

logger = logging.getLogger("titan.loader")


@dataclass
class ModelFiles:
    config: ModelConfig
    weights: dict[str, torch.Tensor]  # HF names, CPU tensors (fp32 for GGUF, stored dtype for HF folders)
    folder: Path  # HF-style folder with config + tokenizer files (the cache folder for a GGUF)
    name: str  # served model name: GGUF file stem, or the HF folder's name
    source: Path  # the resolved path the user gave


def load_model_files(model: str | None = "default") -> ModelFiles:
    """Load config and weights for `model` ('default'/None, a .gguf file or an HF folder)."""
    start = time.perf_counter()
    source = resolve_model_path(model)
    if source.is_dir():
        files = ModelFiles(load_hf_config(source), load_hf_weights(source), source, source.name, source)
        how = "Hugging Face folder"
    else:
        converted = load_gguf_cached(source)
        files = ModelFiles(converted.config, converted.weights, converted.folder, source.stem, source)
        how = f"GGUF, cache {'hit' if converted.cache_hit else 'miss (converted)'} at {converted.folder}"
    logger.info("loaded model %s in %.2f s (%s)", files.name, time.perf_counter() - start, how)
    return files
