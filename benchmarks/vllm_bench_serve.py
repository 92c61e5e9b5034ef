"""`vllm bench serve` against a real Titan server: does vLLM's own load generator run with no warning
about Titan and no request field ignored by it? Completions and chat, a small random-token workload.

vLLM is not one of Titan's dependencies (its wheel alone is 326 MB); point `--vllm` at a `vllm` CLI from
a separate virtual environment, e.g. one made with `pip install torch==2.13.0`, then
`pip install --no-deps vllm==0.32.0` and the few packages its benchmark imports (the README lists them).

    .venv/bin/python benchmarks/vllm_bench_serve.py --vllm /tmp/vllm-venv/bin/vllm
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import subprocess
from pathlib import Path
from typing import Any

import httpx
from common import write_result

from harness.server import ServerProcess
from titan.loader.cache import cache_folder_for
from titan.loader.resolve import resolve_model_path

ROUTES = {"openai": "/v1/completions", "openai-chat": "/v1/chat/completions"}
# vLLM's own notices that say nothing about the server it measures.
OWN_NOTICES = ("no longer sets temperature==0", "vllm._C", "nanobind")
RESULT = re.compile(r"^(Successful requests|Failed requests|Median TTFT \(ms\)|Median ITL \(ms\)|"
                    r"Output token throughput \(tok/s\)):\s+([\d.]+)", re.MULTILINE)


def tokenizer_folder() -> str:
    """The converted folder of the default model (it holds tokenizer.json): the one the server loads."""
    return str(cache_folder_for(resolve_model_path("default")))


def run_backend(vllm: str, url: str, model: str, backend: str, tokenizer: str,
                args: argparse.Namespace) -> dict[str, Any]:
    command = [vllm, "bench", "serve", "--backend", backend, "--base-url", url, "--endpoint", ROUTES[backend],
               "--model", model, "--tokenizer", tokenizer, "--dataset-name", "random",
               "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
               "--num-prompts", str(args.num_prompts), "--max-concurrency", str(args.max_concurrency),
               "--ignore-eos", "--temperature", "0"]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=1800,
                               env=os.environ | {"HF_HUB_OFFLINE": "1"})
    output = completed.stdout + completed.stderr
    warnings = [line for line in output.splitlines() if re.search(r"warn", line, re.IGNORECASE)
                and not any(notice in line for notice in OWN_NOTICES)]
    figures = {name: float(value) for name, value in RESULT.findall(output)}
    print(f"{backend:>12}: rc {completed.returncode}, {figures}, warnings about Titan: {len(warnings)}", flush=True)
    return {"returncode": completed.returncode, "figures": figures, "warnings": warnings}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vllm", required=True, help="the vllm CLI of a separate venv")
    parser.add_argument("--num-prompts", type=int, default=12)
    parser.add_argument("--max-concurrency", type=int, default=4)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/vllm_bench_serve.json"))
    args = parser.parse_args()
    with ServerProcess(["--max-num-seqs", "8"]) as server:
        model = httpx.get(server.url + "/v1/models", timeout=30).json()["data"][0]["id"]
        runs = {backend: run_backend(args.vllm, server.url, model, backend, tokenizer_folder(), args)
                for backend in ROUTES}
        ignored = [line for line in server.log().splitlines() if "ignoring unknown request field" in line]
    print(f"fields Titan ignored: {ignored or 'none'}")
    write_result(args.output, {"runs": runs, "ignored_fields": ignored, "machine": {
        "cpus": os.cpu_count(), "platform": platform.platform(), "load_average": os.getloadavg()}})
    if ignored or any(run["returncode"] or run["warnings"] for run in runs.values()):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
