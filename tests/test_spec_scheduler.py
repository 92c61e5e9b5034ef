"""Speculative decoding in the scheduler with no model: drafts count in the budget, rejected drafts roll
back their K/V blocks, the prefix cache never publishes an unverified token, preemption and abort in the
middle of speculation lose nothing, and the adaptive planner speculates less when it would not pay.

The fake runner keeps a token per KV slot and checks every read against the sequence's history plus its
drafts; its 'model' is a hash of the context, and an oracle drafter proposes the true continuation with
some tokens corrupted, so both acceptance and rejection happen.
"""

from __future__ import annotations

import random

from test_scheduler import FakeRunner, reference_outputs

from titan.config import SchedulerConfig, SpeculativeConfig
from titan.engine.block_manager import BlockManager, cdiv
from titan.engine.cost_model import StepCostModel, StepShape
from titan.engine.sampling_params import SamplingParams
from titan.engine.scheduler import Scheduler
from titan.engine.scheduler_output import RunnerOutput, SchedulerOutput
from titan.engine.sequence import Sequence, SequenceStatus
from titan.engine.spec.planner import PROBE_INTERVAL, SpeculationPlanner
from titan.engine.spec.verify import accept


def next_token(context: list[int]) -> int:
    return 10 + sum(t * (i + 1) for i, t in enumerate(context)) % 1000


class VerifyingRunner(FakeRunner):
    """FakeRunner whose sampling positions include every draft position; accept() keeps the agreeing ones."""

    def execute(self, output: SchedulerOutput) -> RunnerOutput:
        tokens = []
        for item in output.scheduled:
            for offset, token in enumerate(item.token_ids):
                self.slots[self.slot(item.block_table, item.start_position + offset)] = token
        for item in output.scheduled:
            history = item.prompt_token_ids + item.output_token_ids + item.draft_token_ids
            context = [self.slots[self.slot(item.block_table, p)] for p in range(item.context_length)]
            assert context == history[: item.context_length], f"sequence {item.seq_id} reads a corrupted KV cache"
            if item.sample:
                first = item.context_length - len(item.draft_token_ids)
                tokens += [next_token(history[:end]) for end in range(first, item.context_length + 1)]
        return accept(output.scheduled, tokens, [None] * len(tokens), {})


def oracle_drafts(seq: Sequence, count: int, rng: random.Random, corrupt: float) -> list[int]:
    history = seq.prompt_token_ids + seq.output_token_ids
    drafts = []
    for _ in range(count):
        token = next_token(history) if rng.random() > corrupt else 7
        drafts.append(token)
        history = history + [token]
    return drafts


def make(num_blocks: int = 64, budget: int = 32, max_seqs: int = 8, k: int = 4,
         prefix_caching: bool = True) -> tuple[Scheduler, VerifyingRunner]:
    planner = SpeculationPlanner(SpeculativeConfig("ngram", num_speculative_tokens=k, adaptive=False), None)
    scheduler = Scheduler(SchedulerConfig(budget, max_seqs, policy="priority", aging_seconds=0.0),
                          BlockManager(num_blocks, 4, prefix_caching), 512, frozenset({2}), speculation=planner)
    return scheduler, VerifyingRunner(num_blocks, 4)


def params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True)


