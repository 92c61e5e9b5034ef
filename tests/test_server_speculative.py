"""Speculative decoding through `titan serve --speculative-config`: the same greedy text streamed or not as
without it, drafts and acceptance in the timeline, /debug/steps and vLLM's spec_decode metrics (zero without it)."""

from __future__ import annotations

import json

import httpx
import pytest
from openai import OpenAI

from harness.server import ServerProcess

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "adaptive": False}
DRAFT = {"method": "draft_model", "model": "default", "num_speculative_tokens": 2, "adaptive": False}
PASSAGE = ("The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single "
           "step. To be or not to be, that is the question.")
MODEL = "SmolLM2-135M-Instruct.Q4_1"
MESSAGES = [{"role": "user", "content": "Repeat this text exactly:\n\n" + PASSAGE}]


@pytest.fixture(scope="module")
def servers() -> dict[str, ServerProcess]:
    with ServerProcess(["--threads", "1", "--speculative-config", json.dumps(SPEC)]) as spec, \
            ServerProcess(["--threads", "1", "--speculative-config", json.dumps(DRAFT)]) as draft, \
            ServerProcess(["--threads", "1"]) as plain:
        yield {"spec": spec, "draft": draft, "plain": plain}


def test_speculation_is_invisible_in_the_text_and_visible_in_the_numbers(servers: dict[str, ServerProcess]) -> None:
    texts = {}
    for name, server in servers.items():
        client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=40, temperature=0,
                                               extra_body={"titan_timeline": True})
        stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=40, temperature=0,
                                                stream=True)
        streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
        assert streamed == reply.choices[0].message.content
        texts[name] = (reply.choices[0].message.content, reply.usage.completion_tokens)
        timeline = reply.choices[0].model_extra["titan_timeline"]
        if name != "plain":
            assert 0 < timeline["accepted_draft_tokens"] <= timeline["draft_tokens"]
            assert timeline["decode_steps"] < reply.usage.completion_tokens - 1  # several tokens per step
    assert texts["spec"] == texts["plain"] == texts["draft"]

    spec = servers["spec"]

    def total(name: str) -> float:
        return sum(sample.value for sample in spec.metric_samples(name))

    drafts = total("titan:spec_decode_num_draft_tokens_total")
    accepted = total("titan:spec_decode_num_accepted_tokens_total")
    assert total("titan:spec_decode_num_drafts_total") > 0
    assert 0 < accepted <= drafts
    by_position = {s.labels["position"]: s.value
                   for s in spec.metric_samples("titan:spec_decode_num_accepted_tokens_per_pos_total")}
    per_position = [by_position[str(p)] for p in range(4)]
    assert sum(per_position) == accepted and per_position == sorted(per_position, reverse=True)
    steps = httpx.get(spec.url + "/debug/steps", timeout=30).json()["data"]
    assert sum(step["num_accepted_tokens"] for step in steps) == accepted
    assert [s.value for s in servers["plain"].metric_samples("titan:spec_decode_num_drafts_total")] == [0.0]
