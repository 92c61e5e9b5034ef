"""The slo policy's part of each step: the order queued prompts prefill in, and the step's prefill budget.

titan.engine.prefill_budget states the budget rule; this module gathers what the rule reads (the decodes, the
queue with each prompt's TTFT target, the prompt arrival rate) and turns its decision into a bound on the step's
predicted duration that every prefill chunk is kept within.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import NamedTuple

from titan.config import AUTO_TTFT_FACTOR, SchedulerConfig
from titan.engine.block_manager import BlockManager
from titan.engine.cost_model import StepCostModel, StepShape, step_target_seconds
from titan.engine.overload import OutputLengths, full_batch_step
from titan.engine.prefill_budget import (
    BACKLOG,
    BATCH,
    NO_DECODES,
    NO_MODEL,
    BudgetDecision,
    auto_ttft_seconds,
    choose_budget,
)
from titan.engine.prefill_demand import ArrivalBatches, PrefillDemand, TypicalDecodes
from titan.engine.queue_forecast import QueuedPrefill, queued_start
from titan.engine.sequence import Sequence, SequenceStatus
from titan.engine.step_builder import StepBuilder


class PrefillPlan(NamedTuple):
    """A prompt still to prefill: where its next chunk starts, where its first started (its prefix-cache hit),
    and its auto TTFT target (None: no fitted cost model yet)."""

    start: int
    first_start: int
    auto_ttft: float | None


# the prefill order (SloPlanner.prefill_key): aged priority, deadline, tokens it computes, arrival, id
PrefillKey = tuple[float, float, int, float, int]
# what a prompt's plan was computed from (SloPlanner.memo): its status, computed tokens, the cache's version
PlanState = tuple[SequenceStatus, int, int]
PlanMemo = tuple[PlanState, PrefillPlan, PrefillKey]


class SloPlanner:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, cost_model: StepCostModel | None) -> None:
        self.config = config
        self.block_manager = block_manager
        self.cost_model = cost_model
        self.draining = False  # the last step drained a backlog (titan.engine.prefill_budget)
        window = config.prefill_demand_window_s
        self.demand = PrefillDemand(window) if window > 0 else None
        self.typical_decodes = TypicalDecodes()
        self.batches = ArrivalBatches()
        self.output_lengths = OutputLengths()

    # ---- what the queue is made of ------------------------------------------------------------
    def arrived(self, seq: Sequence, now: float) -> None:
        if self.demand is not None:
            self.demand.record(seq.seq_id, seq.num_prompt_tokens, now, self.cache_hit(seq))
        self.batches.record(seq.seq_id, seq.arrival_time)

    def admitted(self, seq: Sequence, num_cached: int) -> None:
        """`seq` was scheduled for the first time, with `num_cached` tokens from the prefix cache."""
        if self.demand is not None:
            self.demand.discount(seq.seq_id, num_cached)

    def finished(self, seq: Sequence) -> None:
        self.batches.forget(seq.seq_id)
        self.output_lengths.record(seq.num_output_tokens)

    def idle(self) -> None:
        """Nothing is running: the next decodes start a new typical shape rather than average with old ones."""
        self.typical_decodes.forget()

    def cache_hit(self, seq: Sequence) -> int:
        """Tokens of a waiting sequence the prefix cache holds now (none for one that wants its prompt's
        logprobs: it computes every position)."""
        if seq.sampling_params.prompt_logprobs is not None:
            return 0
        return len(self.block_manager.find_cached_prefix(seq)) * self.block_manager.block_size

    # ---- the prefill order --------------------------------------------------------------------
    def split_prefills(self, step: StepBuilder, prefills: list[Sequence],
                       waiting: Iterable[Sequence]) -> tuple[list[Sequence], list[Sequence]]:
        """Running prefills in prefill order, split into those that go before any waiting prompt and those
        deferred behind a waiting one with an earlier deadline (see prefill_key)."""
        best_waiting = min((self.key(step, seq) for seq in waiting), default=None)
        if best_waiting is None:
            return prefills, []
        ordered = sorted(prefills, key=lambda seq: self.key(step, seq))
        first = [seq for seq in ordered if self.key(step, seq) <= best_waiting]
        return first, ordered[len(first):]

    def key(self, step: StepBuilder, seq: Sequence) -> PrefillKey:
        """`seq`'s place in the prefill order this step (prefill_key), kept with its plan."""
        return self.memo(step, seq)[2]

    def plan(self, step: StepBuilder, seq: Sequence) -> PrefillPlan:
        """`seq`'s prefill plan this step (prefill_plan, kept by memo)."""
        return self.memo(step, seq)[1]

    def memo(self, step: StepBuilder, seq: Sequence) -> PlanMemo:
        """`seq`'s plan and prefill order, computed once a step: the step's order, its budget and every admission
        need them (with 250 prompts waiting, computed each time they took schedule() from 9.8 to 18.6 ms). They
        change only when the sequence moves (admitted, chunked or preempted) or the prefix cache does (a block
        published or evicted), and then they are computed again."""
        state = (seq.status, seq.num_computed_tokens, self.block_manager.cache_version)
        memo = step.plans.get(seq.seq_id)
        if memo is None or memo[0] != state:
            plan = self.prefill_plan(seq)
            memo = step.plans[seq.seq_id] = (state, plan, self.prefill_key(seq, step.now, plan))
        return memo

    def prefill_plan(self, seq: Sequence) -> PrefillPlan:
        """Where `seq`'s next prefill chunk starts, where its first one started (its prefix-cache hit), and its
        auto TTFT target. A waiting prompt's hit is counted: a request behind a hot system prompt has only its
        suffix to do, so its work and its auto TTFT target are the suffix's, at the suffix's positions."""
        if seq.status is SequenceStatus.RUNNING:
            start, first = seq.num_computed_tokens, seq.num_cached_tokens
        else:
            start = first = self.cache_hit(seq)
        model = self.cost_model
        auto_ttft = None
        if model is not None and model.ready:
            auto_ttft = auto_ttft_seconds(model, seq.num_tokens - first, AUTO_TTFT_FACTOR, first)
        return PrefillPlan(start, first, auto_ttft)

    def prefill_key(self, seq: Sequence, now: float, plan: PrefillPlan | None = None) -> PrefillKey:
        """Priority (aged), then the earliest deadline, arrival + AUTO_TTFT_FACTOR x the predicted prefill alone
        of what the prompt computes (from its prefix-cache hit): its own auto TTFT deadline, the one the budget
        rule checks (`plan`: the caller's prefill_plan of it). A short prompt's first token does not queue behind
        a long prompt's chunks (its deadline is near), and among like prompts it is arrival order. Keyed by what
        was *left*, a long prompt's deadline moved up as it prefilled: a short prompt arriving behind its last few
        hundred tokens queued there, late, and was drained for at 5-10x the ITL target (storm@0.7's ITL max,
        replayed); fewest tokens first, before that, let a stream of slightly shorter newcomers pass the oldest
        prompts under an overload (burst TTFT P99 1.19x fcfs's). Without a fitted model, the fewest tokens first."""
        plan = self.prefill_plan(seq) if plan is None else plan
        computes = seq.num_tokens - plan.first_start
        deadline = 0.0 if plan.auto_ttft is None else seq.arrival_time + plan.auto_ttft
        return (seq.aged_priority(now, self.config.aging_seconds), deadline, computes, seq.arrival_time, seq.seq_id)

    # ---- the step's budget --------------------------------------------------------------------
    def plan_budget(self, step: StepBuilder, decodes: list[Sequence], prefilling: list[Sequence],
                    waiting: list[Sequence], now: float) -> None:
        """This step's prefill budget (titan.engine.prefill_budget states the rule), as a bound on its predicted
        duration (`step.target`) that `chunk` keeps every prefill chunk within."""
        model = self.cost_model
        config = self.config
        if model is None or not model.ready:
            step.output.budget = BudgetDecision(NO_MODEL, None, None, None, None)
            return
        itl_target = step_target_seconds(config.itl_slo_ms, model, step.decode_shape)
        batch = self._holds_batch(itertools.chain(prefilling, waiting))
        if not step.has_decode or itl_target is None:
            # The idle bound keeps a request that arrives mid-step from waiting out a long one; a batch that
            # arrived together is one job and is prefilled at the whole budget, as it is beside decodes. Bounded,
            # a burst's first prompts were prefilled 38-96 tokens a step (AVX2 EPYC, served) before its first
            # token made the batch rule apply.
            step.target = None if batch else self._idle_step_bound(model)
            step.output.budget = BudgetDecision(BATCH if batch else NO_DECODES,
                                                None if step.target is None else step.target * 1000.0,
                                                None, None, None)
            return
        queue = sorted(prefilling + waiting, key=lambda seq: self.key(step, seq))
        fixed_ttft = None if config.ttft_target_ms == "auto" else float(config.ttft_target_ms) / 1000.0
        queued = []
        for seq in queue:
            plan = self.plan(step, seq)
            ttft_target = plan.auto_ttft if fixed_ttft is None else fixed_ttft
            queued.append(QueuedPrefill(seq.num_tokens - plan.start, now - seq.arrival_time, ttft_target, plan.start))
        in_step = [seq for seq in decodes if seq.status is SequenceStatus.RUNNING]
        fresh = sum(seq.itl_excursions == 0 for seq in in_step)
        typical = self.typical_decodes.observe(step.decode_shape, now)
        demand = self.demand.rate(now) if self.demand is not None else 0.0
        demand_start = self.demand.start_position() if self.demand is not None else 0
        decision = choose_budget(model, step.decode_shape, step.budget, itl_target, queued, fresh,
                                 config.max_itl_excursion, self.draining, config.min_prefill_chunk, demand,
                                 typical, demand_start, batch, config.max_drain_step_factor,
                                 self._full_batch_step(model, typical, demand_start, queued))
        self.draining = decision.reason == BACKLOG
        if decision.itl_cost:
            for seq in in_step:
                seq.itl_excursions += 1
        step.output.budget = decision
        step.target = decision.target_seconds

    def chunk(self, step: StepBuilder, start: int, num_new: int) -> int:
        """At most `num_new` tokens from position `start` that keep the step within its target (`step.target`
        set); the first prefill of every step gets at least the minimum chunk, so prefills still progress."""
        assert step.target is not None and self.cost_model is not None
        capped = self.cost_model.max_chunk(step.shape, start, num_new, step.target)
        floor = 0 if step.has_prefill else min(num_new, self.config.min_prefill_chunk)
        return max(capped, floor)

    def _holds_batch(self, queue: Iterable[Sequence]) -> bool:
        """Whether a prompt still to prefill arrived in a batch of `batch_min_requests` or more (more under heavy
        traffic, where smaller clusters come by chance)."""
        least = self.config.batch_min_requests
        return least > 0 and any(self.batches.is_batch(seq.seq_id, least) for seq in queue)

    def _full_batch_step(self, model: StepCostModel, typical: StepShape, demand_start: int,
                         queued: list[QueuedPrefill]) -> float:
        """The full batch's predicted step (titan.engine.overload), as wide as `max_num_seqs` or the KV cache
        allows, which an overload is held at; 0 before a request has finished, or with pacing off. Its prompts
        are the arrivals' of the demand window, or once none are left in it, the `queued` ones': an
        overload's backlog outlives its arrivals."""
        mean_output = self.output_lengths.mean
        if self.demand is None or mean_output is None:
            return 0.0
        prompt_tokens, prompt_start = self.demand.mean_tokens(), demand_start
        if not prompt_tokens and queued:
            prompt_tokens = sum(prefill.remaining_tokens for prefill in queued) / len(queued)
            prompt_start = queued_start(queued)
        return full_batch_step(model, typical, self.config.max_num_seqs, self.config.max_num_batched_tokens,
                               prompt_tokens, mean_output, prompt_start, self.block_manager.num_tokens)

    def _idle_step_bound(self, model: StepCostModel) -> float | None:
        """A step with nobody mid-stream has no token gap to protect, but a request arriving while it runs
        waits for it: a long prompt's whole-budget chunk (~1 s here) makes a short prompt that arrives just
        after it late before it is even scheduled. Such a step is bounded at the excursion bound of the typical
        decodes, `max_itl_excursion` x their ITL target (None: no decodes seen yet, or no excursions allowed);
        not at the drain bound (`max_drain_step_factor`), which protects the gaps of streams decoding beside a
        drain: with none here, it would only slow a lone prompt."""
        typical = self.typical_decodes.shape
        if typical is None or self.config.max_itl_excursion <= 1.0:
            return None
        target = step_target_seconds(self.config.itl_slo_ms, model, typical)
        return None if target is None else self.config.max_itl_excursion * target