def run(scheduler: Scheduler, runner: VerifyingRunner, rng: random.Random, corrupt: float = 0.3,
        arrivals: list[Sequence] = (), abort_some: bool = False) -> int:
    """Drive to completion, drafting after every step like the engine; returns accepted draft tokens."""
    pending = list(arrivals)
    steps = 0
    while pending or scheduler.has_unfinished:
        if pending and rng.random() < 0.5:
            scheduler.add(pending.pop(0))
        output = scheduler.schedule()
        assert output.num_batched_tokens <= scheduler.config.max_num_batched_tokens
        result = runner.execute(output)
        for advanced in scheduler.commit(output, result):
            assert advanced.seq.output_token_ids[-len(advanced.token_ids):] == advanced.token_ids or \
                advanced.seq.is_finished
        for seq in scheduler.running:
            # Rolled back: a running sequence holds exactly the blocks its computed tokens + the next need.
            assert len(seq.block_table) <= cdiv(seq.num_computed_tokens + 1, scheduler.block_manager.block_size) \
                or seq.num_tokens - seq.num_computed_tokens > 1
            decode = seq.num_tokens - seq.num_computed_tokens == 1
            seq.draft_token_ids = oracle_drafts(seq, 4, rng, corrupt) if decode else []
        if abort_some and scheduler.running and rng.random() < 0.05:
            scheduler.abort(scheduler.running[-1].seq_id)
        steps += 1
        assert steps < 5000
    return scheduler.speculation.stats.num_accepted_tokens


def test_outputs_match_a_run_without_drafts_and_rejections_roll_back() -> None:
    rng = random.Random(3)
    scheduler, runner = make()
    seqs = [Sequence([100 + 7 * r + i for i in range(9)], params(20)) for r in range(4)]
    accepted = run(scheduler, runner, rng, arrivals=seqs)
    stats = scheduler.speculation.stats
    assert 0 < accepted < stats.num_draft_tokens  # both outcomes happened
    expected = reference_outputs([seq.prompt_token_ids for seq in seqs], 20)
    assert [seq.output_token_ids for seq in seqs] == expected
    assert scheduler.block_manager.num_free_blocks == scheduler.block_manager.num_blocks


def test_drafts_never_exceed_max_tokens_or_the_budget() -> None:
    rng = random.Random(4)
    scheduler, runner = make(budget=6)
    seqs = [Sequence([200 + i for i in range(5)], params(m)) for m in (1, 2, 3, 7)]
    run(scheduler, runner, rng, corrupt=0.0, arrivals=seqs)
    assert [seq.num_output_tokens for seq in seqs] == [1, 2, 3, 7]
    assert [seq.status for seq in seqs] == [SequenceStatus.FINISHED_LENGTH] * 4


def test_prefix_cache_never_publishes_an_unverified_token() -> None:
    """A later request extending a finished one's prompt + output hits only verified blocks: the runner
    checks every read, so a published block holding a rejected draft would fail it."""
    rng = random.Random(5)
    scheduler, runner = make()
    first = Sequence([300 + i for i in range(6)], params(24))
    run(scheduler, runner, rng, corrupt=0.5, arrivals=[first])
    for block_hash, block_id in scheduler.block_manager.hash_to_block.items():
        assert scheduler.block_manager.blocks[block_id].block_hash == block_hash
    extended = first.prompt_token_ids + first.output_token_ids + [901, 902, 903]
    second = Sequence(extended, params(8))
    run(scheduler, runner, rng, arrivals=[second])
    assert second.num_cached_tokens >= 24  # the verified history was reused ...
    assert second.output_token_ids == reference_outputs([extended], 8)[0]  # ... and was right


def test_preemption_and_abort_in_the_middle_of_speculation_lose_nothing() -> None:
    rng = random.Random(6)
    preemptions = 0
    for _ in range(6):
        scheduler, runner = make(num_blocks=10, budget=20, max_seqs=4)
        seqs = [Sequence([400 + 13 * r + i for i in range(rng.randrange(3, 12))], params(rng.randrange(4, 16)),
                         priority=rng.choice((0, 1)), arrival_time=float(r)) for r in range(8)]
        run(scheduler, runner, rng, arrivals=seqs, abort_some=True)
        preemptions += scheduler.num_preemptions
        expected = reference_outputs([seq.prompt_token_ids for seq in seqs], 16)
        for seq, reference in zip(seqs, expected, strict=True):
            assert seq.output_token_ids == reference[: seq.num_output_tokens]
            if seq.status is not SequenceStatus.FINISHED_ABORTED:
                assert seq.num_output_tokens == seq.sampling_params.max_tokens
        assert scheduler.block_manager.num_free_blocks == scheduler.block_manager.num_blocks
    assert preemptions > 0  # the pool is tight enough to preempt mid-speculation


