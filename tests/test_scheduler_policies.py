"""Priority, aging, displacement at the sequence cap and SLO-capped chunks, with a fixed cost model."""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import asdict

import numpy as np
import pytest

from titan.config import SchedulerConfig
from titan.engine.block_manager import BlockManager
from titan.engine.cost_model import StepCostModel, StepShape, shape_of
from titan.engine.prefill_budget import FUTILE_DRAIN_FACTOR, auto_ttft_seconds, choose_budget, most_on_time
from titan.engine.prefill_demand import (
    BATCH_WINDOW_SECONDS,
    CHANCE_CLUSTER_SHARE,
    MAX_TRACKED_ARRIVALS,
    ArrivalBatches,
    PrefillDemand,
    TypicalDecodes,
    paced_chunk,
    poisson_quantile,
)
from titan.engine.queue_forecast import QueuedPrefill, QueueForecast, decode_growth, queued_start
from titan.engine.sampling_params import SamplingParams
from titan.engine.scheduler import Scheduler
from titan.engine.scheduler_output import RunnerOutput, SchedulerOutput
from titan.engine.sequence import Sequence, SequenceStatus
from titan.engine.step_observer import StepRecord


def fixed_cost_model(per_step: float, per_token: float, per_sequence: float = 0.0) -> StepCostModel:
    model = StepCostModel()
    model.weights = np.array([per_step, per_token, per_sequence, 0.0])
    return model


def make(policy: str = "priority", budget: int = 64, max_seqs: int = 8, num_blocks: int = 64,
         itl_slo_ms: float | None = None, cost_model: StepCostModel | None = None, aging: float = 0.0,
         **options: float) -> Scheduler:
    """Aging is off unless a test is about it: it depends on the wall clock. So is slo's backlog rule (a
    TTFT target of days): arrivals count from the module's import, minutes before a test runs in a full suite."""
    options.setdefault("ttft_target_ms", 1e9)
    config = SchedulerConfig(budget, max_seqs, policy=policy, itl_slo_ms=itl_slo_ms, aging_seconds=aging,
                             **options)
    return Scheduler(config, BlockManager(num_blocks, 4), 1024, frozenset({2}), cost_model)


START = time.monotonic()
FIRST_TOKENS = itertools.count(100, 1000)


def sequence(length: int, priority: int = 0, arrival: float = 0.0, max_tokens: int = 50) -> Sequence:
    """`arrival` in seconds after the test module started (small, so aging stays out of the way).

    Each prompt has its own token ids, so no prefix-cache hit blurs the arithmetic."""
    first = next(FIRST_TOKENS)
    return Sequence(list(range(first, first + length)), SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                    priority=priority, arrival_time=START + arrival)


def step(scheduler: Scheduler) -> SchedulerOutput:
    """Schedule and pretend to run: every sampling sequence gets token 7."""
    output = scheduler.schedule()
    sampled = [s.seq_id for s in output.scheduled if s.sample]
    scheduler.commit(output, RunnerOutput(sampled, [7] * len(sampled), [None] * len(sampled)))
    return output


def test_higher_priority_arrival_preempts_at_the_sequence_cap() -> None:
    scheduler = make(max_seqs=2)
    batch = [sequence(5, priority=1, arrival=float(i)) for i in range(2)]
    for seq in batch:
        scheduler.add(seq)
    step(scheduler)
    interactive = sequence(5, priority=0, arrival=5.0)
    scheduler.add(interactive)
    output = step(scheduler)
    assert output.preempted_seq_ids == [batch[1].seq_id]  # the latest-arrived of the lowest priority
    assert {s.seq_id for s in output.scheduled} == {batch[0].seq_id, interactive.seq_id}
    assert batch[1].status is SequenceStatus.WAITING and batch[1].num_recomputed_tokens == 5


def test_fcfs_never_preempts_for_priority() -> None:
    scheduler = make(policy="fcfs", max_seqs=2)
    for i in range(2):
        scheduler.add(sequence(5, priority=1, arrival=float(i)))
    step(scheduler)
    scheduler.add(sequence(5, priority=0, arrival=5.0))
    output = step(scheduler)
    assert output.preempted_seq_ids == [] and len(output.scheduled) == 2


def test_equal_priority_does_not_displace() -> None:
    scheduler = make(max_seqs=1)
    first = sequence(5, priority=1, arrival=0.0)
    scheduler.add(first)
    step(scheduler)
    scheduler.add(sequence(5, priority=1, arrival=1.0))
    assert step(scheduler).preempted_seq_ids == []


def test_aging_lets_an_old_batch_request_go_before_a_new_interactive_one() -> None:
    scheduler = make(max_seqs=1, aging=10.0)
    now = time.monotonic() - START
    old_batch = sequence(5, priority=3, arrival=now - 45.0)  # waited 4 agings: effective priority -1
    fresh = sequence(5, priority=0, arrival=now)
    scheduler.add(fresh)
    scheduler.add(old_batch)
    assert [s.seq_id for s in step(scheduler).scheduled] == [old_batch.seq_id]
    # Once in, it is not pushed out by the request it went ahead of.
    output = step(scheduler)
    assert [s.seq_id for s in output.scheduled] == [old_batch.seq_id] and output.preempted_seq_ids == []

    no_aging = make(max_seqs=1, aging=0.0)
    old_batch, fresh = sequence(5, priority=3, arrival=now - 45.0), sequence(5, priority=0, arrival=now)
    no_aging.add(old_batch)
    no_aging.add(fresh)
    assert [s.seq_id for s in step(no_aging).scheduled] == [fresh.seq_id]


def test_aging_never_displaces_running_work_of_the_same_priority() -> None:
    """A long overload: the waiting request has aged four levels past the running one, but both are priority 0,
    so it waits for the slot instead of evicting (and so recomputing) the running request."""
    for policy in ("priority", "slo"):
        scheduler = make(policy=policy, max_seqs=1, aging=10.0)
        now = time.monotonic() - START
        running = sequence(5, arrival=now)
        scheduler.add(running)
        step(scheduler)
        scheduler.add(sequence(5, arrival=now - 45.0))
        output = step(scheduler)
        assert output.preempted_seq_ids == [] and [s.seq_id for s in output.scheduled] == [running.seq_id]


def test_decodes_are_never_starved_by_a_higher_priority_prefill() -> None:
    scheduler = make(budget=16)
    decoder = sequence(4, priority=1, arrival=0.0)
    scheduler.add(decoder)
    step(scheduler)
    long_prompt = sequence(100, priority=0, arrival=1.0)
    scheduler.add(long_prompt)
    for _ in range(5):
        output = step(scheduler)
        by_id = {s.seq_id: s.num_new_tokens for s in output.scheduled}
        assert by_id[decoder.seq_id] == 1
        assert by_id[long_prompt.seq_id] == 15


def test_slo_policy_caps_prefill_chunks_to_the_itl_target() -> None:
    # 10 ms per step + 1 ms per token, target 40 ms: 30 tokens fit in a step.
    scheduler = make(policy="slo", budget=256, itl_slo_ms=40.0, cost_model=fixed_cost_model(0.010, 0.001))
    decoders = [sequence(4, arrival=float(i)) for i in range(3)]
    for seq in decoders:
        scheduler.add(seq)
    step(scheduler)
    long_prompt = sequence(200, arrival=10.0)
    scheduler.add(long_prompt)
    chunks = []
    while long_prompt.num_computed_tokens < long_prompt.num_prompt_tokens:
        output = step(scheduler)
        by_id = {s.seq_id: s.num_new_tokens for s in output.scheduled}
        assert all(by_id[d.seq_id] == 1 for d in decoders if not d.is_finished)
        chunks.append(by_id[long_prompt.seq_id])
    assert chunks[:3] == [27, 27, 27]  # 3 decodes + 27 prefill tokens = 30 tokens = 40 ms
    assert sum(chunks) == 200


