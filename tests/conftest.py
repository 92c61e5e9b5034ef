"""Test-wide settings: never touch a model hub, and keep converted models in one local cache."""

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TITAN_CACHE_DIR", str(Path(__file__).resolve().parent.parent / ".titan-cache"))


@pytest.fixture
def set_activation_bits(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[int], None]]:
    """For this test only: Q4_0/Q4_1/Q8_0 products take activations rounded to the given bits (0: float32),
    in the native kernels and the PyTorch fallback alike."""
    from titan.kernels import native, ops
    from titan.kernels.build import activation_bits

    module = native()

    def apply(bits: int) -> None:
        monkeypatch.setattr(ops, "_activation_bits", lambda: bits)
        if module is not None:
            module.set_activation_bits(bits)

    yield apply
    if module is not None:
        module.set_activation_bits(activation_bits())
