"""Titan: an LLM inference server that stays fast and predictable under load."""

import os
from typing import TYPE_CHECKING, Any

# OpenMP threads that finish a parallel region spin-wait for the next one (libgomp's default). When the
# machine is shared — replicas on one host, a busy neighbour, CI — the spinning threads steal the cores the
# others need and a 64-token step measured 4-33 s instead of 0.2 s. Sleeping at barriers costs microseconds
# per region and removes that transient. Set here, before anything loads torch (libgomp reads it once); an
# explicit OMP_WAIT_POLICY wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

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