def test_slo_policy_auto_target_follows_the_decode_batch() -> None:
    """auto (the slo default): 1.5x the step's decodes alone. 10 ms per step + 0.5 ms per token: with 3
    decodes that is 1.5 x 11.5 = 17.25 ms, room for 11 prefill tokens; with 6 decodes 1.5 x 13 = 19.5 ms,
    13 tokens."""
    for num_decoders, expected in ((3, 11), (6, 13)):
        scheduler = make(policy="slo", budget=256, cost_model=fixed_cost_model(0.010, 0.0005))
        assert scheduler.config.itl_slo_ms == "auto"
        decoders = [sequence(4, arrival=float(i)) for i in range(num_decoders)]
        for seq in decoders:
            scheduler.add(seq)
        step(scheduler)
        long_prompt = sequence(200, arrival=10.0)
        scheduler.add(long_prompt)
        output = step(scheduler)
        assert {s.seq_id: s.num_new_tokens for s in output.scheduled}[long_prompt.seq_id] == expected


@pytest.mark.parametrize("min_prefill_chunk", [1, 16])
def test_slo_policy_still_progresses_prefills_when_the_target_is_unreachable(min_prefill_chunk: int) -> None:
    scheduler = make(policy="slo", budget=256, itl_slo_ms=5.0, cost_model=fixed_cost_model(0.010, 0.001),
                     min_prefill_chunk=min_prefill_chunk)
    decoder = sequence(4)
    scheduler.add(decoder)
    step(scheduler)
    long_prompt = sequence(40)
    other = sequence(40)
    scheduler.add(long_prompt)
    scheduler.add(other)
    output = step(scheduler)
    # The decode, then min_prefill_chunk of one prefill only.
    assert [s.num_new_tokens for s in output.scheduled] == [1, min_prefill_chunk]


def test_slo_policy_lets_a_short_prompt_pass_a_long_prefill() -> None:
    # 10 ms per step + 1 ms per token, target 40 ms: with one decode, 29 prefill tokens fit in a step.
    scheduler = make(policy="slo", budget=256, num_blocks=256, itl_slo_ms=40.0,
                     cost_model=fixed_cost_model(0.010, 0.001))
    decoder = sequence(4, arrival=0.0)
    scheduler.add(decoder)
    step(scheduler)
    long_prompt = sequence(400, arrival=1.0)
    scheduler.add(long_prompt)
    step(scheduler)
    assert long_prompt.status is SequenceStatus.RUNNING and 0 < long_prompt.num_computed_tokens < 400
    short = sequence(20, arrival=2.0)  # arrives later, but its deadline (2.0 + 10 x 30 ms) is the earlier
    scheduler.add(short)
    scheduled = {s.seq_id: s.num_new_tokens for s in step(scheduler).scheduled}
    assert scheduled[short.seq_id] == 20 and scheduled.get(long_prompt.seq_id, 0) <= 9
    assert short.num_output_tokens == 1  # its first token, while the long prompt is still prefilling
    # fcfs keeps arrival order: the short prompt waits behind the long one's chunks.
    fcfs = make(policy="fcfs", budget=32, num_blocks=256)
    first, second = sequence(400, arrival=1.0), sequence(20, arrival=2.0)
    fcfs.add(first)
    fcfs.add(second)
    assert [s.seq_id for s in step(fcfs).scheduled] == [first.seq_id]


def test_ahead_of_is_the_queued_work_each_policy_runs_first() -> None:
    schedulers = {policy: make(policy=policy, budget=64, num_blocks=256, itl_slo_ms=100.0,
                               cost_model=fixed_cost_model(0.010, 0.001))
                  for policy in ("fcfs", "priority", "slo")}
    for policy, scheduler in schedulers.items():
        prefilling = sequence(150, arrival=0.0)  # admitted: 64 of its 150 tokens computed in the first step
        scheduler.add(prefilling)
        step(scheduler)
        assert prefilling.status is SequenceStatus.RUNNING and 0 < prefilling.num_computed_tokens < 150
        long_batch, long_interactive, short = (sequence(150, priority=1, arrival=1.0), sequence(150, arrival=3.0),
                                               sequence(20, arrival=3.0))
        for seq in (long_batch, long_interactive, short):
            scheduler.waiting.append(seq)  # queued, as if every step's budget had gone elsewhere
            seq.status = SequenceStatus.WAITING
        newcomer = sequence(30, arrival=4.0)
        ahead = scheduler.ahead_of(newcomer)
        if policy == "fcfs":
            assert ahead == [prefilling, long_batch, long_interactive, short]
        elif policy == "priority":
            assert ahead == [prefilling, long_interactive, short]
        else:  # slo: within a priority level, the earliest arrival + 10x the predicted prefill of the prompt
            # (newcomer 4.0 + 10 x 40 ms = 4.4 s; prefilling 1.6, short 3.3, long_interactive 4.6)
            assert ahead == [prefilling, short]


def test_slo_policy_orders_prefills_by_their_own_deadline_not_by_what_is_left() -> None:
    """10 ms per step + 1 ms per token. A 400-token prompt (arrival 1.0, deadline 1.0 + 10 x 0.41 s = 5.1 s)
    has 20 tokens left; a 30-token prompt arrives at 2.0 (deadline 2.0 + 10 x 0.04 s = 2.4 s) and goes
    first. Keyed by what was left, the long prompt's deadline had moved up to 1.0 + 10 x 0.03 s = 1.3 s, and
    the short one queued behind it."""
    scheduler = make(policy="slo", budget=380, num_blocks=256, itl_slo_ms=1000.0,
                     cost_model=fixed_cost_model(0.010, 0.001))
    long_prompt = sequence(400, arrival=1.0)
    scheduler.add(long_prompt)
    step(scheduler)
    assert long_prompt.status is SequenceStatus.RUNNING and long_prompt.num_computed_tokens == 380
    short = sequence(30, arrival=2.0)
    assert scheduler.ahead_of(short) == []
    scheduler.add(short)
    assert [s.seq_id for s in step(scheduler).scheduled] == [short.seq_id, long_prompt.seq_id]


def test_slo_policy_keeps_arrival_order_among_like_prompts() -> None:
    # 10 ms per step + 1 ms per token. The older prompt is 20 tokens longer: fewest tokens first would let the
    # newer one pass, but its slack deadline (1.0 + 10 x 150 ms) is later than the older one's (10 x 170 ms).
    scheduler = make(policy="slo", budget=160, num_blocks=256, itl_slo_ms=1000.0,
                     cost_model=fixed_cost_model(0.010, 0.001))
    older, newer = sequence(160, arrival=0.0), sequence(140, arrival=1.0)
    for seq in (newer, older):
        scheduler.add(seq)
    assert [s.seq_id for s in step(scheduler).scheduled] == [older.seq_id]
    # A prompt with much less to do still passes: 20 tokens arriving 1 s later are due at 1.3 s, before 1.7 s.
    scheduler = make(policy="slo", budget=160, num_blocks=256, itl_slo_ms=1000.0,
                     cost_model=fixed_cost_model(0.010, 0.001))
    older, short = sequence(160, arrival=0.0), sequence(20, arrival=1.0)
    for seq in (older, short):
        scheduler.add(seq)
    assert [s.seq_id for s in step(scheduler).scheduled][0] == short.seq_id


