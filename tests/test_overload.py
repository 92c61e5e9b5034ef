"""The slo policy holds an overload at the full batch's step (titan.engine.overload)."""

from __future__ import annotations

import numpy as np
import pytest
from test_scheduler_policies import fixed_cost_model, step

from titan.config import SchedulerConfig
from titan.engine.block_manager import BlockManager
from titan.engine.cost_model import StepCostModel, StepShape
from titan.engine.overload import OVERLOAD_REFILL_SHARE, OutputLengths, full_batch_step
from titan.engine.prefill_budget import OVERLOAD_BACKLOG_REQUESTS, choose_budget
from titan.engine.queue_forecast import QueuedPrefill
from titan.engine.sampling_params import SamplingParams
from titan.engine.scheduler import Scheduler
from titan.engine.sequence import Sequence


def test_full_batch_step_is_the_full_width_beside_its_refill() -> None:
    """32 decodes refilled at 0.8 x the rate they free: 40-token prompts per 20 output tokens, 51 prompt tokens
    a step (0.8 x 32 x 2 = 51.2): 0.1 s + 83 x 0.01 s. Short outputs want more refill than the budget holds:
    the whole budget (256 tokens). Nothing known yet: no bound."""
    model = fixed_cost_model(0.1, 0.01)
    typical = StepShape(2, 2, 0.0)
    assert OVERLOAD_REFILL_SHARE == 0.8
    assert full_batch_step(model, typical, 32, 256, 40, 20) == pytest.approx(0.93)
    assert full_batch_step(model, typical, 32, 256, 40, 2) == pytest.approx(2.66)
    # A KV cache of 1,200 tokens holds 20 requests of 40 + 20 tokens: 20 decodes beside 0.8 x 20 x 2 = 32 tokens.
    assert full_batch_step(model, typical, 32, 256, 40, 20, kv_cache_tokens=1200) == pytest.approx(0.62)
    assert full_batch_step(model, typical, 32, 256, 40, 20, kv_cache_tokens=10) == pytest.approx(0.1 + 0.01 * 3)
    assert full_batch_step(model, StepShape(), 32, 256, 40, 20) == 0.0
    assert full_batch_step(model, typical, 32, 256, 40, 0) == 0.0


def test_full_batch_decodes_attend_as_the_typical_ones_do() -> None:
    """With attention priced, each of the full batch's decodes attends to what a typical one does."""
    model = StepCostModel()
    model.weights = np.array([0.0, 0.0, 0.0, 1.0])  # a second per 1,000 attention pairs
    typical = StepShape(2, 2, 600.0)  # 300 pairs each
    assert full_batch_step(model, typical, 10, 256, 1, 1000) == pytest.approx(3.0)  # no refill token: 10 x 0.3 s


def test_output_lengths_follow_recent_finishes() -> None:
    lengths = OutputLengths(span=3)  # weight 0.5
    assert lengths.mean is None
    lengths.record(0)  # aborted before a token: no length
    assert lengths.mean is None
    lengths.record(20)
    lengths.record(40)
    assert lengths.mean == pytest.approx(30.0)


def overload_queue() -> list[QueuedPrefill]:
    return [QueuedPrefill(40, 0.0, 10.0, 0) for _ in range(20)]


def test_an_overload_drain_is_held_at_the_full_batch_step() -> None:
    """Prompts arriving faster than whole-budget steps prefill them: keeping pace asks for the whole budget
    (2.58 s beside two decodes). Held at a 0.5 s full-batch step, the drain's widest step is that, and its
    chosen step within it."""
    model = fixed_cost_model(0.1, 0.01)
    decodes = StepShape(2, 2, 0.0)
    args = (model, decodes, 254, 0.245, overload_queue(), 2, 4.0)
    options = dict(min_chunk=1, demand=3232.0, typical=decodes, max_drain_factor=2.5)
    free = choose_budget(*args, **options)
    assert free.reason == "backlog" and free.drain_bound_ms == pytest.approx(2660.0)
    assert free.full_batch_step_ms is None
    held = choose_budget(*args, **options, overload_step=0.5)
    assert held.reason == "backlog" and held.drain_bound_ms == pytest.approx(500.0)
    assert held.step_target_ms <= 500.0 + 1e-9 and held.prefill_tokens <= 38
    # The bound never goes below the drain's own excursion bound (2.5 x the decodes' 0.12 s) or the cap.
    low = choose_budget(*args, **options, overload_step=0.05)
    assert low.drain_bound_ms == pytest.approx(300.0)


def late_queue(size: int) -> list[QueuedPrefill]:
    return [QueuedPrefill(40, 20.0, 10.0, 0) for _ in range(size)]  # each waited past its target already