# ---- the adaptive planner ------------------------------------------------------------------------

def fitted_cost_model(fixed_ms: float, per_token_ms: float) -> StepCostModel:
    """A cost model fitted to steps costing fixed + per_token × tokens (weights-bound decode on a CPU)."""
    model = StepCostModel()
    for tokens in (1, 2, 4, 8, 16, 32, 64, 3, 5, 12):
        shape = StepShape(tokens, min(tokens, 8), 0.0)
        model.observe(shape, (fixed_ms + per_token_ms * tokens) / 1000)
    assert model.ready
    return model


def decodes(count: int, acceptance: float, drafts: int = 4) -> list[tuple[Sequence, int]]:
    seqs = []
    for index in range(count):
        seq = Sequence([1, 2, 3], params(64))
        seq.num_computed_tokens = 2
        seq.draft_token_ids = [5] * drafts
        seq.spec_acceptance = acceptance
        seqs.append((seq, 64))
        del index
    return seqs


def test_adaptive_planner_speculates_when_quiet_less_when_busy_and_not_when_acceptance_collapses() -> None:
    planner = SpeculationPlanner(SpeculativeConfig("ngram", num_speculative_tokens=4), fitted_cost_model(15, 3))
    quiet = planner.plan(decodes(1, 0.8))
    assert list(quiet.values()) == [4]  # one stream on a weight-bound step: verify every draft
    busy = planner.plan(decodes(32, 0.8))
    assert sum(busy.values()) < 32 * 4 / 4  # a wide batch: at most a quarter of the drafts
    collapsed = decodes(1, 0.05)
    assert planner.plan(collapsed) == {}
    assert collapsed[0][0].spec_acceptance > 0.05  # drifts back so it is retried later
    # A draft model as costly as the target's step: no draft pays for itself.
    assert planner.choose(decodes(1, 0.9), draft_seconds=0.018) == {}
    assert planner.choose(decodes(1, 0.9), draft_seconds=0.0005) != {}
    fixed = SpeculationPlanner(SpeculativeConfig("ngram", num_speculative_tokens=3, adaptive=False), None)
    assert list(fixed.plan(decodes(2, 0.01)).values()) == [3, 3]


def test_a_fit_that_overprices_drafts_is_probed_until_it_learns_their_cost() -> None:
    """Only steps that verify drafts tell the cost model what a draft costs. A fit that once priced a draft
    like a whole step is confirmed by every 1-token step after it, so without probes speculation would
    stay off for good; every PROBE_INTERVAL steps the likeliest drafts are verified anyway, and once the fit
    has seen what they really cost, the rule verifies drafts of its own accord."""
    model = fitted_cost_model(1, 11)  # a draft row priced at 11 of a 12 ms step
    planner = SpeculationPlanner(SpeculativeConfig("ngram", num_speculative_tokens=4), model)
    plans = [planner.plan(decodes(1, 0.8)) for _ in range(PROBE_INTERVAL)]
    assert plans[:-1] == [{}] * (PROBE_INTERVAL - 1) and list(plans[-1].values()) == [4]
    unprompted = 0
    for step in range(20 * PROBE_INTERVAL):
        plan = planner.plan(decodes(1, 0.8))
        rows = 1 + sum(plan.values())
        unprompted += bool(plan) and (step + 1) % PROBE_INTERVAL != 0
        # What the steps really cost: 10.5 ms plus 1.5 ms per row, with a context that grows.
        model.observe(StepShape(rows, 1, rows * (100.0 + step)), (10.5 + 1.5 * rows) / 1000)
    assert unprompted > 5 * PROBE_INTERVAL
    fixed = SpeculationPlanner(SpeculativeConfig("ngram", num_speculative_tokens=4, adaptive=False), None)
    assert all(list(fixed.plan(decodes(1, 0.8)).values()) == [4] for _ in range(PROBE_INTERVAL))