def test_slo_policy_does_not_chunk_a_step_without_decodes() -> None:
    # Nobody is mid-stream: chunking would only delay first tokens.
    scheduler = make(policy="slo", budget=256, itl_slo_ms=5.0, cost_model=fixed_cost_model(0.010, 0.001))
    for _ in range(2):
        scheduler.add(sequence(40))
    assert [s.num_new_tokens for s in step(scheduler).scheduled] == [40, 40]


def test_slo_policy_without_a_fitted_model_uses_the_budget() -> None:
    scheduler = make(policy="slo", budget=64, itl_slo_ms=5.0, cost_model=StepCostModel())
    seq = sequence(100)
    scheduler.add(seq)
    assert [s.num_new_tokens for s in step(scheduler).scheduled] == [64]


def test_preemption_cost_is_recorded() -> None:
    scheduler = make(policy="fcfs", num_blocks=6, budget=64)
    seqs = [sequence(8, arrival=float(i), max_tokens=8) for i in range(3)]
    for seq in seqs:
        scheduler.add(seq)
    step(scheduler)
    output = step(scheduler)
    assert output.preempted_seq_ids == [seqs[2].seq_id]
    victim = seqs[2]
    assert victim.num_preemptions == 1 and victim.num_recomputed_tokens == 8 and victim.preempted_at is not None
    while scheduler.has_unfinished:
        step(scheduler)
    assert victim.preempted_at is None and victim.preempted_seconds > 0


def test_cost_model_fits_a_linear_law() -> None:
    model = StepCostModel(forgetting=1.0)
    rng = np.random.default_rng(0)
    for _ in range(50):
        tokens, sequences = int(rng.integers(1, 512)), int(rng.integers(1, 32))
        shape = StepShape(tokens, sequences, float(rng.integers(0, 100_000)))
        model.observe(shape, 0.02 + 0.0015 * tokens + 0.0005 * sequences + 0.001 * shape.attention_pairs / 1000)
    assert abs(model.predict(StepShape(256, 8, 50_000.0)) - (0.02 + 0.384 + 0.004 + 0.05)) < 1e-3
    assert model.max_chunk(StepShape(8, 8, 0.0), 0, 500, 0.2) < model.max_chunk(StepShape(8, 8, 0.0), 0, 500, 0.4)


def test_cost_model_learns_a_stall_only_partly() -> None:
    model = StepCostModel()
    shape = StepShape(32, 32, 6400.0)
    for _ in range(20):
        model.observe(shape, 0.1)
    model.observe(shape, 5.0)  # a GC pause or a noisy neighbour
    assert model.predict(shape) < 0.2


def test_cost_model_learns_a_fast_fluke_only_partly() -> None:
    model = StepCostModel()
    shape = StepShape(32, 32, 6400.0)
    for _ in range(20):
        model.observe(shape, 0.1)
    model.observe(shape, 0.001)  # a step timed wrong, or one that did no real work
    assert model.predict(shape) > 0.08


def test_cost_model_recovers_from_a_poisoning_cold_first_step() -> None:
    """An offline LLM runs no warm-up: its first prefill (cold caches, kernel compilation) took 11 s. The fit
    must not keep predicting up to 3x the decode steps that follow (it explains the 11 s by attention, which
    the decodes of that 455-token context also do)."""

    def truth(shape: StepShape) -> float:
        return 0.02 + 0.003 * shape.num_tokens + 0.001 * shape.num_sequences

    def decode_batch(size: int) -> StepShape:
        shape = StepShape()
        for _ in range(size):
            shape = shape.plus(1, 460)
        return shape

    model = StepCostModel()
    model.observe(StepShape().plus(455, 0), 11.0)
    decodes = [decode_batch(size) for size in (1, 2, 3, 4)]
    for count in range(6 * model.min_observations):  # it used to be still 7x off after 100
        shape = decodes[count % len(decodes)]
        model.observe(shape, truth(shape))
    assert model.num_resets >= 1
    for shape in decodes:
        assert abs(model.predict(shape) - truth(shape)) < 0.2 * truth(shape)


def test_cost_model_rebuilt_from_decodes_alone_still_prices_a_prefill() -> None:
    """The machine slows down 2.5x while only two streams decode: the fit is rebuilt from those steps, which
    say nothing of the per-token cost of a prefill. That must stay known from before (a 512-token step must
    not suddenly look as cheap as a decode), not collapse onto the decodes' intercept."""

    def truth(shape: StepShape, slowdown: float = 1.0) -> float:
        return slowdown * (0.02 + 0.004 * shape.num_tokens + 0.002 * shape.num_sequences)

    def decode_batch(size: int, context: int = 300) -> StepShape:
        shape = StepShape()
        for _ in range(size):
            shape = shape.plus(1, context)
        return shape

    model = StepCostModel()
    rng = np.random.default_rng(0)
    for count in range(200):
        shape = decode_batch(int(rng.integers(1, 8)))
        if count % 5 == 0:
            shape = shape.plus(int(rng.integers(16, 512)), 0)
        model.observe(shape, truth(shape))
    for count in range(40):
        shape = decode_batch(2, 300 + count)
        model.observe(shape, truth(shape, 2.5))
    assert model.num_resets >= 1
    assert abs(model.predict(decode_batch(2)) - truth(decode_batch(2), 2.5)) < 0.2 * truth(decode_batch(2), 2.5)
    prefill = StepShape().plus(512, 0)
    assert model.predict(prefill) > 0.8 * truth(prefill)  # at least the old cost, not the decodes'


def budget_scheduler(ttft_target_ms: float, max_itl_excursion: float = 4.0, demand_window_s: float = 0.0,
                     itl_slo_ms: float = 245.0, batch_min_requests: int = 0,
                     max_drain_step_factor: float = 0.0) -> Scheduler:
    """slo, ITL target 0.245 s, 0.1 s per step + 0.01 s per token: seconds-scale costs, so the few
    milliseconds a test takes between queuing and scheduling never move a TTFT across its target. Pacing
    to the prompt arrival rate is off unless a test is about it, and so are batch drains (its prompts all
    arrive at once) and the drain bound at a multiple of the typical decodes' step (the excursion bound
    decides)."""
    config = SchedulerConfig(256, 32, policy="slo", aging_seconds=0.0, itl_slo_ms=itl_slo_ms,
                             ttft_target_ms=ttft_target_ms, max_itl_excursion=max_itl_excursion,
                             prefill_demand_window_s=demand_window_s, batch_min_requests=batch_min_requests,
                             max_drain_step_factor=max_drain_step_factor)
    return Scheduler(config, BlockManager(512, 4), 4096, frozenset({2}), fixed_cost_model(0.1, 0.01))


def with_two_decodes(scheduler: Scheduler) -> list[Sequence]:
    """Two requests mid-stream: their decodes alone take 0.12 s, so a step within the 0.245 s target holds 12
    prefill tokens (0.24 s). They arrived a second before the module started, so never in one arrival batch
    with a test's queue (on a fast machine a test can start within the batch window of the module's start)."""
    decoders = [sequence(4, arrival=-1.0, max_tokens=500) for _ in range(2)]
    for seq in decoders:
        scheduler.add(seq)
    assert step(scheduler).budget.reason == "no_decodes"  # nobody was mid-stream yet
    return decoders


