"""What the benchmarks share: the standard prompt set, where results are written, the CPU they ran on.

Importing it also puts the repository root on sys.path, so benchmarks (run as scripts from anywhere)
reach the subprocess harnesses in `harness/`, which are not part of the installed package.
"""

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def write_result(path: str | Path, result: dict[str, Any]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")
    return path


def make_prompts(tokenizer: Any, count: int, length: int) -> list[list[int]]:
    """Distinct natural-text prompts cut to exactly `length` tokens (the ~150-token workload)."""
    base = ("The history of computing is a story of people who wanted to calculate faster. "
            "From the abacus to mechanical calculators, from vacuum tubes to transistors, each step "
            "made machines smaller, cheaper and more reliable. ")
    return [tokenizer.encode(f"Document {i}: " + base * 8 + f" Question {i}: what came next?")[:length]
            for i in range(count)]


def cpu_description() -> str:
    """The CPU model and the vector extensions that decide kernel speed (benchmarks print it)."""
    model, flags = "unknown CPU", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and model == "unknown CPU":
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    wanted = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8")
    return f"{model} ({' '.join(flag for flag in wanted if flag in flags) or 'no AVX2'})"


def timed(function: Callable[..., Any], spent: list[float]) -> Callable[..., Any]:
    """`function`, adding the seconds each call takes to spent[0] (patched over a layer to time its share)."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - started

    return wrapper