def test_a_backlog_nobody_can_be_on_time_in_is_held_at_the_full_batch_step_once_it_is_long() -> None:
    """No arrivals to keep pace with and every queued request late whatever the chunk: a short queue takes the
    futile drain's step (1.5 x the 0.245 s cap, cut to the drain's 0.3 s bound), one of
    OVERLOAD_BACKLOG_REQUESTS or more the 0.5 s full-batch step, 38 prompt tokens beside the two decodes."""
    assert OVERLOAD_BACKLOG_REQUESTS == 12
    model = fixed_cost_model(0.1, 0.01)
    decodes = StepShape(2, 2, 0.0)
    options = dict(min_chunk=1, typical=decodes, max_drain_factor=2.5, overload_step=0.5)
    short = choose_budget(model, decodes, 254, 0.245, late_queue(11), 2, 4.0, **options)
    assert (short.reason, short.ttft_met) == ("backlog", 0)
    assert short.drain_bound_ms == pytest.approx(300.0) and short.prefill_tokens == 18
    long = choose_budget(model, decodes, 254, 0.245, late_queue(12), 2, 4.0, **options)
    assert (long.reason, long.ttft_met) == ("backlog", 0)
    assert long.drain_bound_ms == pytest.approx(500.0) and long.step_target_ms == pytest.approx(500.0)
    assert long.prefill_tokens == 38
    # Never past the whole budget's step.
    whole = choose_budget(model, decodes, 254, 0.245, late_queue(12), 2, 4.0, **{**options, "overload_step": 9.0})
    assert whole.prefill_tokens == 254 and whole.step_target_ms == pytest.approx(2660.0)


def overloaded_scheduler(now: list[float], finish_one: bool, ttft_target_ms: int = 10_000) -> Scheduler:
    """Two streams decoding (and, with `finish_one`, a third that finishes after 20 tokens), then 20 prompts of
    40 tokens at once: 3,200 tokens/s over the quarter of the 1 s window a rate is measured over at least."""
    config = SchedulerConfig(256, 32, policy="slo", aging_seconds=0.0, itl_slo_ms=245.0, ttft_target_ms=ttft_target_ms,
                             max_itl_excursion=4.0, prefill_demand_window_s=1.0, batch_min_requests=0,
                             max_drain_step_factor=2.5)
    scheduler = Scheduler(config, BlockManager(512, 4), 4096, frozenset({2}), fixed_cost_model(0.1, 0.01),
                          clock=lambda: now[0])
    streams = [(500, 100), (500, 110)] + ([(20, 120)] if finish_one else [])
    for max_tokens, first in streams:
        scheduler.add(Sequence(list(range(first, first + 4)), SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                               arrival_time=now[0]))
    for _ in range(21):
        step(scheduler)
        now[0] += 0.1
    for n in range(20):
        first = 1000 + 100 * n
        scheduler.add(Sequence(list(range(first, first + 40)), SamplingParams(max_tokens=20, ignore_eos=True),
                               arrival_time=now[0]))
    return scheduler


def test_the_slo_policy_holds_an_overload_once_it_knows_the_output_lengths() -> None:
    """A request has finished (20 output tokens) and the window's prompts are 40 tokens each: the full batch
    (32 decodes and 51 prompt tokens, 0.93 s) bounds the flood's drain, not the whole budget (2.66 s). Before
    any request has finished the output length is unknown, and the drain keeps pace with the arrivals."""
    now = [1000.0]
    held = step(overloaded_scheduler(now, finish_one=True)).budget
    assert held.reason == "backlog" and held.drain_bound_ms == pytest.approx(930.0)
    assert held.full_batch_step_ms == pytest.approx(930.0)  # shown in /debug/steps
    assert held.step_target_ms <= 930.0 + 1e-9
    now = [1000.0]
    free = step(overloaded_scheduler(now, finish_one=False)).budget
    assert free.reason == "backlog" and free.drain_bound_ms == pytest.approx(2660.0)
    assert free.full_batch_step_ms is None


def test_an_overloads_backlog_is_held_once_its_arrivals_have_stopped() -> None:
    """The 20 prompts arrived 1.5 s ago, out of the 1 s demand window: nothing asks to keep pace any more, but
    the backlog (late against its 0.5 s targets) is still held at the full batch's step, its prompts read from
    the queue (40 tokens each: 32 decodes beside 51 prompt tokens, 0.93 s) rather than from the window."""
    now = [1000.0]
    scheduler = overloaded_scheduler(now, finish_one=True, ttft_target_ms=500)
    now[0] += 1.5
    budget = step(scheduler).budget
    assert budget.reason == "backlog" and budget.demand_tokens_per_s == 0.0
    assert budget.full_batch_step_ms == pytest.approx(930.0)
    assert budget.drain_bound_ms == pytest.approx(930.0) and budget.ttft_met == 0