def queue_now(scheduler: Scheduler, count: int, length: int) -> list[Sequence]:
    now = time.monotonic()
    seqs = [sequence(length) for _ in range(count)]
    for seq in seqs:
        seq.arrival_time = now
        scheduler.add(seq)
    return seqs


def test_slo_policy_drains_a_backlog_at_the_excursion_bound_until_half_the_targets_are_spare() -> None:
    """20 queued prompts of 40 tokens, TTFT target 10 s. Capped (12 tokens per 0.24 s step, and each prompt
    once prefilled adds its 0.01 s decode to every later step) only the 10 first are on time: a backlog. At
    4x the target (0.98 s, 86 tokens) the last is still late (10 steps and 0.93 s of the others' decodes), and
    no smaller chunk gets more of them on time: the step takes the bound, where 19 of the 20 are on time."""
    scheduler = budget_scheduler(ttft_target_ms=10_000)
    decoders = with_two_decodes(scheduler)
    queue_now(scheduler, 20, 40)
    output = step(scheduler)
    budget = output.budget
    assert budget.reason == "backlog"
    assert (budget.itl_target_ms, budget.step_target_ms) == (pytest.approx(245.0), pytest.approx(980.0))
    assert (budget.prefill_tokens, budget.ttft_met_capped, budget.ttft_met, budget.itl_cost) == (86, 10, 19, 2)
    assert output.num_batched_tokens == 2 + 86
    assert [seq.itl_excursions for seq in decoders] == [1, 1]
    # The next step also decodes the two prompts finished in this one: only those lose their ITL target now.
    second = step(scheduler)
    assert sum(s.is_decode for s in second.scheduled) == 4
    assert (second.budget.reason, second.budget.itl_cost) == ("backlog", 2)
    # Abort all but 5 waiting prompts (about 200 tokens with the one prefilling): at the cap (now beside the
    # decodes of the prompts done) they would be on time, but not with half of their 10 s target to spare:
    # the drain goes on.
    for seq in list(scheduler.waiting)[5:]:
        scheduler.abort(seq.seq_id)
    third = step(scheduler)
    assert (third.budget.reason, third.budget.ttft_met_capped) == ("backlog", third.budget.queued)
    # One waiting prompt left, and the rest of the one prefilling (76 tokens, 3.7 s at the cap of 5 tokens beside
    # nine decodes): half the target to spare, the drain ends.
    for seq in list(scheduler.waiting)[1:]:
        scheduler.abort(seq.seq_id)
    budget = step(scheduler).budget
    assert budget.reason == "itl_cap" and budget.queued >= 2 and not scheduler.slo.draining


def test_a_drain_excursion_is_bounded_at_a_multiple_of_the_typical_decodes_step_but_keeping_pace_is_not() -> None:
    """The queue of the test above (20 prompts of 40 tokens, 10 s target, excursion bound 0.98 s) with the drain's
    excursion bounded at 2.5 x the typical decodes' own step: the two decodes alone take 0.12 s, so the drain's
    step is 0.3 s, 18 prompt tokens, not 0.98 s. Keeping pace with the arrivals is not bounded by it: when the
    prompts arrive faster than even whole-budget steps prefill (an overload: 808 tokens within the quarter second
    the 1 s window's rate is measured over at least, 3,232 tokens/s against the 95 a whole-budget step computes),
    the drain keeps pace with the arrivals (the whole budget) unless a smaller chunk gets more first tokens on
    time, and 87 tokens, 0.99 s, the smallest on the search's grid to get 19 of 20 out in time, does."""
    scheduler = budget_scheduler(ttft_target_ms=10_000, max_drain_step_factor=2.5)
    with_two_decodes(scheduler)
    queue_now(scheduler, 20, 40)
    budget = step(scheduler).budget
    assert (budget.reason, budget.step_target_ms, budget.prefill_tokens) == ("backlog", pytest.approx(300.0), 18)
    assert budget.typical_decodes == pytest.approx(2.0) and budget.drain_bound_ms == pytest.approx(300.0)

    overloaded = budget_scheduler(ttft_target_ms=10_000, max_drain_step_factor=2.5, demand_window_s=1.0)
    with_two_decodes(overloaded)
    queue_now(overloaded, 20, 40)
    output = step(overloaded)
    assert output.budget.reason == "backlog" and output.budget.demand_tokens_per_s > 1000
    assert (output.budget.step_target_ms, output.budget.prefill_tokens) == (pytest.approx(990.0), 87)
    assert output.budget.ttft_met == 19
    assert output.budget.drain_bound_ms == pytest.approx(2660.0)  # the whole budget: 0.1 s + 256 x 0.01 s
    with pytest.raises(ValueError, match="max_drain_step_factor"):
        SchedulerConfig(policy="slo", max_drain_step_factor=0.5)


def test_slo_policy_keeps_the_cap_while_the_queue_is_on_time() -> None:
    """One queued 300-token prompt (steady traffic) with an 8 s TTFT target: capped it is done in 6 s, so the
    step stays capped, and the decodes keep their gaps. With a 5.7 s target the cap would get it out late: the
    drain starts now, with a step just past the cap (14 tokens, 300 / 14 x 0.26 s = 5.57 s) rather than later
    with a jump."""
    scheduler = budget_scheduler(ttft_target_ms=8_000)
    decoders = with_two_decodes(scheduler)
    queue_now(scheduler, 1, 300)
    output = step(scheduler)
    assert output.budget.reason == "itl_cap" and output.budget.ttft_met_capped == 1
    assert output.num_batched_tokens == 2 + 12
    assert [seq.itl_excursions for seq in decoders] == [0, 0]
    early = budget_scheduler(ttft_target_ms=5_700)
    with_two_decodes(early)
    queue_now(early, 1, 300)
    budget = step(early).budget
    assert (budget.reason, budget.ttft_met_capped, budget.prefill_tokens) == ("backlog", 0, 14)


@pytest.mark.parametrize(("prompt", "chunk"), [(202, 9), (602, 12)])
def test_slo_cap_keeps_pace_with_the_prompt_tokens_arriving(prompt: int, chunk: int) -> None:
    """ITL target 0.15 s: a capped step holds 3 prefill tokens (0.12 + 0.03 s), 20 tokens/s. 210 prompt tokens
    arrived just now, at the start of a busy spell: over a quarter of the 40 s window, 21 tokens/s, 42 with
    the 2x headroom. The one queued prompt is on time at the cap, but the cap is slower than the arrivals, so
    it widens to the smallest chunk that keeps pace: b >= 42 (0.12 + 0.01 b), 9 tokens. With 610 tokens (122
    tokens/s with the headroom) no chunk keeps pace (each token takes 0.01 s); pacing stops at 2 times the
    decodes' own step, 0.24 s and 12 tokens, and the queue waits within its 40 s target."""
    scheduler = budget_scheduler(ttft_target_ms=40_000, demand_window_s=40.0, itl_slo_ms=150.0)
    decoders = with_two_decodes(scheduler)  # 2 x 4 prompt tokens
    queue_now(scheduler, 1, prompt)
    output = step(scheduler)
    budget = output.budget
    assert (budget.reason, budget.prefill_tokens, budget.ttft_met_capped) == ("paced", chunk, 1)
    assert budget.demand_tokens_per_s == pytest.approx((prompt + 8) / 10.0)
    assert budget.typical_decodes == 2 and budget.paced_step_ms == pytest.approx(min(120.0 + 10.0 * chunk, 240.0))
    assert budget.step_target_ms == pytest.approx(120.0 + 10.0 * chunk)
    assert budget.itl_target_ms == pytest.approx(150.0)
    assert output.num_batched_tokens == 2 + chunk
    assert [seq.itl_excursions for seq in decoders] == [0, 0]
    # Without pacing the same queue stays at the ITL cap.
    unpaced = budget_scheduler(ttft_target_ms=40_000, itl_slo_ms=150.0)
    with_two_decodes(unpaced)
    queue_now(unpaced, 1, prompt)
    unpaced_budget = step(unpaced).budget
    assert (unpaced_budget.reason, unpaced_budget.prefill_tokens) == ("itl_cap", 3)


