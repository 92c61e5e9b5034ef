"""A flooded server answers 429 `overloaded` with Retry-After, counts it, and keeps serving."""

from __future__ import annotations

import asyncio

import httpx

from harness.server import ServerProcess


def test_flood_gets_429_with_retry_after_and_server_keeps_serving() -> None:
    with ServerProcess(["--max-queued-requests", "2", "--max-num-seqs", "2"]) as server:
        model = httpx.get(server.url + "/v1/models", timeout=30).json()["data"][0]["id"]
        body = {"model": model, "prompt": "Tell me a story about a lighthouse.", "max_tokens": 24,
                "ignore_eos": True}

        async def flood() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
                return await asyncio.gather(*(client.post("/v1/completions", json=body) for _ in range(16)))

        responses = asyncio.run(flood())
        statuses = [r.status_code for r in responses]
        assert set(statuses) <= {200, 429} and 200 in statuses and 429 in statuses
        for response in responses:
            if response.status_code == 429:
                error = response.json()["error"]
                assert error["code"] == "overloaded" and "overloaded" in error["message"]
                assert int(response.headers["Retry-After"]) >= 1
            else:
                assert response.json()["usage"]["completion_tokens"] == 24
        after = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
        assert after.status_code == 200
        rejections = server.metric_samples("titan:admission_rejections_total")
        assert all(sample.labels["reason"] == "queue_requests" for sample in rejections)
        assert sum(sample.value for sample in rejections) == statuses.count(429)
