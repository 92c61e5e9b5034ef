"""Cold start of the default model in fresh processes: first load (GGUF → cache) and cached load, each
until the first generated token, beside what opening the GGUF with gguf.GGUFReader and loading it
with HF transformers cost.

    .venv/bin/python benchmarks/cold_start.py [--skip-hf] [--output benchmarks/results/cold_start.json]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

from common import write_result

TITAN_SNIPPET = """
import time
start = time.perf_counter()
from titan import LLM, SamplingParams
llm = LLM("default")
out = llm.generate("Hello", SamplingParams(max_tokens=1))
print(time.perf_counter() - start)
"""

GGUF_SNIPPET = """
import time
start = time.perf_counter()
import gguf
from titan.loader.resolve import resolve_model_path
gguf.GGUFReader(resolve_model_path("default"))
print(time.perf_counter() - start)
"""

HF_SNIPPET = """
import time
start = time.perf_counter()
from transformers import AutoModelForCausalLM
from titan.loader.resolve import resolve_model_path
path = resolve_model_path("default")
AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name)
print(time.perf_counter() - start)
"""


def timed_process(snippet: str, env: dict[str, str]) -> tuple[float, float]:
    """(seconds measured inside the process, wall seconds including interpreter start)."""
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-c", snippet], env=env, capture_output=True, text=True, check=True)
    return float(result.stdout.strip().splitlines()[-1]), time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--output", default="benchmarks/results/cold_start.json")
    args = parser.parse_args()
    result: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, TITAN_CACHE_DIR=cache, HF_HUB_OFFLINE="1")
        result["first_load_s"], result["first_load_wall_s"] = timed_process(TITAN_SNIPPET, env)
        cached = [timed_process(TITAN_SNIPPET, env) for _ in range(3)]
        result["cached_load_s"] = min(c[0] for c in cached)
        result["cached_load_wall_s"] = min(c[1] for c in cached)
        result["gguf_reader_open_s"], _ = timed_process(GGUF_SNIPPET, env)
        if not args.skip_hf:
            result["transformers_gguf_load_s"], _ = timed_process(HF_SNIPPET, env)
    for name, value in result.items():
        print(f"{name:28s} {value:7.2f}")
    write_result(args.output, result)


if __name__ == "__main__":
    main()