def test_paced_steps_take_one_duration_whatever_their_width() -> None:
    """Pacing sizes a step duration at the typical decodes, not a chunk per step. Typical here are 2.5
    decodes (0.125 s alone); the 602-token arrivals pace at 2 times that, 0.25 s. A step of one decode
    then takes a bigger chunk than a step of two, one of four a smaller, and all three steps take the same
    0.25 s to the nearest token (0.01 s; sized at 2 times their own decodes, they would take 0.22, 0.24
    and 0.28 s)."""
    model = fixed_cost_model(0.1, 0.01)
    chunks = []
    for width in (1, 2, 4):
        scheduler = budget_scheduler(ttft_target_ms=40_000, demand_window_s=40.0, itl_slo_ms=150.0)
        for _ in range(width):
            scheduler.add(sequence(4, max_tokens=500))
        assert step(scheduler).budget.reason == "no_decodes"
        scheduler.slo.typical_decodes.observe(StepShape(2.5, 2.5, 0.0), time.monotonic())
        queue_now(scheduler, 1, 602 - 4 * width)
        output = step(scheduler)
        assert output.budget.reason == "paced"
        assert 0.245 <= model.predict(shape_of(output.scheduled)) <= 0.26
        chunks.append(output.budget.prefill_tokens)
    assert chunks[0] > chunks[1] > chunks[2]


def test_typical_decodes_average_recent_steps_by_time() -> None:
    typical = TypicalDecodes(time_constant_seconds=1.0)
    assert typical.shape is None
    assert typical.observe(StepShape(2, 2, 600.0), now=10.0) == StepShape(2, 2, 600.0)  # the first is typical
    shape = typical.observe(StepShape(6, 6, 1800.0), now=10.0 + math.log(4 / 3))  # a quarter of the way
    assert (shape.num_tokens, shape.num_sequences, shape.attention_pairs) == pytest.approx((3.0, 3.0, 900.0))
    for step_index in range(1, 11):  # ten steps in 10 ms hardly move it
        shape = typical.observe(StepShape(40, 40, 12000.0), now=10.3 + step_index / 1000)
    assert shape.num_sequences < 4.5
    shape = typical.observe(StepShape(1, 1, 300.0), now=30.0)  # after an idle spell the new traffic is typical
    assert shape.num_sequences == pytest.approx(1.0)


def test_an_idle_engine_forgets_the_typical_decodes() -> None:
    """Eight decodes were typical; every request finished, and then one request arrives. Its first step with
    a decode is paced at one decode's width, not at what is left of the eight (weighted by time alone, a
    second of idleness keeps 82 % of them)."""
    scheduler = budget_scheduler(ttft_target_ms=40_000)
    for seq in [sequence(4, max_tokens=2) for _ in range(8)]:
        scheduler.add(seq)
    step(scheduler)  # their prefills
    step(scheduler)  # their decodes: eight are typical
    assert scheduler.slo.typical_decodes.shape.num_sequences == 8
    assert not scheduler.has_unfinished
    scheduler.add(sequence(4, max_tokens=50))
    step(scheduler)  # its prefill, on an idle engine
    assert step(scheduler).budget.typical_decodes == 1


def test_slo_policy_bounds_a_step_without_decodes_once_decodes_were_seen() -> None:
    """Nobody is mid-stream, but a request arriving during the step waits for all of it: once the scheduler
    has seen decodes (two, 0.12 s alone, ITL target 0.15 s), a long prompt's chunk stays within the excursion
    bound, 4 x 0.15 s = 0.6 s: 50 tokens at 0.01 s each past the step's 0.1 s."""
    scheduler = budget_scheduler(ttft_target_ms=40_000, itl_slo_ms=150.0)
    decoders = with_two_decodes(scheduler)
    assert step(scheduler).budget.reason == "itl_cap"
    for seq in decoders:
        scheduler.abort(seq.seq_id)
    scheduler.add(sequence(400))
    output = step(scheduler)
    assert output.budget.reason == "no_decodes" and output.budget.step_target_ms == pytest.approx(600.0)
    assert output.num_batched_tokens == 50
    # With excursions off there is no bound: the whole budget, as before any decode was seen.
    unbounded = budget_scheduler(ttft_target_ms=40_000, itl_slo_ms=150.0, max_itl_excursion=1.0)
    for seq in with_two_decodes(unbounded):
        unbounded.abort(seq.seq_id)
    unbounded.add(sequence(400))
    assert step(unbounded).num_batched_tokens == 256


def test_slo_policy_prefills_a_batch_at_the_whole_budget_with_nobody_mid_stream() -> None:
    """Decodes were seen, so a step without decodes is bounded (0.6 s: 50 of a 400-token prompt's tokens).
    Four 100-token prompts that arrived together are a batch: the step takes the whole budget (256 tokens,
    reason batch), as it would beside decodes. Three are not a batch and stay within the bound."""
    for count, reason, tokens in ((3, "no_decodes", 50), (4, "batch", 256)):
        scheduler = budget_scheduler(ttft_target_ms=40_000, itl_slo_ms=150.0, batch_min_requests=4)
        decoders = [sequence(4, arrival=-1.0, max_tokens=500) for _ in range(2)]  # a second before the prompts
        for seq in decoders:
            scheduler.add(seq)
        step(scheduler)
        assert step(scheduler).budget.reason == "itl_cap"  # decodes seen
        for seq in decoders:
            scheduler.abort(seq.seq_id)
        queue_now(scheduler, count, 100)
        output = step(scheduler)
        assert (output.budget.reason, output.num_batched_tokens) == (reason, tokens)
        assert (output.budget.step_target_ms is None) == (reason == "batch")


def test_a_drain_keeps_pace_with_the_arrivals_without_pacing_headroom() -> None:
    """610 prompt tokens arrived, 61 tokens/s over a quarter of the 40 s window. A request already past its
    TTFT target makes the queue a backlog that no chunk gets on time, so the drain takes its widest step, the
    longest of the excursion bound (1.5 x 0.15 s), the paced step (0.24 s: 2 times the two decodes' 0.12 s)
    and the step that keeps pace with the arrivals (61 tokens/s: 19 tokens, 0.31 s): 0.31 s. With pacing's
    2x headroom (122 tokens/s) no chunk would keep pace and the drain would take the whole budget, 2.66 s;
    with 1.25x, 39 tokens and 0.51 s: one long prompt in the window made every drain step that long. The drain
    bound (2 x the two decodes' 0.12 s, 0.24 s) bounds the excursion, not keeping pace: bounded too, an overload
    of decodes kept a served batch narrow while the queue grew."""
    scheduler = budget_scheduler(ttft_target_ms=40_000, max_itl_excursion=1.5, demand_window_s=40.0,
                                 itl_slo_ms=150.0, max_drain_step_factor=2.0)
    with_two_decodes(scheduler)
    (late,) = queue_now(scheduler, 1, 602)
    late.arrival_time -= 50.0
    budget = step(scheduler).budget
    assert budget.demand_tokens_per_s == pytest.approx(61.0)
    assert (budget.reason, budget.ttft_met) == ("backlog", 0)
    assert budget.step_target_ms == pytest.approx(310.0)


