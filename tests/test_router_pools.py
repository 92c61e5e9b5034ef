"""Model pools: the router degrades to the fallback pool when the primary's predicted TTFT is over the request
class's SLO, says so, counts it, and goes back to the primary once the prediction is under it again.

Both pools serve the default model under different names; the primary has one thread. The SLO is set
between what this machine measures now for a 2-character prompt and for a ~2,600-token one on the primary
(their geometric mean), so the test does not depend on how fast or loaded the machine is: the router's
predictions, fitted to the primary's scraped step costs, only need to be within a few times the truth.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from harness.router import RouterProcess
from harness.server import ServerProcess
from titan.bench.metrics_scraper import parse_prometheus_text
from titan.router.config import ConfigError, build_config

ARGS = ["--max-num-batched-tokens", "256", "--max-num-seqs", "4", "--kv-cache-memory", "0.3"]

def long_prompt(number: int) -> str:
    """~12,000 characters (~2,600 tokens), distinct from its first block on: no cache, the router's or the
    server's, holds any of it."""
    return f"Prompt {number}. " + "Tell me about the weather in the mountains and the sea. " * 215

BATCH = {"X-Titan-Priority": "batch"}
Pools = tuple[ServerProcess, ServerProcess, RouterProcess]


def timed(url: str, prompt: str, model: str, headers: dict[str, str] | None = None) -> tuple[httpx.Response, float]:
    started = time.perf_counter()
    reply = httpx.post(url + "/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 1},
                       headers=headers or {}, timeout=900)
    assert reply.status_code == 200, reply.text
    return reply, time.perf_counter() - started


@pytest.fixture(scope="module")
def pools() -> Iterator[Pools]:
    primary = ServerProcess([*ARGS, "--served-model-name", "smol-main"], env={"OMP_NUM_THREADS": "1"})
    fallback = ServerProcess([*ARGS, "--served-model-name", "smol-fast"], env={"OMP_NUM_THREADS": "2"})
    router: RouterProcess | None = None
    try:
        threads = [threading.Thread(target=server.start) for server in (primary, fallback)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        short = max(timed(primary.url, "Hi", "smol-main")[1] for _ in range(2))
        long = timed(primary.url, long_prompt(0), "smol-main")[1]
        slo_ms = math.sqrt(short * long) * 1000
        router = RouterProcess([], ["--pool", f"primary={primary.url}", "--pool", f"fallback={fallback.url}",
                                    "--batch-ttft-slo-ms", f"{slo_ms:.0f}", "--interactive-ttft-slo-ms",
                                    f"{slo_ms:.0f}", "--health-interval", "0.2"], min_ready=2).start()
        # Interactive without opting in stays on the primary whatever its prediction: this one also gives the
        # router's cost fit a prefill-heavy interval to learn the per-token cost from.
        kept, _ = timed(router.url, long_prompt(1), "smol-main")
        assert kept.headers["x-titan-router-backend"] == primary.url.split("//")[1]
        assert "x-titan-degraded" not in kept.headers
        # Then decode-heavy ones. Each first token moves the primary's TTFT calibration by the square root of
        # its actual/predicted ratio: the long prompt, priced while the step-cost fit had seen little, can
        # leave it several times off, and a short batch prompt once read as over the SLO (CI, one run in
        # many). Four short ones shrink such an error to its 16th root: the split below rests on counts.
        for _ in range(4):
            timed(router.url, "Hi", "smol-main")
        yield primary, fallback, router
    finally:
        if router is not None:
            router.stop()
        primary.stop()
        fallback.stop()


def degraded_count(router: RouterProcess, request_class: str) -> float:
    text = httpx.get(router.url + "/metrics", timeout=10).text
    return sum(sample.value for sample in parse_prometheus_text(text)
               if sample.name == "titan_router:degraded_requests_total"
               and sample.labels.get("request_class") == request_class)


def test_batch_degrades_over_its_slo_and_switches_back(pools: Pools) -> None:
    primary, fallback, router = pools
    name = {primary.url.split("//")[1]: "primary", fallback.url.split("//")[1]: "fallback"}
    short, _ = timed(router.url, "Hi", "smol-main", BATCH)
    assert name[short.headers["x-titan-router-backend"]] == "primary", router.log()
    assert "x-titan-degraded" not in short.headers and short.json()["model"] == "smol-main"

    slow, _ = timed(router.url, long_prompt(2), "smol-main", BATCH)
    assert name[slow.headers["x-titan-router-backend"]] == "fallback", router.log()
    assert slow.headers["x-titan-degraded"] == "model=smol-fast"
    assert slow.json()["model"] == "smol-fast"  # the response names the model that served it
    assert degraded_count(router, "batch") == 1

    back, _ = timed(router.url, "Hi", "smol-main", BATCH)  # under the SLO again: back to the primary
    assert name[back.headers["x-titan-router-backend"]] == "primary", router.log()
    assert "x-titan-degraded" not in back.headers


def test_interactive_degrades_when_it_opts_in(pools: Pools) -> None:
    _, fallback, router = pools
    body = {"model": "smol-main", "prompt": long_prompt(3), "max_tokens": 1, "stream": True}
    opted = httpx.post(router.url + "/v1/completions", json=body, headers={"X-Titan-Allow-Degrade": "true"},
                       timeout=900)
    assert opted.status_code == 200
    assert opted.headers["x-titan-router-backend"] == fallback.url.split("//")[1], router.log()
    assert opted.headers["x-titan-degraded"] == "model=smol-fast"
    assert '"model":"smol-fast"' in opted.text.replace(" ", "")
    assert degraded_count(router, "interactive") == 1


def test_pool_settings_are_checked() -> None:
    with pytest.raises(ConfigError, match="primary and fallback"):
        build_config({}, {"pools": ["primary=http://a:1"]})
    with pytest.raises(ConfigError, match="NAME=URL"):
        build_config({}, {"pools": ["http://a:1"]})
    config = build_config({}, {"pools": ["fallback=http://b:1"], "backends": ["http://a:1"]})
    assert [(spec.name, spec.pool) for spec in config.backends] == [("a:1", "primary"), ("b:1", "fallback")]
