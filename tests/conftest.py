"""Test-wide settings (never touch a model hub, keep converted models in one local cache) and shared fixtures."""

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    import openai

    from harness.server import ServerProcess

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


@pytest.fixture(scope="session")
def api_server() -> Iterator["ServerProcess"]:
    """One real `titan serve` on the default model, shared by the modules that test the API surface (request
    fields, structured outputs, the Responses API): a server start saved per module."""
    from harness.server import ServerProcess

    with ServerProcess(["--max-num-seqs", "8", "--kv-cache-memory", "0.1"]) as process:
        yield process


@pytest.fixture(scope="session")
def api_client(api_server: "ServerProcess") -> "openai.OpenAI":
    import openai

    return openai.OpenAI(base_url=api_server.url + "/v1", api_key="none", max_retries=0, timeout=300)
