"""Titan: an LLM inference server that stays fast and predictable under load."""

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]

if TYPE_CHECKING:
    from titan.engine.sampling_params import SamplingParams
    from titan.entrypoints.llm import LLM


def __getattr__(name: str) -> Any:
    # Lazy: `import titan` stays cheap for tools that never touch torch (e.g. the bench client).
    if name == "LLM":
        from titan.entrypoints.llm import LLM

        return LLM
    if name == "SamplingParams":
        from titan.engine.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(name)
