"""Admission decisions and Retry-After values with a fixed cost model (no model needed)."""

from __future__ import annotations

import numpy as np
import pytest

from titan.config import AdmissionConfig, SchedulerConfig
from titan.engine.admission import AdmissionController, AdmissionRejectedError
from titan.engine.cost_model import StepCostModel, StepShape
from titan.engine.sampling_params import SamplingParams
from titan.engine.sequence import Sequence


def controller(policy: str = "fcfs", itl_slo_ms: float | None = None, min_prefill_chunk: int = 1,
               **limits) -> AdmissionController:
    model = StepCostModel()
    model.weights = np.array([0.05, 0.002, 0.0, 0.0])  # 50 ms per step + 2 ms per token
    scheduling = SchedulerConfig(max_num_batched_tokens=100, policy=policy, itl_slo_ms=itl_slo_ms,
                                 min_prefill_chunk=min_prefill_chunk)
    return AdmissionController(AdmissionConfig(**limits), model, scheduling)


def seq(tokens: int, priority: int = 0) -> Sequence:
    return Sequence(list(range(tokens)), SamplingParams(), priority=priority)


def decoding(count: int) -> list[Sequence]:
    """Running sequences past their prompts: one decode token each per step."""
    running = [seq(10) for _ in range(count)]
    for running_seq in running:
        running_seq.num_computed_tokens = running_seq.num_tokens - 1
    return running


def shape(running: list[Sequence]) -> StepShape:
    result = StepShape()
    for running_seq in running:
        result = result.plus(1, running_seq.num_tokens - 1)
    return result


def test_queue_bound_and_batch_is_shed_first() -> None:
    admission = controller(max_queued_requests=4)
    waiting = [seq(10), seq(10)]
    admission.check(seq(10), waiting, running=[])  # interactive: 3 of 4
    with pytest.raises(AdmissionRejectedError) as batch:
        admission.check(seq(10, priority=1), waiting, running=[])  # batch may use 2 of 4
    assert batch.value.reason == "queue_requests"
    with pytest.raises(AdmissionRejectedError):
        admission.check(seq(10), [*waiting, seq(10), seq(10)], running=[])
    assert admission.rejections == {"queue_requests": 2}


def test_token_bound() -> None:
    admission = controller(max_queued_tokens=100)
    admission.check(seq(40), [seq(50)], running=[])
    with pytest.raises(AdmissionRejectedError) as error:
        admission.check(seq(60), [seq(50)], running=[])
    assert error.value.reason == "queue_tokens"


def test_predicted_ttft_and_retry_after() -> None:
    admission = controller(ttft_slo_ms=1000.0)
    # 250 queued tokens = 2 full steps of 100 (0.25 s each) + one of 50 (0.15 s) = 0.65 s.
    assert admission.predicted_prefill_seconds(250, StepShape()) == pytest.approx(0.65)
    # Beside 3 decodes a step has room for 97: 2 × (0.05 + 0.2) + (0.05 + 0.002 × 59) s.
    assert admission.predicted_prefill_seconds(250, shape(decoding(3))) == pytest.approx(0.668)
    admission.check(seq(50), [seq(150)], running=[])  # 200 tokens: 0.5 s ≤ 1 s
    with pytest.raises(AdmissionRejectedError) as batch:
        admission.check(seq(60, priority=1), [seq(150)], running=[])  # 0.57 s, batch target: 0.5 s
    assert batch.value.reason == "ttft_slo"
    long_queue = [seq(100) for _ in range(12)]  # 12 steps × 0.25 s = 3 s to drain
    with pytest.raises(AdmissionRejectedError) as error:
        admission.check(seq(10), long_queue, running=[])
    # Its own first token is predicted 3.07 s away (the queue, then its step): Retry-After never says less.
    assert "predicted time to first token is 3070 ms" in str(error.value)
    assert error.value.retry_after_seconds == 4
    assert "Retry in 4 s" in str(error.value)
    with pytest.raises(AdmissionRejectedError) as queue_full:
        controller(max_queued_requests=12).check(seq(10), long_queue, running=[])
    assert queue_full.value.reason == "queue_requests" and queue_full.value.retry_after_seconds == 3


def test_a_prompt_predicted_to_miss_the_target_is_refused_even_when_long() -> None:
    admission = controller(ttft_slo_ms=1000.0)
    with pytest.raises(AdmissionRejectedError) as error:
        admission.check(seq(600), [], running=[])  # 1.5 s alone
    assert error.value.reason == "ttft_slo" and error.value.retry_after_seconds == 2
    admission.check(seq(300), [], running=[])  # 0.75 s


