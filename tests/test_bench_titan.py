"""`titan bench` against a real `titan serve` on 127.0.0.1 with the default model: every preset runs, the
JSON is filled and agrees with the server's own counters, and the plots are PNG files."""

import json
import struct
from pathlib import Path
from typing import Any

import httpx
import pytest

from titan.bench.metrics_scraper import MetricsReducer, parse_prometheus_text
from titan.bench.report import load_report
from titan.entrypoints.cli import main

launcher = pytest.importorskip("harness.server")

# Small pools keep the server's warm-up short on two cores.
SERVER_ARGS = ["--model", "default", "--max-num-batched-tokens", "256", "--max-num-seqs", "16",
               "--kv-cache-memory", "0.1"]
NUM_REQUESTS = 4
OUTPUT_LEN = 4  # of each preset's main class
PRESET_ARGS = {
    "steady": ["--input-len", "24", "--request-rate", "8"],
    "burst": ["--input-len", "16", "--request-rate", "1", "--burst-size", "3", "--burst-interval", "0.3"],
    "prefill-storm": ["--input-len", "16", "--long-input-len", "128", "--long-output-len", "2",
                      "--long-fraction", "0.5", "--request-rate", "8"],
    "shared-prefix": ["--input-len", "8", "--prefix-len", "64", "--request-rate", "4"],
    "mixed-priority": ["--input-len", "16", "--batch-input-len", "48", "--batch-output-len", "8",
                       "--batch-fraction", "0.5", "--send-priority", "--endpoint", "chat", "--request-rate", "8"],
}


@pytest.fixture(scope="module")
def titan_server() -> Any:
    with launcher.ServerProcess(SERVER_ARGS) as server:
        yield server


def counters(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=30, trust_env=False).text
    samples = parse_prometheus_text(text)
    values = MetricsReducer().reduce(samples)
    hits = [s.value for s in samples if s.name == "titan:prefix_cache_hits_total"]
    return values | {"prefix_cache_hits": sum(hits)}


def check_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR" and data[-8:-4] == b"IEND", path
    width, height = struct.unpack(">II", data[16:24])
    assert width >= 600 and height >= 300


@pytest.mark.parametrize("preset", list(PRESET_ARGS))
def test_every_preset_against_titan(titan_server: Any, preset: str, tmp_path: Path) -> None:
    tokenizers = sorted(Path(__file__).resolve().parent.parent.glob(".titan-cache/SmolLM2-135M-*/tokenizer.json"))
    extra = ["--tokenizer", str(tokenizers[0])] if preset == "steady" and tokenizers else []
    before = counters(titan_server.url)
    code = main(["bench", "--base-url", titan_server.url, "--preset", preset, "--num-requests", str(NUM_REQUESTS),
                 "--output-len", str(OUTPUT_LEN), "--ignore-eos", "--scrape-interval", "0.5",
                 "--slo", "ttft=60000,itl=60000", "--save-requests", "--output-dir", str(tmp_path), "--quiet",
                 "--request-timeout", "120", *PRESET_ARGS[preset], *extra])
    after = counters(titan_server.url)
    assert code == 0
    report = load_report(tmp_path)
    summary, requests = report["summary"], report["requests"]
    assert (summary["requests"], summary["succeeded"], summary["failed"]) == (NUM_REQUESTS, NUM_REQUESTS, 0)
    assert report["meta"]["model"].startswith("SmolLM2-135M")
    assert report["workload"]["preset"] == preset

    # Token counts come from `usage`, agree with what was streamed, and with the server's own counters.
    for request in requests:
        assert request["usage_source"] == "usage" and request["completion_tokens"] == request["max_tokens"]
        assert 1 <= len(request["token_times"]) <= request["max_tokens"] and request["finish_reason"] == "length"
        assert request["prompt_tokens"] > 0 and request["ttft"] > 0 and request["e2e"] >= request["ttft"]
        assert request["sent_at"] >= request["scheduled_at"]
    assert summary["output_tokens"] == sum(request["max_tokens"] for request in requests)
    assert summary["usage_reported"] == NUM_REQUESTS
    main_class = {"prefill-storm": "interactive", "mixed-priority": "interactive"}.get(preset, "default")
    assert {request["max_tokens"] for request in requests if request["request_class"] == main_class} == {OUTPUT_LEN}
    assert after["generation_tokens"] - before["generation_tokens"] == summary["output_tokens"]
    assert after["prompt_tokens"] - before["prompt_tokens"] == summary["input_tokens"]
    if report["meta"]["endpoint"] == "completions":  # chat adds the template's tokens
        # Exact with the served model's tokenizer, else one token per filler word: the server may add a BOS.
        for request in requests:
            assert 0 <= request["prompt_tokens"] - request["input_tokens_estimate"] <= 1

    for metric, stats in report["latency_ms"].items():
        assert stats["count"] > 0, metric
        ordered = [stats[key] for key in ("min", "p50", "p90", "p95", "p99", "max")]
        assert ordered == sorted(ordered), metric
    assert report["latency_ms"]["ttft"]["count"] == NUM_REQUESTS
    assert report["goodput"]["good"] == NUM_REQUESTS and report["errors"]["count"] == 0
    assert report["server_metrics"]["available"] and report["server_metrics"]["prefix"] == "titan"
    assert any("running" in sample and "kv_usage" in sample for sample in report["server_metrics"]["samples"])
    assert report["transients"]["windows"]["itl"] and report["transients"]["stall_threshold_ms"] > 0
    json.dumps(report, allow_nan=False)
    for name in ("latency_over_time.png", "latency_cdf.png", "server_metrics.png"):
        check_png(tmp_path / name)

    classes = {request["request_class"] for request in requests}
    if preset == "prefill-storm":
        assert classes == {"interactive", "long-prefill"} and set(report["classes"]) == classes
        longest = max(r["prompt_tokens"] for r in requests if r["request_class"] == "long-prefill")
        assert longest >= 100
    if preset == "mixed-priority":
        assert classes == {"interactive", "batch"} and report["meta"]["endpoint"] == "chat"
    if preset == "shared-prefix":
        assert after["prefix_cache_hits"] > before["prefix_cache_hits"]
    if preset == "burst":
        scheduled = [request["scheduled_at"] for request in requests]
        assert scheduled.count(0.3) == 3


def test_warm_prefixes_leave_the_prefix_hot_before_the_run(titan_server: Any, tmp_path: Path) -> None:
    """--warm-prefixes: one 1-token request per shared prefix before the clock starts, not in the report. Every
    measured request then finds at least the prefix's three full 16-token blocks cached (64 tokens, and a seed
    no other test uses); without the warm-up the first would find none, so the hits could not reach 2 x 48."""
    before = counters(titan_server.url)
    code = main(["bench", "--base-url", titan_server.url, "--preset", "shared-prefix", "--num-requests", "2",
                 "--max-concurrency", "1", "--output-len", "2", "--ignore-eos", "--input-len", "8", "--prefix-len",
                 "64", "--seed", "77", "--warm-prefixes", "--no-plots", "--output-dir", str(tmp_path), "--quiet"])
    after = counters(titan_server.url)
    assert code == 0
    report = load_report(tmp_path)
    assert report["summary"]["requests"] == report["summary"]["succeeded"] == 2
    assert report["config"]["warm_prefixes"] is True
    # The warm-up's prompt reached the server too, on top of the measured ones.
    assert after["prompt_tokens"] - before["prompt_tokens"] > report["summary"]["input_tokens"] + 64
    assert after["prefix_cache_hits"] - before["prefix_cache_hits"] >= 2 * 48
