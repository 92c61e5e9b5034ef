"""Priority, aging, displacement at the sequence cap and SLO-capped chunks, with a fixed cost model."""

from __future__ import annotations

import itertools
import time

import numpy as np

from titan.config import SchedulerConfig
from titan.engine.block_manager import BlockManager
from titan.engine.cost_model import StepCostModel, StepShape
from titan.engine.sampling_params import SamplingParams
from titan.engine.scheduler import Scheduler
from titan.engine.scheduler_output import RunnerOutput, SchedulerOutput
from titan.engine.sequence import Sequence, SequenceStatus


def fixed_cost_model(per_step: float, per_token: float, per_sequence: float = 0.0) -> StepCostModel:
    model = StepCostModel()
    model.weights = np.array([per_step, per_token, per_sequence, 0.0])
    return model


def make(policy: str = "priority", budget: int = 64, max_seqs: int = 8, num_blocks: int = 64,
         itl_slo_ms: float | None = None, cost_model: StepCostModel | None = None, aging: float = 0.0) -> Scheduler:
    """Aging is off unless a test is about it: it depends on the wall clock."""
    config = SchedulerConfig(budget, max_seqs, policy=policy, itl_slo_ms=itl_slo_ms, aging_seconds=aging)
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
    """auto (the slo default): twice the step's decodes alone. 10 ms per step + 0.5 ms per token: with 3
    decodes that is 2 x 11.5 = 23 ms, room for 23 prefill tokens; with 6 decodes 2 x 13 = 26 ms, 26 tokens."""
    for num_decoders, expected in ((3, 23), (6, 26)):
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


def test_slo_policy_still_progresses_prefills_when_the_target_is_unreachable() -> None:
    scheduler = make(policy="slo", budget=256, itl_slo_ms=5.0, cost_model=fixed_cost_model(0.010, 0.001))
    decoder = sequence(4)
    scheduler.add(decoder)
    step(scheduler)
    long_prompt = sequence(40)
    other = sequence(40)
    scheduler.add(long_prompt)
    scheduler.add(other)
    output = step(scheduler)
    # The decode, then min_prefill_chunk of one prefill only.
    assert [s.num_new_tokens for s in output.scheduled] == [1, 16]


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
    short = sequence(20, arrival=2.0)  # arrives later, but has less left to compute
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
        long_batch, long_interactive, short = (sequence(150, priority=1, arrival=1.0), sequence(150, arrival=2.0),
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
        else:  # slo: within a priority level, the fewest tokens left first (86 left > 30)
            assert ahead == [short]


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