def test_on_request_a_long_prompt_is_refused_for_the_queue_ahead_not_for_its_own_length() -> None:
    admission = controller(ttft_slo_ms=1000.0, admit_long_prompts=True)
    # 600 tokens take 1.5 s alone, over the target: admitted while the wait ahead stays under 0.5 s...
    admission.check(seq(600), [], running=[])
    admission.check(seq(600), [seq(100)], running=[])  # 0.25 s ahead
    # ...and refused when the queue ahead would take longer than that.
    with pytest.raises(AdmissionRejectedError) as error:
        admission.check(seq(600), [seq(100), seq(100), seq(100)], running=[])  # 0.75 s ahead
    assert error.value.reason == "ttft_slo"


def test_only_the_work_the_scheduler_runs_first_counts_as_ahead() -> None:
    # Which work is ahead is the scheduler's call (tests/test_scheduler_policies.py); admission prices it.
    long_batch, long_interactive, short = seq(150, priority=1), seq(150), seq(20)
    waiting = [long_batch, long_interactive, short]
    newcomer = seq(30)
    # By default everything queued is ahead (fcfs): 350 tokens, 0.9 s > 0.5 s.
    with pytest.raises(AdmissionRejectedError):
        controller("fcfs", ttft_slo_ms=500.0).check(newcomer, waiting, running=[])
    # slo runs only the shorter prompt first: a short prompt is admitted past queued long ones.
    controller("slo", itl_slo_ms=100.0, ttft_slo_ms=500.0).check(newcomer, waiting, running=[], ahead=[short])


def test_slo_policy_prices_the_queue_at_its_capped_chunks() -> None:
    admission = controller("slo", itl_slo_ms=100.0, ttft_slo_ms=1000.0)
    # 5 decodes take 60 ms, leaving 40 ms: 20 prefill tokens per 100 ms step; 250 tokens = 12.5 steps.
    assert admission.predicted_prefill_seconds(250, shape(decoding(5))) == pytest.approx(12 * 0.1 + 0.08)
    # Decodes alone over the target: prefill still moves min_prefill_chunk tokens per step (1 by default).
    assert admission.predicted_prefill_seconds(4, shape(decoding(40))) == pytest.approx(4 * (0.05 + 0.002 * 41))
    floored = controller("slo", itl_slo_ms=100.0, min_prefill_chunk=16, ttft_slo_ms=1000.0)
    assert floored.predicted_prefill_seconds(32, shape(decoding(40))) == pytest.approx(2 * (0.05 + 0.002 * 56))
    # Nothing decoding: no cap, budget-sized chunks as without the slo policy.
    assert admission.predicted_prefill_seconds(250, StepShape()) == pytest.approx(0.65)
    with pytest.raises(AdmissionRejectedError):
        # 150 tokens ahead take 0.8 s, and its own 200 tokens are long: 0.8 + 0.5 s > 1 s.
        admission.check(seq(200), [seq(150)], running=decoding(5))
    # A running prompt still prefilling is ahead too.
    prefilling = seq(150)
    admission.check(seq(200), [], running=decoding(5))  # long, but nothing ahead of it
    with pytest.raises(AdmissionRejectedError):
        admission.check(seq(200), [], running=[*decoding(4), prefilling])
    with pytest.raises(AdmissionRejectedError):
        admission.check(seq(200), [], running=[*decoding(4), prefilling], ahead=[prefilling])


def test_no_limits_admit_everything_and_unfitted_model_predicts_nothing() -> None:
    admission = AdmissionController(AdmissionConfig(ttft_slo_ms=1.0), StepCostModel(),
                                    SchedulerConfig(max_num_batched_tokens=100))
    admission.check(seq(5000), [seq(5000)] * 50, running=decoding(10))
    assert admission.predicted_prefill_seconds(10_000, shape(decoding(10))) == 0.0


def test_servers_bound_the_queue_by_the_kv_pool_unless_told_otherwise() -> None:
    admission = controller()
    admission.bound_queue_by_kv_pool(kv_pool_tokens=1000)
    assert (admission.config.max_queued_tokens, admission.config.max_queued_requests) == (2000, 4 * 64)
    with pytest.raises(AdmissionRejectedError) as error:
        admission.check(seq(650), [seq(700), seq(700)], running=[])
    assert error.value.reason == "queue_tokens"
    unbounded = controller(max_queued_tokens=0, max_queued_requests=0)
    unbounded.bound_queue_by_kv_pool(kv_pool_tokens=1000)
    unbounded.check(seq(600), [seq(700)] * 400, running=[])


def test_config_validation() -> None:
    with pytest.raises(ValueError):
        AdmissionConfig(max_queued_requests=-1)
    with pytest.raises(ValueError):
        AdmissionConfig(batch_share=0.0)
