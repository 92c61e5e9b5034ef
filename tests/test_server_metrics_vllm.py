"""`--metrics-prefix vllm`: the metrics vLLM also has appear under vLLM's names and labels, with vLLM's
request-level histograms and its rejection counter, so tools written for vLLM read Titan unchanged."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from harness.server import ServerProcess

# vLLM's names (as exposed, without `_total` for counters' family names) and their kinds.
VLLM_FAMILIES = {
    "gauge": ["num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "cache_config_info"],
    "counter": ["prompt_tokens", "generation_tokens", "request_success", "num_preemptions",
                "prefix_cache_queries", "prefix_cache_hits", "num_requests_rejected"],
    "histogram": ["time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
                  "request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds",
                  "request_inference_time_seconds", "request_time_per_output_token_seconds",
                  "request_prompt_tokens", "request_generation_tokens", "request_max_num_generation_tokens",
                  "request_params_n", "request_params_max_tokens", "iteration_tokens_total"],
}
TITAN_ONLY = ["startup_seconds", "engine_step_seconds", "gc_pause_seconds"]


@pytest.fixture(scope="module")
def server() -> ServerProcess:
    with ServerProcess(["--metrics-prefix", "vllm", "--max-queued-requests", "2", "--max-num-seqs", "2"]) as server:
        yield server


def families(server: ServerProcess) -> dict[str, object]:
    text = httpx.get(server.url + "/metrics", timeout=30).text
    return {family.name: family for family in text_string_to_metric_families(text)}


def total(server: ServerProcess, name: str, **labels: str) -> float:
    return sum(sample.value for sample in server.metric_samples(name)
               if all(sample.labels.get(key) == value for key, value in labels.items()))


def test_vllm_names_and_labels(server: ServerProcess) -> None:
    model = httpx.get(server.url + "/v1/models", timeout=30).json()["data"][0]["id"]
    found = families(server)
    for kind, names in VLLM_FAMILIES.items():
        for name in names:
            if name == "num_requests_rejected":
                continue  # appears with its first rejection (test below)
            family = found["vllm:" + name]
            assert family.type == kind, name
            assert "titan:" + name not in found, f"{name} is exported twice"
            for sample in family.samples:
                assert sample.labels["engine"] == "0", sample
                assert sample.labels.get("model_name", model) == model, sample  # the info gauge has none, as vLLM's
    for name in TITAN_ONLY:  # no vLLM counterpart: the same name in both modes
        assert "titan:" + name in found and "vllm:" + name not in found
    (info,) = found["vllm:cache_config_info"].samples
    assert info.value == 1 and int(info.labels["block_size"]) > 0 and int(info.labels["num_gpu_blocks"]) > 1
    assert info.labels["enable_prefix_caching"] == "True"


def test_request_level_histograms(server: ServerProcess) -> None:
    names = ["vllm:request_params_n_sum", "vllm:request_params_n_count", "vllm:request_params_max_tokens_sum",
             "vllm:request_max_num_generation_tokens_sum", "vllm:request_inference_time_seconds_count",
             "vllm:request_time_per_output_token_seconds_count", "vllm:request_success_total"]
    before = {name: total(server, name) for name in names}
    reply = httpx.post(server.url + "/v1/completions", timeout=300,
                       json={"prompt": "Count: one, two,", "n": 2, "max_tokens": 5, "ignore_eos": True,
                             "temperature": 0.8, "seed": 3})
    assert reply.status_code == 200, reply.text
    delta = {name: total(server, name) - before[name] for name in names}
    assert delta["vllm:request_params_n_sum"] == 2 and delta["vllm:request_params_n_count"] == 1
    assert delta["vllm:request_params_max_tokens_sum"] == 5
    assert delta["vllm:request_max_num_generation_tokens_sum"] == 5
    assert delta["vllm:request_inference_time_seconds_count"] == 2  # one per choice, as vLLM counts sequences
    assert delta["vllm:request_time_per_output_token_seconds_count"] == 2
    assert delta["vllm:request_success_total"] == 2


def test_rejections_use_vllms_counter_and_reason(server: ServerProcess) -> None:
    body = {"prompt": "Tell me a story about a lighthouse.", "max_tokens": 24, "ignore_eos": True}

    async def flood() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
            return await asyncio.gather(*(client.post("/v1/completions", json=body) for _ in range(16)))

    statuses = [response.status_code for response in asyncio.run(flood())]
    assert 429 in statuses and 200 in statuses
    rejected = server.metric_samples("vllm:num_requests_rejected_total")
    assert {sample.labels["reason"] for sample in rejected} == {"queue_full"}
    assert sum(sample.value for sample in rejected) == statuses.count(429)
    assert not server.metric_samples("titan:admission_rejections_total")


def test_dashboard_reads_the_vllm_names(server: ServerProcess) -> None:
    values = httpx.get(server.url + "/debug/dashboard", timeout=30).json()["values"]
    assert values["running"] == 0 and values["KV usage"] is not None