def test_slo_policy_drains_a_small_backlog_with_a_small_excursion() -> None:
    """Four queued 40-token prompts with a 3.1 s target. Capped (12 tokens per 0.24 s step) the last is done in
    14 steps, 3.36 s: late, a backlog. The excursion bound (0.98 s steps) would clear it in two steps; the
    drain takes the smallest step that gets every first token within its target instead, steps counted as a
    fraction, each prefilled prompt's 0.01 s decode added to every later step: 160 / b x (0.12 + 0.01 b) +
    0.01 x (3 x 160 - 240) / b <= 3.1 s, b = 15 tokens in 0.27 s steps. The budget's count is in whole steps
    (11 for the last, which ends a fraction of a step past its target): 3 of 4, as at the cap."""
    scheduler = budget_scheduler(ttft_target_ms=3_100)
    decoders = with_two_decodes(scheduler)
    queue_now(scheduler, 4, 40)
    output = step(scheduler)
    budget = output.budget
    assert (budget.reason, budget.ttft_met_capped, budget.ttft_met) == ("backlog", 3, 3)
    assert budget.prefill_tokens == 15 and budget.step_target_ms == pytest.approx(270.0)
    assert output.num_batched_tokens == 2 + 15
    assert [seq.itl_excursions for seq in decoders] == [1, 1]


def test_requests_arriving_within_the_batch_window_are_one_batch() -> None:
    batches = ArrivalBatches()
    window = BATCH_WINDOW_SECONDS
    for seq_id, at in enumerate([10.0, 10.0 + 0.25 * window, 10.0 + 0.5 * window, 10.0 + window]):
        batches.record(seq_id, at)
    # past the window of the batch's first arrival, though close to the one before: a new batch
    batches.record(4, 10.0 + 1.1 * window)
    def size(seq_id: int) -> int:  # the largest batch it counts as in (1: alone, or not known)
        return max((least for least in range(2, 10) if batches.is_batch(seq_id, least)), default=1)

    assert [size(seq_id) for seq_id in range(5)] == [4, 4, 4, 4, 1]
    batches.forget(0)
    assert size(0) == 1 and size(1) == 4  # the others keep their batch
    assert size(99) == 1


def test_slo_policy_prefills_a_batch_that_arrived_together_at_the_whole_budget() -> None:
    """Four 40-token prompts arrive together beside two decodes, TTFT target 40 s: at the cap (12 tokens a
    0.24 s step) every first token is on time, so three such prompts stay capped. Four are a batch, done
    when its last request is: the step takes the whole budget, as fcfs would, all 160 tokens in one 1.72 s
    step, and the decodes take the gap."""
    for count, reason, prefill in ((3, "itl_cap", 12), (4, "batch", 160)):
        scheduler = budget_scheduler(ttft_target_ms=40_000, batch_min_requests=4)
        decoders = with_two_decodes(scheduler)
        queue_now(scheduler, count, 40)
        output = step(scheduler)
        assert (output.budget.reason, output.num_batched_tokens) == (reason, 2 + prefill)
        assert [seq.itl_excursions for seq in decoders] == [int(reason == "batch")] * 2
    assert output.budget.prefill_tokens == 256 - 2
    assert output.budget.step_target_ms == pytest.approx(1000.0 * (0.1 + 0.01 * 256))
    # Off (0), the same batch is capped.
    scheduler = budget_scheduler(ttft_target_ms=40_000)
    with_two_decodes(scheduler)
    queue_now(scheduler, 4, 40)
    assert step(scheduler).budget.reason == "itl_cap"
    # After 10 s of ~4 req/s (gone since), four together are a cluster such traffic brings by chance: capped.
    scheduler = budget_scheduler(ttft_target_ms=40_000, batch_min_requests=4)
    with_two_decodes(scheduler)
    now = time.monotonic()  # arrival stamps alone decide what a batch is: the test's own timing never matters
    for n in range(41):
        seq = sequence(40)
        seq.arrival_time = now - 11.0 + n / 4.0
        scheduler.add(seq)
        scheduler.abort(seq.seq_id)
    for _ in range(4):
        seq = sequence(40)
        seq.arrival_time = now
        scheduler.add(seq)
    assert step(scheduler).budget.reason == "itl_cap"


def follow_a_hot_prefix(scheduler: Scheduler) -> Sequence:
    """Two decodes mid-stream, a 40-token prompt computed (its 10 full blocks now cached), then queued: a
    prompt of those 40 tokens and an 8-token suffix of its own."""
    with_two_decodes(scheduler)
    (first,) = queue_now(scheduler, 1, 40)
    while first.num_computed_tokens < first.num_prompt_tokens:
        step(scheduler)
    follower = Sequence([*first.prompt_token_ids, *range(900, 908)], SamplingParams(max_tokens=5, ignore_eos=True))
    scheduler.add(follower)
    return follower


def test_auto_ttft_target_leaves_out_the_prefix_cache_hit() -> None:
    """A prompt behind a hot 40-token prefix computes only its 8-token suffix: its auto target is 10 x the
    suffix's prefill (0.1 + 0.08 s), not the whole prompt's (0.1 + 0.48 s), and the queue counts 8 tokens."""
    scheduler = budget_scheduler(ttft_target_ms="auto")  # type: ignore[arg-type]
    follower = follow_a_hot_prefix(scheduler)
    budget = step(scheduler).budget
    assert budget.queued == 1 and budget.ttft_target_ms == pytest.approx(1800.0)
    assert budget.prefill_tokens >= 8 and follower.num_cached_tokens == 40


def attention_cost_model() -> StepCostModel:
    """0.1 s per step, 1 ms per token, 2 ms per thousand attention pairs: a token at position 500 costs twice
    one at position 0."""
    model = StepCostModel()
    model.weights = np.array([0.1, 0.001, 0.0, 0.002])
    return model


def test_auto_ttft_target_prices_the_suffix_where_it_starts() -> None:
    """Behind a hot 40-token prefix the 8-token suffix attends to the prefix: its target is 10 x its prefill at
    positions 40-47 (8 x 44.5 pairs), dearer than the same 8 tokens at position 0 (8 x 4.5 pairs)."""
    scheduler = budget_scheduler(ttft_target_ms="auto")  # type: ignore[arg-type]
    scheduler.slo.cost_model = model = attention_cost_model()
    follow_a_hot_prefix(scheduler)
    budget = step(scheduler).budget
    at_suffix = 10 * model.predict(StepShape().plus(8, 40))
    assert budget.ttft_target_ms == pytest.approx(1000 * at_suffix)
    assert at_suffix > 10 * model.predict(StepShape().plus(8, 0)) + 0.006  # 8 x 40 pairs x 2 us x 10


