"""Load a Hugging Face checkpoint folder: `config.json` plus one or more safetensors files."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from titan.config import ModelConfig

SAFETENSORS_INDEX = "model.safetensors.index.json"


def load_hf_config(folder: Path) -> ModelConfig:
    with open(folder / "config.json", encoding="utf-8") as file:
        return ModelConfig.from_hf_config(json.load(file))


def safetensors_files(folder: Path) -> list[Path]:
    """The weight files: those named by the shard index if there is one, else every `*.safetensors`."""
    index_path = folder / SAFETENSORS_INDEX
    if index_path.is_file():
        with open(index_path, encoding="utf-8") as file:
            weight_map: dict[str, str] = json.load(file)["weight_map"]
        files = [folder / name for name in sorted(set(weight_map.values()))]
        missing = [str(path) for path in files if not path.is_file()]
        if missing:
            raise FileNotFoundError(f"{index_path} names missing shards: {', '.join(missing)}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {folder}")
    return files


def load_hf_weights(folder: Path) -> dict[str, torch.Tensor]:
    """All tensors under their checkpoint names, in their stored dtype, on the CPU."""
    weights: dict[str, torch.Tensor] = {}
    for path in safetensors_files(folder):
        shard = load_file(path, device="cpu")
        duplicated = weights.keys() & shard.keys()
        if duplicated:
            raise ValueError(f"tensor {sorted(duplicated)[0]!r} appears in more than one shard ({path.name})")
        weights.update(shard)
    return weights
