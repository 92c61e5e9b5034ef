"""Commit integrity with no model: the prefix cache only ever publishes blocks whose K/V a step wrote.

Each test sets up a step that allocates blocks and then drops the sequence before the runner writes
them (displaced in the same step, a victim picked while allocating, a failed step); a later request
extending that prompt must not "hit" those blocks. The fake runner of test_scheduler.py asserts that
every sequence reads back exactly its own history, so a hit on unwritten KV fails loudly.
"""

from __future__ import annotations

import itertools
import random

from test_scheduler import FakeRunner, reference_outputs, run_all

from titan.config import SchedulerConfig
from titan.engine.block_manager import BlockManager
from titan.engine.sampling_params import SamplingParams
from titan.engine.scheduler import Scheduler
from titan.engine.sequence import Sequence


def make(policy: str = "fcfs", num_blocks: int = 64, budget: int = 16,
         max_seqs: int = 8) -> tuple[Scheduler, FakeRunner]:
    scheduler = Scheduler(SchedulerConfig(budget, max_seqs, policy=policy, aging_seconds=0.0),
                          BlockManager(num_blocks, 4), 512, frozenset({2}))
    return scheduler, FakeRunner(num_blocks, 4)


def params(max_tokens: int = 4) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True)


def registered_hashes(scheduler: Scheduler) -> set[int]:
    return set(scheduler.block_manager.hash_to_block)


def check_extension_matches_reference(scheduler: Scheduler, runner: FakeRunner, prompt: list[int],
                                      max_cached: int) -> Sequence:
    """A request extending `prompt` hits at most `max_cached` tokens and generates the reference tokens."""
    extended = prompt + [900 + i for i in range(9)]
    seq = Sequence(extended, params(6))
    scheduler.add(seq)
    run_all(scheduler, runner)
    assert seq.num_cached_tokens <= max_cached
    assert seq.output_token_ids == reference_outputs([extended], 6)[0]
    return seq


def test_a_sequence_displaced_in_the_step_that_allocated_its_chunk_publishes_nothing_new() -> None:
    scheduler, runner = make(policy="priority", max_seqs=1)
    long_prompt = list(range(100, 120))
    batch = Sequence(long_prompt, params(), priority=1)
    scheduler.add(batch)
    first = scheduler.schedule()  # 16 of its 20 tokens
    scheduler.commit(first, runner.execute(first))
    assert batch.num_computed_tokens == 16 and len(registered_hashes(scheduler)) == 4
    interactive = Sequence(list(range(300, 306)), params(), priority=0)
    scheduler.add(interactive)
    second = scheduler.schedule()  # the batch's last 4 tokens are allocated first, then displaced at the cap
    assert second.preempted_seq_ids == [batch.seq_id]
    assert [s.seq_id for s in second.scheduled] == [interactive.seq_id]
    scheduler.commit(second, runner.execute(second))
    assert len(registered_hashes(scheduler)) == 4 + 1  # the interactive prompt's one full block
    scheduler.abort(batch.seq_id)
    run_all(scheduler, runner)
    check_extension_matches_reference(scheduler, runner, long_prompt, max_cached=16)


def test_a_victim_picked_while_allocating_publishes_nothing_new() -> None:
    scheduler, runner = make(policy="priority", num_blocks=8)
    batch = Sequence(list(range(200, 206)), params(), priority=1)
    scheduler.add(batch)
    first = scheduler.schedule()  # positions 0-5: two blocks, the second half full
    scheduler.commit(first, runner.execute(first))
    interactive = Sequence(list(range(300, 328)), params(), priority=0)
    scheduler.add(interactive)
    second = scheduler.schedule()  # batch decodes position 6; interactive prefills 15 tokens (4 blocks)
    scheduler.commit(second, runner.execute(second))
    assert interactive.num_computed_tokens == 15
    third = scheduler.schedule()
    # Batch's decode of position 7 (completing its second block) was scheduled first; then interactive's
    # next chunk needed 3 blocks with 2 free, and batch, ranked last, became the victim.
    assert third.preempted_seq_ids == [batch.seq_id]
    scheduler.commit(third, runner.execute(third))
    written = batch.prompt_token_ids + batch.output_token_ids  # position 7's K/V was never written
    assert len(written) == 8
    scheduler.abort(batch.seq_id)
    run_all(scheduler, runner)
    check_extension_matches_reference(scheduler, runner, written, max_cached=4)


def test_two_requests_sharing_a_prefix_in_one_step_share_it_only_once_written() -> None:
    scheduler, runner = make(budget=64)
    shared = list(range(100, 116))
    first = Sequence(shared + [1, 3, 5], params())
    second = Sequence(shared + [7, 9], params())
    scheduler.add(first)
    scheduler.add(second)
    output = scheduler.schedule()
    # Nothing is published before the step ran, so the second cannot share blocks not yet written: it
    # waits for the first to write them rather than computing them too.
    assert [(s.seq_id, s.start_position) for s in output.scheduled] == [(first.seq_id, 0)]
    scheduler.commit(output, runner.execute(output))
    output = scheduler.schedule()
    assert (second.seq_id, 16) in [(s.seq_id, s.start_position) for s in output.scheduled]
    scheduler.commit(output, runner.execute(output))
    run_all(scheduler, runner)
    assert second.num_cached_tokens == 16
    assert first.output_token_ids == reference_outputs([first.prompt_token_ids], 4)[0]
    assert second.output_token_ids == reference_outputs([second.prompt_token_ids], 4)[0]
    later = Sequence(shared + [11], params())
    scheduler.add(later)
    run_all(scheduler, runner)
    assert later.num_cached_tokens == 16


def test_a_failed_step_publishes_nothing() -> None:
    scheduler, runner = make(budget=64)
    prompt = list(range(100, 124))
    seq = Sequence(prompt, params())
    scheduler.add(seq)
    scheduler.schedule()  # the runner raises here: no commit; the engine aborts what was in flight
    scheduler.abort(seq.seq_id)
    assert registered_hashes(scheduler) == set()
    check_extension_matches_reference(scheduler, runner, prompt, max_cached=0)


def test_random_traffic_on_a_tight_pool_never_reads_unwritten_kv() -> None:
    """Shared prefixes, mixed priorities, arrivals between steps, a pool that forces preemption and
    displacement: the fake runner checks every read, and outputs match an uncontended reference."""
    rng = random.Random(7)
    for policy, trial in itertools.product(("fcfs", "priority", "slo"), range(6)):
        scheduler, runner = make(policy=policy, num_blocks=14, budget=12, max_seqs=3)
        prefixes = [[1000 * (p + 1) + i for i in range(rng.choice((8, 12, 16)))] for p in range(3)]
        arrivals = []
        for index in range(14):
            prompt = rng.choice(prefixes)[: rng.randrange(4, 17)] + [50 + index] * rng.randrange(1, 6)
            arrivals.append(Sequence(prompt, params(rng.randrange(1, 6)), priority=rng.choice((0, 1)),
                                     arrival_time=float(index)))
        seqs = list(arrivals)
        steps = 0
        while arrivals or scheduler.has_unfinished:
            for _ in range(rng.randrange(0, 3)):
                if arrivals:
                    scheduler.add(arrivals.pop(0))
            output = scheduler.schedule()
            scheduler.commit(output, runner.execute(output))
            steps += 1
            assert steps < 2000, (policy, trial)
        expected = reference_outputs([seq.prompt_token_ids for seq in seqs], 6)
        for seq, reference in zip(seqs, expected, strict=True):
            assert seq.output_token_ids == reference[: seq.num_output_tokens], (policy, trial)