def test_queue_is_priced_where_its_tokens_start() -> None:
    """Suffixes behind a hot 512-token prefix: a token costs 2 ms there, 1 ms at position 0. Priced at 0 the
    cap would hold twice the tokens it can, and the queue would look on time when it is not."""
    model = attention_cost_model()
    decodes = StepShape().plus(1, 600).plus(1, 600)  # 0.1044 s alone
    shared = [QueuedPrefill(64, 0.0, 10.0, start_position=512) for _ in range(2)]
    fresh = [QueuedPrefill(64, 0.0, 10.0) for _ in range(2)]
    assert queued_start(shared) == 512 and queued_start(fresh) == 0
    assert queued_start([QueuedPrefill(300, 0.0, 10.0, 600), QueuedPrefill(100, 0.0, 10.0)]) == 450

    def cap(queue: list[QueuedPrefill]) -> int | None:
        return choose_budget(model, decodes, 256, 0.2, queue, fresh_decodes=2, max_excursion=4.0).prefill_tokens

    assert cap(fresh) == 87  # 0.1044 + 87 x (1 ms + 44 pairs x 2 us) <= 0.2 s
    assert cap(shared) == 46  # each of them also attends to the 512 cached tokens


def test_prefill_demand_knows_where_its_tokens_start() -> None:
    """Pacing prices the arriving tokens where they start: behind the prefix-cache hit, weighted by count."""
    demand = PrefillDemand(window_seconds=10.0)
    assert demand.start_position() == 0
    demand.record(1, 100, now=0.0)  # 100 tokens from 0
    demand.record(2, 612, now=0.0, num_cached=512)  # 100 tokens from 512
    demand.rate(now=1.0)
    assert demand.start_position() == 256
    demand.discount(2, num_cached=562)  # 50 tokens from 562
    assert demand.start_position() == round(50 * 562 / 150)
    demand.rate(now=20.0)  # both out of the window
    assert demand.start_position() == 0


def test_prefill_demand_counts_uncached_tokens_within_its_window() -> None:
    demand = PrefillDemand(window_seconds=10.0)
    demand.record(1, 300, now=100.0)
    assert demand.rate(now=100.5) == pytest.approx(300 / 2.5)  # a busy spell's start: over a quarter window
    demand.record(2, 200, now=105.0)
    assert demand.rate(now=106.0) == pytest.approx(500 / 6.0)  # over the time since the oldest arrival
    demand.discount(2, num_cached=150)  # the prefix cache held 150 of its tokens
    demand.discount(2, num_cached=150)  # counted once
    assert demand.rate(now=110.0) == pytest.approx(350 / 10.0)
    assert demand.rate(now=112.0) == pytest.approx(50 / 7.0)  # the first arrival left the window
    assert demand.rate(now=200.0) == 0.0
    # A prompt behind a hot 512-token prefix counts its suffix from its arrival; admitted with the same hit
    # nothing changes, with one more block cached (528) that block is left out too.
    demand.record(3, 600, now=150.0, num_cached=512)
    assert demand.rate(now=160.0) == pytest.approx(88 / 10.0)
    demand.record(4, 600, now=150.0, num_cached=512)
    demand.discount(3, num_cached=512)
    demand.discount(4, num_cached=528)
    assert demand.rate(now=160.0) == pytest.approx((88 + 72) / 10.0)
    for seq_id in range(2 * MAX_TRACKED_ARRIVALS):  # bounded whatever the arrival rate
        demand.record(seq_id, 1, now=300.0)
    assert demand.rate(now=310.0) == pytest.approx(MAX_TRACKED_ARRIVALS / 10.0)


def test_paced_chunk_is_the_smallest_that_keeps_pace() -> None:
    model = fixed_cost_model(0.1, 0.01)
    decodes = StepShape().plus(1, 10).plus(1, 10)  # 0.12 s alone
    assert paced_chunk(model, decodes, 256, 20.0) == 3  # 3 >= 20 x 0.15
    assert paced_chunk(model, decodes, 256, 0.0) == 0
    assert paced_chunk(model, decodes, 256, 100.0) == 256  # nothing keeps pace: the whole budget


def test_slo_policy_drains_for_a_request_already_past_its_ttft() -> None:
    """A 4-token prompt queued 12 s ago, past its 10 s target: late whatever the budget, so the step drains."""
    scheduler = budget_scheduler(ttft_target_ms=10_000)
    with_two_decodes(scheduler)
    for seq in queue_now(scheduler, 1, 4):
        seq.arrival_time -= 12.0
    budget = step(scheduler).budget
    assert (budget.reason, budget.ttft_met_capped, budget.ttft_met) == ("backlog", 0, 0)


def test_the_scheduler_reads_the_time_from_its_clock() -> None:
    """On a virtual clock (benchmarks/policy_replay.py steps the scheduler on one) a request's wait is the
    clock's: a 40-token prompt is on time when queued and late once the clock has moved 12 s, past its 10 s
    target, with no wall-clock time passing."""
    now = [1000.0]
    config = SchedulerConfig(256, 32, policy="slo", aging_seconds=0.0, itl_slo_ms=245.0, ttft_target_ms=10_000,
                             max_itl_excursion=4.0, prefill_demand_window_s=0.0)
    scheduler = Scheduler(config, BlockManager(512, 4), 4096, frozenset({2}), fixed_cost_model(0.1, 0.01),
                          clock=lambda: now[0])
    decoders = [Sequence(list(range(10 * n + 100, 10 * n + 104)), SamplingParams(max_tokens=500, ignore_eos=True),
                         arrival_time=now[0]) for n in range(2)]
    for seq in decoders:
        scheduler.add(seq)
    step(scheduler)
    scheduler.add(Sequence(list(range(200, 240)), SamplingParams(max_tokens=5, ignore_eos=True),
                           arrival_time=now[0]))
    assert step(scheduler).budget.reason == "itl_cap"  # 12 of its 40 tokens: on time at the cap
    now[0] += 12.0
    budget = step(scheduler).budget
    assert (budget.reason, budget.queued, budget.ttft_met) == ("backlog", 1, 0)


def test_decode_growth_is_what_each_request_adds_to_a_step_once_prefilled() -> None:
    """A decode adds a token and a sequence attending to its prompt; priced from three predictions, it must
    equal pricing each request's decode on its own."""
    model = StepCostModel()
    for i in range(20):
        model.observe(StepShape(i + 1, i % 3 + 1, 100.0 * i), 0.01 + 0.001 * i)
    queue = [QueuedPrefill(150 + 7 * i, 0.0, 2.5, 3 * i) for i in range(5)]
    alone = [model.predict(StepShape().plus(1, item.start_position + item.remaining_tokens))
             - model.predict(StepShape()) for item in queue]
    assert decode_growth(model, queue) == pytest.approx(alone)
    assert len(set(alone)) == len(alone)  # longer prompts cost more: the attention term is in the fit


def test_ttft_met_counts_the_requests_predicted_within_their_target() -> None:
    queue = [QueuedPrefill(100, waited_seconds=0.5, ttft_target=1.0), QueuedPrefill(100, 0.2, ttft_target=1.0)]
    # With 100 tokens per 0.4 s step the first is done at 0.9 s, the second at 1.0 s: both in time. With
    # 0.5 s steps at 1.0 s and 1.2 s: one. One already past its target is never met.
    assert QueueForecast(queue).met(100, 0.4) == 2
    assert QueueForecast(queue).met(100, 0.5) == 1
    assert QueueForecast([QueuedPrefill(1, 1.5, ttft_target=1.0)]).met(100, 0.01) == 0


