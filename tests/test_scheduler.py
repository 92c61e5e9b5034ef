"""Scheduler tests with no model: a fake runner keeps a token-level 'KV cache' and checks that every
sequence reads back exactly its own history through its block table."""

from __future__ import annotations

import pytest

from titan.config import SchedulerConfig
from titan.engine.block_manager import BlockManager
from titan.engine.sampling_params import SamplingParams
from titan.engine.scheduler import RequestRejectedError, Scheduler
from titan.engine.scheduler_output import RunnerOutput, SchedulerOutput
from titan.engine.sequence import Sequence, SequenceStatus

EOS = 2


class FakeRunner:
    """Stores the token id in each KV slot; the 'model' output is a hash of the context it reads."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.slots: list[int | None] = [None] * (num_blocks * block_size)
        self.history: dict[int, list[int]] = {}

    def slot(self, block_table: list[int], position: int) -> int:
        return block_table[position // self.block_size] * self.block_size + position % self.block_size

    def execute(self, output: SchedulerOutput) -> RunnerOutput:
        result = RunnerOutput()
        for item in output.scheduled:
            for offset, token in enumerate(item.token_ids):
                self.slots[self.slot(item.block_table, item.start_position + offset)] = token
        for item in output.scheduled:
            context = [self.slots[self.slot(item.block_table, p)] for p in range(item.context_length)]
            expected = (item.prompt_token_ids + item.output_token_ids)[: item.context_length]
            assert context == expected, f"sequence {item.seq_id} reads a corrupted KV cache"
            if item.sample:
                result.seq_ids.append(item.seq_id)
                result.token_ids.append(10 + sum(t * (i + 1) for i, t in enumerate(context)) % 1000)
                result.logprobs.append(None)
        return result


def make_scheduler(num_blocks: int = 64, block_size: int = 4, budget: int = 32, max_seqs: int = 8,
                   max_model_len: int = 256, prefix_caching: bool = True) -> tuple[Scheduler, FakeRunner]:
    manager = BlockManager(num_blocks, block_size, prefix_caching)
    # fcfs: these tests pin the step mechanics (budget-sized chunks, arrival order), not a policy's choices.
    scheduler = Scheduler(SchedulerConfig(budget, max_seqs, policy="fcfs"), manager, max_model_len, frozenset({EOS}))
    return scheduler, FakeRunner(num_blocks, block_size)


def run_all(scheduler: Scheduler, runner: FakeRunner, max_steps: int = 10_000) -> list[SchedulerOutput]:
    steps = []
    while scheduler.has_unfinished:
        output = scheduler.schedule()
        assert output.num_batched_tokens <= scheduler.config.max_num_batched_tokens
        assert len(output.scheduled) <= scheduler.config.max_num_seqs
        assert len({s.seq_id for s in output.scheduled}) == len(output.scheduled)
        scheduler.commit(output, runner.execute(output))
        steps.append(output)
        assert len(steps) < max_steps
    return steps


def prompts(count: int, length: int = 20, shared: int = 0) -> list[list[int]]:
    common = [500 + i for i in range(shared)]
    return [common + [100 + 7 * r + i for i in range(length - shared)] for r in range(count)]


def reference_outputs(token_lists: list[list[int]], max_tokens: int) -> list[list[int]]:
    results = []
    for tokens in token_lists:
        scheduler, runner = make_scheduler(num_blocks=256, budget=512, prefix_caching=False)
        seq = Sequence(tokens, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        scheduler.add(seq)
        run_all(scheduler, runner)
        results.append(seq.output_token_ids)
    return results


def test_long_prompt_is_chunked_and_mixed_with_decodes() -> None:
    scheduler, runner = make_scheduler(budget=16)
    short = Sequence([5, 6, 7], SamplingParams(max_tokens=20, ignore_eos=True))
    scheduler.add(short)
    first = scheduler.schedule()
    scheduler.commit(first, runner.execute(first))
    long = Sequence(list(range(100, 150)), SamplingParams(max_tokens=2, ignore_eos=True))
    scheduler.add(long)
    chunks = []
    while long.num_computed_tokens < long.num_prompt_tokens:
        output = scheduler.schedule()
        ids = {s.seq_id: s for s in output.scheduled}
        assert ids[short.seq_id].num_new_tokens == 1  # the decode runs every step
        chunks.append(ids[long.seq_id].num_new_tokens)
        scheduler.commit(output, runner.execute(output))
    assert chunks == [15, 15, 15, 5]
    assert long.num_output_tokens == 1


def test_budget_and_sequence_cap_respected_and_everything_freed() -> None:
    scheduler, runner = make_scheduler(budget=24, max_seqs=3)
    seqs = [Sequence(p, SamplingParams(max_tokens=5, ignore_eos=True)) for p in prompts(7)]
    for seq in seqs:
        scheduler.add(seq)
    steps = run_all(scheduler, runner)
    assert max(len(step.scheduled) for step in steps) == 3
    assert all(seq.num_output_tokens == 5 and seq.status is SequenceStatus.FINISHED_LENGTH for seq in seqs)
    assert scheduler.block_manager.num_free_blocks == scheduler.block_manager.num_blocks
    assert all(block.ref_count == 0 for block in scheduler.block_manager.blocks)


def test_preempted_sequences_recompute_to_the_same_output() -> None:
    token_lists = prompts(6, length=14)
    expected = reference_outputs(token_lists, max_tokens=20)
    # 20 blocks of 4 tokens cannot hold 6 sequences of 34 tokens: preemption must happen.
    scheduler, runner = make_scheduler(num_blocks=20, budget=64)
    seqs = [Sequence(t, SamplingParams(max_tokens=20, ignore_eos=True), arrival_time=i)
            for i, t in enumerate(token_lists)]
    for seq in seqs:
        scheduler.add(seq)
    steps = run_all(scheduler, runner)
    preempted = [seq_id for step in steps for seq_id in step.preempted_seq_ids]
    assert preempted, "the pool was meant to be too small"
    assert scheduler.num_preemptions == len(preempted)
    assert [seq.output_token_ids for seq in seqs] == expected
    assert scheduler.block_manager.num_free_blocks == scheduler.block_manager.num_blocks


def test_victim_is_the_latest_arrival_among_running() -> None:
    scheduler, runner = make_scheduler(num_blocks=6, block_size=4, budget=64)
    seqs = [Sequence([1 + i] * 8, SamplingParams(max_tokens=8, ignore_eos=True), arrival_time=i)
            for i in range(3)]
    for seq in seqs:
        scheduler.add(seq)
    output = scheduler.schedule()  # 3 × 2 blocks = all 6 blocks
    scheduler.commit(output, runner.execute(output))
    output = scheduler.schedule()  # position 8 needs a third block for seq 0 → evict the latest
    assert output.preempted_seq_ids[0] == seqs[2].seq_id
    assert scheduler.waiting[0] is seqs[2]


def test_prefix_hits_skip_cached_tokens_and_outputs_match() -> None:
    token_lists = prompts(5, length=30, shared=16)
    expected = reference_outputs(token_lists, max_tokens=6)
    scheduler, runner = make_scheduler(budget=64)
    first = Sequence(token_lists[0], SamplingParams(max_tokens=6, ignore_eos=True))
    scheduler.add(first)
    run_all(scheduler, runner)
    rest = [Sequence(t, SamplingParams(max_tokens=6, ignore_eos=True)) for t in token_lists[1:]]
    for seq in rest:
        scheduler.add(seq)
    output = scheduler.schedule()
    assert [s.start_position for s in output.scheduled] == [16, 16, 16, 16]
    scheduler.commit(output, runner.execute(output))
    run_all(scheduler, runner)
    assert all(seq.num_cached_tokens == 16 for seq in rest)
    assert [s.output_token_ids for s in [first, *rest]] == expected
    manager = scheduler.block_manager
    assert manager.prefix_cache_hits == 4 * 16
    assert manager.num_free_blocks == manager.num_blocks


def test_abort_frees_blocks_immediately_and_ignores_late_tokens() -> None:
    scheduler, runner = make_scheduler()
    seq = Sequence(list(range(10, 30)), SamplingParams(max_tokens=50, ignore_eos=True))
    scheduler.add(seq)
    output = scheduler.schedule()
    scheduler.abort(seq.seq_id)
    assert seq.status is SequenceStatus.FINISHED_ABORTED
    assert scheduler.block_manager.num_free_blocks == scheduler.block_manager.num_blocks
    scheduler.commit(output, runner.execute(output))  # the step that was in flight
    assert seq.output_token_ids == []
    assert not scheduler.has_unfinished


def test_stop_conditions() -> None:
    scheduler, _ = make_scheduler()
    seq = Sequence([1, 2, 3], SamplingParams(max_tokens=10, min_tokens=2, stop_token_ids=[42]))
    scheduler.add(seq)
    output = scheduler.schedule()
    scheduler.commit(output, RunnerOutput([seq.seq_id], [EOS], [None]))
    assert seq.status is SequenceStatus.RUNNING  # EOS before min_tokens does not stop
    output = scheduler.schedule()
    scheduler.commit(output, RunnerOutput([seq.seq_id], [42], [None]))
    assert seq.status is SequenceStatus.FINISHED_STOPPED and seq.stop_reason == 42

    ignore = Sequence([1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True))
    scheduler.add(ignore)
    for _ in range(2):
        output = scheduler.schedule()
        scheduler.commit(output, RunnerOutput([ignore.seq_id], [EOS], [None]))
    assert ignore.status is SequenceStatus.FINISHED_LENGTH and ignore.output_token_ids == [EOS, EOS]


def test_context_limit_ends_with_length() -> None:
    scheduler, runner = make_scheduler(max_model_len=12)
    seq = Sequence(list(range(10)), SamplingParams(max_tokens=None, ignore_eos=True))
    scheduler.add(seq)
    run_all(scheduler, runner)
    assert seq.num_tokens == 12 and seq.status is SequenceStatus.FINISHED_LENGTH


def test_requests_that_can_never_fit_are_refused_at_admission() -> None:
    scheduler, _ = make_scheduler(num_blocks=8, block_size=4, max_model_len=64)
    with pytest.raises(RequestRejectedError, match="context"):
        scheduler.add(Sequence(list(range(64)), SamplingParams(max_tokens=1)))
    with pytest.raises(RequestRejectedError, match="blocks"):
        scheduler.add(Sequence(list(range(20)), SamplingParams(max_tokens=20)))
    with pytest.raises(RequestRejectedError, match="empty"):
        scheduler.add(Sequence([], SamplingParams()))
    # A prompt the whole cache cannot hold is the prompt's fault, whatever max_tokens says.
    with pytest.raises(RequestRejectedError, match="shorten the prompt") as refused:
        scheduler.add(Sequence(list(range(32)), SamplingParams(max_tokens=1)))
    assert refused.value.param == "prompt"
    assert not scheduler.has_unfinished


def test_without_max_tokens_a_cache_smaller_than_the_context_ends_with_length() -> None:
    """llama.cpp's n_ctx: with no max_tokens a request runs until the context or the whole KV cache is full,
    instead of being refused because the context (64) is more than the cache holds (8 blocks of 4)."""
    scheduler, runner = make_scheduler(num_blocks=8, block_size=4, max_model_len=64)
    seq = Sequence(list(range(10)), SamplingParams(max_tokens=None, ignore_eos=True))
    scheduler.add(seq)
    run_all(scheduler, runner)
    assert seq.num_tokens == 32 and seq.status is SequenceStatus.FINISHED_LENGTH
    assert scheduler.block_manager.num_free_blocks == 8


def test_many_concurrent_requests_with_tiny_pool_all_match_reference() -> None:
    token_lists = prompts(16, length=23, shared=8)
    expected = reference_outputs(token_lists, max_tokens=12)
    scheduler, runner = make_scheduler(num_blocks=24, block_size=4, budget=20, max_seqs=6)
    seqs = [Sequence(t, SamplingParams(max_tokens=12, ignore_eos=True)) for t in token_lists]
    for seq in seqs:
        scheduler.add(seq)
    steps = run_all(scheduler, runner)
    assert any(step.preempted_seq_ids for step in steps)
    assert scheduler.block_manager.prefix_cache_hits > 0
    assert [seq.output_token_ids for seq in seqs] == expected
    assert scheduler.block_manager.num_free_blocks == 24


def test_a_request_waits_for_shared_prefix_blocks_another_is_computing_instead_of_recomputing() -> None:
    """Two requests with one 32-token prefix, the second arriving while the first is still prefilling in
    8-token chunks: the second trails the first and hits its blocks rather than computing them again."""
    scheduler, runner = make_scheduler(budget=8, block_size=4)
    shared = [600 + i for i in range(32)]
    first = Sequence(shared + [1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True))
    second = Sequence(shared + [7, 8, 9], SamplingParams(max_tokens=4, ignore_eos=True))
    scheduler.add(first)
    output = scheduler.schedule()
    scheduler.commit(output, runner.execute(output))
    scheduler.add(second)
    computed_by_second = 0
    while scheduler.has_unfinished:
        output = scheduler.schedule()
        computed_by_second += sum(s.num_new_tokens for s in output.scheduled if s.seq_id == second.seq_id)
        scheduler.commit(output, runner.execute(output))
    assert second.num_cached_tokens == 32
    assert computed_by_second == 3 + 3  # its own suffix, then three decode steps
    assert (first.output_token_ids, second.output_token_ids) == tuple(
        reference_outputs([first.prompt_token_ids, second.prompt_token_ids], 4))
    assert scheduler.block_manager.in_flight == {}


def test_a_waiter_does_not_wait_for_blocks_whose_owner_was_preempted() -> None:
    manager = BlockManager(64, 4)
    owner = Sequence([600 + i for i in range(16)], SamplingParams(max_tokens=2))
    waiter = Sequence([600 + i for i in range(16)] + [5], SamplingParams(max_tokens=2))
    assert manager.allocate(owner, 8)
    assert manager.computing_elsewhere(waiter, 0)
    manager.free(owner)
    assert not manager.computing_elsewhere(waiter, 0) and manager.in_flight == {}
