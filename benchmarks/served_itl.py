"""Single-stream decode through HTTP, Titan and llama.cpp's llama-server side by side, the same client.

Both servers get the same GGUF and thread count and are measured one after the other, alternating
`--rounds` times, with `titan bench --max-concurrency 1 --input-len 128 --output-len 64 --ignore-eos`
(streamed; ITL = gaps between streamed tokens). llama-server is the one `../shared/anchors/llamacpp.sh`
builds; without it only Titan is measured. Used by decode_latency.py; runs alone too:

    .venv/bin/python benchmarks/served_itl.py --threads 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from common import cpu_description, write_result

from harness.server import REPO_ROOT, ServerProcess, free_port
from titan.loader.resolve import default_model_path

ANCHOR = REPO_ROOT.parent / "shared" / "anchors" / "llamacpp.sh"
LLAMA_SERVER = Path(os.environ.get("LLAMACPP_HOME", Path.home() / ".cache/titan-anchors/llamacpp")) / \
    "src/build/bin/llama-server"
BENCH_ARGS = ["--max-concurrency", "1", "--num-requests", "12", "--input-len", "128", "--output-len", "64",
              "--ignore-eos", "--temperature", "0"]


def wait_ready(url: str, process: subprocess.Popen, limit_s: float = 600.0) -> None:
    """Until llama-server's /v1/models answers (bounded: a server that never comes up fails the run)."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}")
        try:
            if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} not ready after {limit_s:.0f} s")


def bench(url: str) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as folder:
        command = [sys.executable, "-m", "titan.entrypoints.cli", "bench", "--base-url", url, *BENCH_ARGS,
                   "--output-dir", folder, "--no-plots", "--quiet", "--no-scrape"]
        done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, check=False)
        result_file = Path(folder) / "result.json"
        if not result_file.exists():
            raise RuntimeError(f"titan bench failed ({done.returncode}): {done.stderr[-2000:]}")
        result = json.loads(result_file.read_text())
    latency, summary = result["latency_ms"], result["summary"]
    if summary["failed"]:
        raise RuntimeError(f"{url}: {summary['failed']} requests failed")
    return {"itl_p50_ms": latency["itl"]["p50"], "itl_p99_ms": latency["itl"]["p99"],
            "ttft_p50_ms": latency["ttft"]["p50"]}


def llama_server(threads: int, port: int) -> subprocess.Popen | None:
    if not LLAMA_SERVER.exists():
        return None
    command = [str(LLAMA_SERVER), "-m", str(default_model_path()), "--host", "127.0.0.1", "--port", str(port),
               "-t", str(threads), "-c", "4096", "-np", "1"]
    env = {**os.environ, "LD_LIBRARY_PATH": str(LLAMA_SERVER.parent)}
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)


def measure(threads: int, rounds: int) -> dict[str, Any]:
    """Each server started once; the client runs alternate between them `rounds` times (medians kept)."""
    titan = ServerProcess(["--threads", str(threads)], ready_timeout=600.0)
    llama: subprocess.Popen | None = None
    try:
        urls = {"titan": titan.start().url}
        port = free_port()
        llama = llama_server(threads, port)
        if llama is not None:
            urls["llama.cpp"] = f"http://127.0.0.1:{port}"
            wait_ready(urls["llama.cpp"], llama)
        for url in urls.values():
            bench(url)  # warm-up round, not kept
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in urls}
        for _ in range(rounds):
            for name, url in urls.items():
                runs[name].append(bench(url))
    finally:
        titan.stop()
        if llama is not None:
            llama.terminate()
            try:
                llama.wait(timeout=30)
            except subprocess.TimeoutExpired:
                llama.kill()
    result: dict[str, Any] = {"threads": threads, "rounds": rounds, "client": " ".join(BENCH_ARGS)}
    for name, measured in runs.items():
        result[name] = {key: statistics.median(run[key] for run in measured)
                        for key in ("itl_p50_ms", "itl_p99_ms", "ttft_p50_ms")}
        result[name]["runs"] = measured
    if "llama.cpp" in result:
        result["titan_over_llamacpp_itl_p50"] = result["titan"]["itl_p50_ms"] / result["llama.cpp"]["itl_p50_ms"]
    return result


def report(result: dict[str, Any]) -> None:
    print(f"\nserved single stream ({result['threads']} threads, {result['rounds']} alternating rounds, medians):")
    for name in ("titan", "llama.cpp"):
        if name in result:
            r = result[name]
            print(f"  {name:<10} ITL P50 / P99 {r['itl_p50_ms']:6.1f} / {r['itl_p99_ms']:6.1f} ms   "
                  f"TTFT P50 {r['ttft_p50_ms']:6.0f} ms")
    if "titan_over_llamacpp_itl_p50" in result:
        print(f"  Titan / llama.cpp ITL P50: {result['titan_over_llamacpp_itl_p50']:.2f}x (target <= 0.8x)")
    else:
        print(f"  llama.cpp not built ({LLAMA_SERVER}); `{ANCHOR} build` builds it")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output", default="benchmarks/results/served_itl.json")
    args = parser.parse_args()
    cpu = cpu_description()
    print(f"CPU: {cpu}")
    result = measure(args.threads, args.rounds)
    report(result)
    write_result(args.output, {"cpu": cpu, **result})


if __name__ == "__main__":
    main()