def test_queue_forecast_counts_the_decodes_of_the_requests_already_prefilled() -> None:
    """100 tokens per 0.4 s step; once prefilled, each request's decode adds its cost to every later step.
    The first is out after one step; the second after two, the first's 0.01 s decode in the second; the third
    in the same second step (the second's decode starts after it). Counted as fractions of a step, the second
    needs 1.5 steps, and its decode runs for the half step left before the third's 2."""
    queue = [QueuedPrefill(100, 0.0, 1.0), QueuedPrefill(50, 0.0, 1.0), QueuedPrefill(50, 0.0, 1.0)]
    forecast = QueueForecast(queue, [0.01, 0.02, 0.03])
    assert forecast.first_token_seconds(100, 0.4) == pytest.approx([0.4, 0.81, 0.81])
    assert forecast.first_token_seconds(100, 0.4, whole_steps=False) == pytest.approx([0.4, 0.605, 0.82])
    assert forecast.met(100, 0.4, share=0.8) == 1 and forecast.met(0, 0.4) == 0
    assert QueueForecast([]).met(100, 0.4) == 0
    with pytest.raises(ValueError, match="2 decode costs for a queue of 3"):
        QueueForecast(queue, [0.01, 0.02])


def test_slo_policy_never_widens_with_an_excursion_bound_of_one() -> None:
    scheduler = budget_scheduler(ttft_target_ms=10_000, max_itl_excursion=1.0)
    with_two_decodes(scheduler)
    queue_now(scheduler, 20, 40)
    output = step(scheduler)
    assert output.budget.reason == "itl_cap" and output.num_batched_tokens == 2 + 12
    assert not scheduler.slo.draining


def test_step_records_show_the_budget_decision() -> None:
    scheduler = budget_scheduler(ttft_target_ms=10_000)
    with_two_decodes(scheduler)
    queue_now(scheduler, 20, 40)
    output = step(scheduler)
    record = asdict(StepRecord.of(output, RunnerOutput(), started=0.0, duration=0.9, predicted=0.98, gc_pause=0.0))
    assert record["budget"]["reason"] == "backlog" and record["budget"]["prefill_tokens"] == 86
    assert (record["predicted_duration"], record["duration"]) == (0.98, 0.9)


def test_scheduler_config_checks_the_goodput_options() -> None:
    with pytest.raises(ValueError, match="ttft_target_ms"):
        SchedulerConfig(policy="slo", ttft_target_ms="soon")
    with pytest.raises(ValueError, match="max_itl_excursion"):
        SchedulerConfig(policy="slo", max_itl_excursion=0.5)
    with pytest.raises(ValueError, match="prefill_demand_window_s"):
        SchedulerConfig(policy="slo", prefill_demand_window_s=-1.0)
    with pytest.raises(ValueError, match="batch_min_requests"):
        SchedulerConfig(policy="slo", batch_min_requests=-1)


def test_auto_ttft_target_follows_the_prompt_length() -> None:
    """auto: a factor (here 3) x the prompt's predicted prefill alone; 0.1 s + 0.01 s per token."""
    model = fixed_cost_model(0.1, 0.01)
    assert auto_ttft_seconds(model, 100, 3.0) == pytest.approx(3.3)
    assert auto_ttft_seconds(model, 400, 3.0) == pytest.approx(12.3)


def test_a_drain_that_gets_no_queue_on_time_keeps_the_chunk_that_gets_most_on_time() -> None:
    """A long prompt's last 479 tokens (17 s target, 5 s waited) ahead of a 100-token prompt with a 1.9 s
    target, steps of 10 ms + 1.9 ms per token. At 8 tokens per step both are on time (1.51 s; 73 steps,
    1.84 s), the whole 511-token budget gets the long prompt out in one 0.98 s step and the short one in two,
    1.96 s: late. The drain keeps the small chunk. With every request already late nothing is gained by a
    small chunk, and the drain keeps its widest step, as fcfs."""
    def step_of(tokens: int) -> float:
        return 0.010 + 0.0019 * tokens

    queue = [QueuedPrefill(479, waited_seconds=5.0, ttft_target=17.0), QueuedPrefill(100, 0.0, ttft_target=1.9)]
    forecast = QueueForecast(queue)
    assert (forecast.met(8, step_of(8)), forecast.met(511, step_of(511))) == (2, 1)
    assert most_on_time(forecast, 8, 511, step_of) == 8
    late = [QueuedPrefill(479, waited_seconds=20.0, ttft_target=17.0), QueuedPrefill(100, 3.0, ttft_target=1.9)]
    assert most_on_time(QueueForecast(late), 8, 511, step_of) == 511
    # Given a default (the drain's moderate step), a tie keeps it: the widest step saves nobody.
    assert most_on_time(QueueForecast(late), 8, 511, step_of, default=40) == 40
    # A chunk that gets more on time than the default wins, the smallest such on the search's grid (1, 2, 3, 4,
    # 5, 7, 9, ...): one token a step gets the short prompt out after 6.9 s, 7 after 1.93 s, 9 after 1.76 s.
    assert most_on_time(forecast, 1, 511, step_of, default=1) == 9


def test_a_drain_that_saves_nobody_stays_near_the_capped_step() -> None:
    """A 200-token prompt queued 12 s ago, past its 10 s target: late whatever the step. The excursion bound
    (10 x the 0.245 s ITL target: 2.45 s, 233 tokens) would get it out in one step and make the two decodes wait
    for all of it. Nothing is saved by that, so the drain takes FUTILE_DRAIN_FACTOR (1.5) x the capped step:
    0.3675 s, 24 tokens (0.12 s of decodes + 0.01 s a token: 0.36 s)."""
    scheduler = budget_scheduler(ttft_target_ms=10_000, max_itl_excursion=10.0)
    with_two_decodes(scheduler)
    (late,) = queue_now(scheduler, 1, 200)
    late.arrival_time -= 12.0
    budget = step(scheduler).budget
    assert (budget.reason, budget.ttft_met_capped, budget.ttft_met) == ("backlog", 0, 0)
    assert FUTILE_DRAIN_FACTOR == 1.5
    assert budget.prefill_tokens == 24 and budget.step_target_ms == pytest.approx(360.0)


def test_a_cluster_that_heavy_traffic_brings_by_chance_is_not_a_batch() -> None:
    """After light traffic four requests within the batch window are a batch. After 10 s of 4 req/s, which
    brings four within 0.1 s about once in 130 requests, five are not: a batch takes six."""

    def cluster_after(rate: float, size: int) -> ArrivalBatches:
        batches = ArrivalBatches()
        for n in range(round(10 * rate)):
            batches.record(1000 + n, n / rate)  # evenly spread: no cluster among them
        for seq_id in range(size):
            batches.record(seq_id, 10.0 + 0.1 * BATCH_WINDOW_SECONDS * seq_id)
        return batches

    assert poisson_quantile(0.4, CHANCE_CLUSTER_SHARE) == 5  # P(N >= 5) < 1e-4 for N ~ Poisson(4 req/s x 0.1 s)
    assert poisson_quantile(1000.0, CHANCE_CLUSTER_SHARE) > 1000  # exp(-1000) underflows: the normal bound
    assert cluster_after(0.2, 4).is_batch(0, 4)
    assert not cluster_after(4.0, 5).is_batch(0, 4)
    batches = cluster_after(4.0, 6)
    assert batches.is_batch(5, 4) and not batches.is_batch(1000, 4) and not batches.is_batch(5, 7)
    assert not batches.is_batch(5, 0)  # 0: batches off
