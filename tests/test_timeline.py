"""Per-request timelines: stall causes from step records (no model), then the real engine end to end."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import pytest

from titan import LLM, SamplingParams
from titan.engine.timeline import RequestTimeline, stall_cause


@dataclass
class Step:
    started: float
    duration: float
    num_prefill_tokens: int = 0
    gc_pause: float = 0.0


def newest_first(*steps: Step) -> list[Step]:
    return sorted(steps, key=lambda step: -step.started)


@pytest.mark.parametrize(("steps", "preempted", "cause"), [
    ([Step(1.0, 0.05)], False, "decode"),
    ([Step(1.0, 0.30, num_prefill_tokens=480)], False, "prefill_interference"),
    ([Step(1.0, 0.30, gc_pause=0.2)], False, "gc"),
    ([Step(1.0, 0.05), Step(1.05, 0.05), Step(1.10, 0.05)], False, "queueing"),
    ([Step(1.0, 0.05, gc_pause=0.2)], True, "preemption"),  # preemption outranks everything
])
def test_stall_cause_rules(steps: list[Step], preempted: bool, cause: str) -> None:
    end = max(step.started + step.duration for step in steps)
    # A step that ended before the previous token (t=1.0) is outside the gap and must be ignored.
    history = newest_first(*steps, Step(0.5, 0.5, num_prefill_tokens=512, gc_pause=0.5))
    assert stall_cause(end - 1.0, preempted, 1.0, history) == cause


def test_longest_stall_keeps_the_maximum_and_sees_preemption() -> None:
    timeline = RequestTimeline()
    steps = [Step(0.0, 0.1, num_prefill_tokens=16)]
    timeline.record_token(0.1, 0, newest_first(*steps))  # first token: no gap yet
    assert timeline.longest_stall is None and timeline.num_decode_steps == 0
    steps.append(Step(0.1, 0.05))
    timeline.record_token(0.15, 0, newest_first(*steps))
    assert timeline.longest_stall is not None and timeline.longest_stall.cause == "decode"
    steps += [Step(0.15, 0.05), Step(0.2, 0.4, num_prefill_tokens=64)]  # preempted, then recomputed
    timeline.record_token(0.6, 1, newest_first(*steps))
    steps.append(Step(0.6, 0.05))
    timeline.record_token(0.65, 1, newest_first(*steps))  # shorter gap: the longest stays
    stall = timeline.longest_stall
    assert stall.cause == "preemption" and stall.seconds == pytest.approx(0.45) and stall.ended == 0.6
    assert timeline.num_decode_steps == 3


@pytest.fixture(scope="module")
def llm() -> LLM:
    # A small token budget splits a prompt into several prefill chunks.
    return LLM("default", device="cpu", max_num_batched_tokens=32, slow_request_ms=0.001)


def test_engine_timeline_is_consistent(llm: LLM, caplog: pytest.LogCaptureFixture) -> None:
    prompt = "Write a long and detailed story about a lighthouse keeper who finds a message in a bottle. " * 2
    with caplog.at_level(logging.WARNING, logger="titan.engine"):
        output = llm.generate(prompt, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0]
    timeline = output.timeline
    assert timeline is not None
    chunks = timeline["prefill_chunks"]
    num_prompt = output.num_prompt_tokens
    assert timeline["prompt_tokens"] == num_prompt and num_prompt > 32
    assert len(chunks) >= 2 and all(chunk["tokens"] <= 32 for chunk in chunks)
    assert sum(chunk["tokens"] for chunk in chunks) == num_prompt - timeline["cached_prompt_tokens"]
    starts = [chunk["start_ms"] for chunk in chunks]
    # A chunk starts with its step; the request counts as scheduled a moment later, inside that step.
    assert starts == sorted(starts) and timeline["queued_ms"] <= starts[0] + 5.0
    assert chunks[-1]["start_ms"] + chunks[-1]["step_ms"] <= timeline["ttft_ms"] + 1.0
    assert timeline["ttft_ms"] <= timeline["e2e_ms"]
    assert timeline["output_tokens"] == 6 and timeline["decode_steps"] == 5
    stall = timeline["longest_stall"]
    assert stall["cause"] in ("decode", "gc", "queueing", "prefill_interference", "preemption")
    assert 0 < stall["ms"] <= timeline["e2e_ms"] - timeline["ttft_ms"] + 1.0
    assert timeline["preemptions"] == 0 and timeline["recomputed_tokens"] == 0
    # A tiny slow-request threshold logs every request, with its timeline.
    assert any("slow request" in record.getMessage() and '"prefill_chunks"' in record.getMessage()
               for record in caplog.records)


def test_degradation_clamps_batch_max_tokens_only_under_pressure() -> None:
    llm = LLM("default", device="cpu", degrade_batch_max_tokens=2, slow_request_ms=0)
    engine = llm.engine
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    engine.add_request("First batch job", params, "first", priority=1)  # queue empty: untouched
    engine.add_request("Interactive question", params, "interactive", priority=0)  # interactive: untouched
    engine.add_request("Second batch job", params, "second", priority=1)  # others waiting: clamped
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    assert [len(finals[name].token_ids) for name in ("first", "interactive", "second")] == [6, 6, 2]
    assert finals["first"].degradations == {} and finals["interactive"].degradations == {}
    assert finals["second"].degradations == {"max_tokens": {"requested": 6, "applied": 2}}
    assert engine.admission.degradations == {"max_tokens": 1}
