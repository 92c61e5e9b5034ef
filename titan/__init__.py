"""Titan: an LLM inference server that stays fast and predictable under load."""

import os
from typing import TYPE_CHECKING, Any

# OpenMP threads that finish a parallel region spin-wait for the next one: libgomp's default spins ~300k
# times (milliseconds), and when the machine is shared (replicas on one host, a busy neighbour, CI) the
# spinning threads steal the cores the others need: a 64-token step measured 4-33 s instead of 0.2 s. Never
# spinning costs a wake-up per region instead (~50 us in a VM), and a decode step runs ~250 regions: on a
# quiet 2-core machine 2 threads then decoded slower (15.0 ms a token) than 1 (10.3 ms). A short spin
# (GOMP_SPINCOUNT 3000, ~50 us) covers the gaps between a step's regions and sleeps between steps: 7.9 ms.
# The price where a busy neighbour shares the cores: 24 ms instead of 12 (give Titan its own cores, fewer
# --threads, or GOMP_SPINCOUNT=0). Set here, before anything loads torch (libgomp reads them once); values
# in the environment win.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("GOMP_SPINCOUNT", "3000")

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