def test_drafts_that_come_in_runs_are_verified_deep() -> None:
    """Copied spans make acceptance bimodal: a run's first draft is a gamble, the drafts after an accepted
    one almost never fail. Learned from verifications that accept all or nothing, the first-draft estimate
    sits near one half and the continuation near one, so every draft is worth verifying; one per-draft rate
    (a half, then a quarter, an eighth...) would have cut the run at two."""
    planner = SpeculationPlanner(SpeculativeConfig("ngram", num_speculative_tokens=8), fitted_cost_model(15, 3))
    runs = decodes(1, 0.6, drafts=8)
    seq = runs[0][0]
    for _ in range(20):
        planner.record(seq, 8, 8)
        planner.record(seq, 8, 0)
    assert 0.3 < planner.acceptance(seq) < 0.7 and planner.continuation(seq) > 0.95
    assert list(planner.plan(runs).values()) == [8]
    flat = decodes(1, 0.6, drafts=8)
    flat[0][0].spec_continuation = 0.6
    assert list(planner.plan(flat).values()) == [2]


def test_planner_waits_for_a_fitted_cost_model_and_tracks_acceptance() -> None:
    planner = SpeculationPlanner(SpeculativeConfig("ngram", num_speculative_tokens=4), StepCostModel())
    assert planner.plan(decodes(1, 0.9)) == {}
    seq = decodes(1, 0.6)[0][0]
    for _ in range(10):
        planner.record(seq, 4, 0)
    assert seq.spec_acceptance < 0.05
    for _ in range(10):
        planner.record(seq, 4, 4)
    assert seq.spec_acceptance > 0.9
    assert planner.stats.num_drafts == 20 and planner.stats.num_draft_tokens == 80
    assert planner.stats.accepted_per_position == [10, 10, 10, 10]
    assert seq.timeline.num_accepted_tokens == 40


def test_new_requests_start_at_the_servers_recent_acceptance() -> None:
    """On a workload whose drafts keep failing, a new request does not start optimistic."""
    planner = SpeculationPlanner(SpeculativeConfig("ngram", num_speculative_tokens=4), fitted_cost_model(15, 3))
    fresh = decodes(1, 0.0)[0][0]
    fresh.spec_acceptance = None
    assert planner.choose([(fresh, 64)]) != {}  # the prior: worth a try
    for _ in range(60):
        planner.record(decodes(1, 0.5)[0][0], 4, 0)
    assert planner.server_acceptance < 0.05
    assert planner.choose([(fresh, 64)]) == {}


def test_drafts_shrink_to_the_free_slots_rather_than_preempt() -> None:
    """A full pool where every decode's own token still fits: drafts that need a new block are cut to the
    slots at hand, and nobody is preempted for them (the drafting sequence used to preempt the other one, or,
    ranked lowest, itself, recomputing its whole prompt)."""
    for drafter in (0, 1):
        scheduler = Scheduler(SchedulerConfig(64, 4, policy="fcfs"), BlockManager(4, 4, enable_prefix_caching=False),
                              64, frozenset(),
                              speculation=SpeculationPlanner(SpeculativeConfig("ngram", 3, adaptive=False)))
        seqs = [Sequence(list(range(100 * r, 100 * r + 6)), params(8), arrival_time=float(r)) for r in range(2)]
        for seq in seqs:
            scheduler.add(seq)
        prefill = scheduler.schedule()  # 6 tokens each: two blocks each, and the pool is full
        scheduler.commit(prefill, RunnerOutput(seq_ids=[s.seq_id for s in seqs], token_ids=[7, 7],
                                               logprobs=[None, None]))
        seqs[drafter].draft_token_ids = [1, 2, 3]  # positions 7-9: the last needs a third block
        step = scheduler.schedule()
        assert step.preempted_seq_ids == [] and scheduler.num_preemptions == 0
        widths = {item.seq_id: item.num_new_tokens for item in step.scheduled}
        assert widths == {seqs[drafter].seq_id: 2, seqs[1 - drafter].seq_id: 1}  # one draft: position 7
