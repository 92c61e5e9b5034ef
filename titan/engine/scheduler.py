"""Iteration-level scheduling: which tokens of which sequences run in the next step.

Every step has a token budget and a sequence cap. Running sequences go first (a decode needs one
token); the remaining budget feeds prefill chunks of waiting requests, so a long prompt is spread over
several steps and shares each of them with the decodes. When KV blocks run out, the lowest-priority,
latest-arrived running sequence is preempted: its blocks are freed and it is recomputed later.
"""

from __future__ import annotations

import bisect
import itertools
import time
from collections import deque
from collections.abc import Callable
from typing import NamedTuple

from titan.config import AUTO_TTFT_FACTOR, SchedulerConfig
from titan.engine.block_manager import BlockManager, cdiv
from titan.engine.cost_model import StepCostModel, StepShape, step_target_seconds
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
from titan.engine.queue_forecast import QueuedPrefill
from titan.engine.scheduler_output import RunnerOutput, ScheduledSequence, SchedulerOutput
from titan.engine.sequence import Advanced, Sequence, SequenceStatus
from titan.engine.spec.planner import SpeculationPlanner


class RequestRejectedError(ValueError):
    """The request can never run (too long for the context or the KV pool); `param` names the cause."""

    def __init__(self, message: str, param: str = "prompt") -> None:
        super().__init__(message)
        self.param = param


class PrefillPlan(NamedTuple):
    """A prompt still to prefill: where its next chunk starts, where its first started (its prefix-cache hit),
    and its auto TTFT target (None: no fitted cost model yet)."""

    start: int
    first_start: int
    auto_ttft: float | None


# slo's prefill order (Scheduler._prefill_key): aged priority, deadline, tokens it computes, arrival, id
PrefillKey = tuple[float, float, int, float, int]
# what a prompt's plan was computed from (Scheduler._memo_in): its status, computed tokens, the cache's version
PlanState = tuple[SequenceStatus, int, int]


class _StepBuilder:
    """The step being assembled: what is scheduled, the budget left and the predicted shape."""

    def __init__(self, budget: int, now: float) -> None:
        self.now = now  # when the step is scheduled: waiting prompts' priorities age to it
        self.output = SchedulerOutput()
        self.total_budget = budget
        self.budget = budget
        self.shape = StepShape()
        self.has_prefill = False
        self.has_decode = False  # someone in this step is mid-stream, waiting for its next token
        self.deferred: set[int] = set()  # waiting sequences that wait for prefix blocks being computed
        self.decode_shape = StepShape()  # the running decodes alone (the auto step target follows them)
        self.target: float | None = None  # slo: the predicted duration prefill chunks keep the step within
        # slo: each queued prompt's plan and prefill order, with the state they were computed in (Scheduler._memo_in)
        self.plans: dict[int, tuple[PlanState, PrefillPlan, PrefillKey]] = {}

    def add(self, scheduled: ScheduledSequence) -> None:
        self.output.scheduled.append(scheduled)
        self.budget -= scheduled.num_new_tokens
        self.shape = self.shape.plus(scheduled.num_new_tokens, scheduled.start_position)
        self.has_prefill = self.has_prefill or not scheduled.is_decode
        self.has_decode = self.has_decode or scheduled.is_decode

    def remove(self, seq_id: int) -> None:
        """Unschedule a sequence preempted after it was scheduled in this step."""
        kept = [s for s in self.output.scheduled if s.seq_id != seq_id]
        if len(kept) == len(self.output.scheduled):
            return
        self.output.scheduled, self.budget, self.shape = [], self.total_budget, StepShape()
        self.has_prefill = self.has_decode = False
        for scheduled in kept:
            self.add(scheduled)


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        max_model_len: int,
        eos_token_ids: frozenset[int] = frozenset(),
        cost_model: StepCostModel | None = None,
        speculation: SpeculationPlanner | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        # Every time the scheduler reads (arrivals, waits, aging): a replay drives it on a virtual clock.
        self.clock = clock
        self.speculation = speculation
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.cost_model = cost_model
        self.uses_priority = config.policy != "fcfs"
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # kept sorted by _rank; victims come from the tail
        self.sequences: dict[int, Sequence] = {}
        self.num_preemptions = 0
        self.draining = False  # slo: the last step drained a backlog (titan.engine.prefill_budget)
        window = config.prefill_demand_window_s
        self.demand = PrefillDemand(window) if config.policy == "slo" and window > 0 else None
        self.typical_decodes = TypicalDecodes()
        self.batches = ArrivalBatches()

    def _rank(self, seq: Sequence) -> tuple[float, float, int]:
        """Order of running sequences (victims come from the end). Lower priority value runs first, as
        in vLLM; fcfs ignores priority. Ties go to the earlier arrival."""
        return (seq.effective_priority if self.uses_priority else 0, seq.arrival_time, seq.seq_id)

    def _aged_priority(self, seq: Sequence, now: float) -> float:
        """Every `aging_seconds` spent since arrival is worth one priority level: nothing starves."""
        if self.config.aging_seconds > 0:
            return seq.priority - (now - seq.arrival_time) // self.config.aging_seconds
        return seq.priority

    # ---- admission -----------------------------------------------------------------------------
    def max_length(self, seq: Sequence) -> int:
        """The most tokens (prompt + output) this sequence can ever hold."""
        max_tokens = seq.sampling_params.max_tokens
        limit = self.max_model_len if max_tokens is None else seq.num_prompt_tokens + max_tokens
        return min(limit, self.max_model_len)

    def check_admissible(self, seq: Sequence) -> None:
        if seq.num_prompt_tokens == 0:
            raise RequestRejectedError("the prompt is empty", param="prompt")
        if seq.num_prompt_tokens >= self.max_model_len:
            raise RequestRejectedError(
                f"the prompt has {seq.num_prompt_tokens} tokens, but this model's context is "
                f"{self.max_model_len} tokens and at least one must be left to generate"
            )
        needed = cdiv(self.max_length(seq), self.block_manager.block_size)
        if needed > self.block_manager.num_blocks:
            raise RequestRejectedError(
                f"the request needs up to {self.max_length(seq)} tokens of KV cache ({needed} blocks), "
                f"but the whole cache holds {self.block_manager.num_blocks} blocks; "
                "lower max_tokens or raise --kv-cache-memory",
                param="max_tokens",
            )

    def add(self, seq: Sequence) -> None:
        self.check_admissible(seq)
        seq.status = SequenceStatus.WAITING
        self.sequences[seq.seq_id] = seq
        self.waiting.append(seq)
        if self.demand is not None:
            self.demand.record(seq.seq_id, seq.num_prompt_tokens, self.clock(), self._cache_hit(seq))
        if self.config.policy == "slo":
            self.batches.record(seq.seq_id, seq.arrival_time)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step ------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        now = self.clock()
        step = _StepBuilder(self.config.max_num_batched_tokens, now)
        if not self.running:
            self.typical_decodes.forget()
        # Decodes first: a long prompt that is still prefilling must never starve them of budget.
        decodes = [seq for seq in self.running if seq.num_tokens - seq.num_computed_tokens == 1]
        prefills = [seq for seq in self.running if seq.num_tokens - seq.num_computed_tokens > 1]
        deferred: list[Sequence] = []
        if self.config.policy == "slo" and self.waiting:
            # A prefill already running yields to a waiting one with an earlier deadline (see _prefill_key).
            best_waiting = min(self._key_in(step, seq) for seq in self.waiting)
            keys = {seq.seq_id: self._key_in(step, seq) for seq in prefills}
            prefills.sort(key=lambda seq: keys[seq.seq_id])
            deferred = [seq for seq in prefills if keys[seq.seq_id] > best_waiting]
            prefills = prefills[:len(prefills) - len(deferred)]
        drafts = self._plan_drafts(decodes)
        for seq in decodes:
            self._schedule_running(step, seq, drafts.get(seq.seq_id, 0))
        step.decode_shape = step.shape
        if self.config.policy == "slo":
            self._plan_budget(step, decodes, prefills + deferred, now)
        for seq in prefills:
            self._schedule_running(step, seq)

        # fcfs: a step that had to preempt admits nothing new, memory is already short.
        while self.waiting and step.budget > 0 and (self.uses_priority or not step.output.preempted_seq_ids):
            seq = self._next_waiting(now, step)
            if seq is None:
                break
            if len(self.running) >= self.config.max_num_seqs:
                if self._displace_for(step, seq):
                    continue
                break
            # A prompt that wants its own logprobs must compute every position.
            wants_prompt = seq.sampling_params.prompt_logprobs is not None
            cached_blocks = [] if wants_prompt else self.block_manager.find_cached_prefix(seq)
            if not wants_prompt and self.block_manager.computing_elsewhere(seq, len(cached_blocks)):
                # Its next prefix block is being computed by a running request: wait a step for the
                # cache hit rather than spend budget computing the same block twice.
                step.deferred.add(seq.seq_id)
                continue
            num_cached = len(cached_blocks) * self.block_manager.block_size
            num_new = self._chunk(step, seq, num_cached)
            if num_new == 0:
                break
            seq.num_computed_tokens = num_cached
            if not self.block_manager.allocate(seq, num_new, cached_blocks):
                seq.num_computed_tokens = 0
                if self._displace_for(step, seq):
                    continue
                break
            self._admit(seq, num_cached, now)
            step.add(self._scheduled(seq, num_new))
        for seq in deferred:
            self._schedule_running(step, seq)
        return step.output

    def _plan_drafts(self, decodes: list[Sequence]) -> dict[int, int]:
        """Speculative decoding: how many of its drafts each decode verifies (never past its length)."""
        if self.speculation is None:
            return {}
        return self.speculation.plan([(seq, self.max_length(seq) - seq.num_tokens - 1) for seq in decodes])

    def _schedule_running(self, step: _StepBuilder, seq: Sequence, num_drafts: int = 0) -> None:
        if step.budget == 0 or seq.status is not SequenceStatus.RUNNING:
            return  # out of budget, or preempted as a victim earlier in this step
        num_new = self._chunk(step, seq, seq.num_computed_tokens)
        drafts = seq.draft_token_ids[:min(num_drafts, step.budget - num_new)] if num_new == 1 else []
        if num_new > 0 and self._allocate_or_preempt(step, seq, num_new + len(drafts)):
            step.add(self._scheduled(seq, num_new, drafts))

    def _plan_budget(self, step: _StepBuilder, decodes: list[Sequence], prefilling: list[Sequence],
                     now: float) -> None:
        """slo: this step's prefill budget (titan.engine.prefill_budget states the rule), as a bound on its
        predicted duration that `_chunk` keeps every prefill chunk within."""
        model = self.cost_model
        config = self.config
        if model is None or not model.ready:
            step.output.budget = BudgetDecision(NO_MODEL, None, None, None, None)
            return
        itl_target = step_target_seconds(config.itl_slo_ms, model, step.decode_shape)
        batch = self._holds_batch(prefilling)
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
        queue = sorted(prefilling + list(self.waiting), key=lambda seq: self._key_in(step, seq))
        fixed_ttft = None if config.ttft_target_ms == "auto" else float(config.ttft_target_ms) / 1000.0
        queued = []
        for seq in queue:
            plan = self._plan_in(step, seq)
            ttft_target = plan.auto_ttft if fixed_ttft is None else fixed_ttft
            queued.append(QueuedPrefill(seq.num_tokens - plan.start, now - seq.arrival_time, ttft_target, plan.start))
        in_step = [seq for seq in decodes if seq.status is SequenceStatus.RUNNING]
        fresh = sum(seq.itl_excursions == 0 for seq in in_step)
        typical = self.typical_decodes.observe(step.decode_shape, now)
        demand = self.demand.rate(now) if self.demand is not None else 0.0
        demand_start = self.demand.start_position() if self.demand is not None else 0
        decision = choose_budget(model, step.decode_shape, step.budget, itl_target, queued, fresh,
                                 config.max_itl_excursion, self.draining, config.min_prefill_chunk, demand,
                                 typical, demand_start, batch)
        self.draining = decision.reason == BACKLOG
        if decision.itl_cost:
            for seq in in_step:
                seq.itl_excursions += 1
        step.output.budget = decision
        step.target = decision.target_seconds

    def _holds_batch(self, prefilling: list[Sequence]) -> bool:
        """Whether a prompt still to prefill arrived in a batch of `batch_min_requests` or more."""
        least = self.config.batch_min_requests
        return least > 0 and any(self.batches.size(seq.seq_id) >= least
                                 for seq in itertools.chain(prefilling, self.waiting))

    def _idle_step_bound(self, model: StepCostModel) -> float | None:
        """A step with nobody mid-stream has no token gap to protect, but a request arriving while it runs
        waits for it: a long prompt's whole-budget chunk (~1 s here) makes a short prompt that arrives just
        after it late before it is even scheduled. Such a step is bounded as a backlog drain at the typical
        decodes is (None: no decodes seen yet, or no excursions allowed)."""
        typical = self.typical_decodes.shape
        if typical is None or self.config.max_itl_excursion <= 1.0:
            return None
        target = step_target_seconds(self.config.itl_slo_ms, model, typical)
        return None if target is None else self.config.max_itl_excursion * target

    def _prefill_plan(self, seq: Sequence) -> PrefillPlan:
        """Where `seq`'s next prefill chunk starts, where its first one started (its prefix-cache hit), and its
        auto TTFT target. A waiting prompt's hit is counted: a request behind a hot system prompt has only its
        suffix to do, so its work and its auto TTFT target are the suffix's, at the suffix's positions."""
        if seq.status is SequenceStatus.RUNNING:
            start, first = seq.num_computed_tokens, seq.num_cached_tokens
        else:
            start = first = self._cache_hit(seq)
        model = self.cost_model
        auto_ttft = None
        if model is not None and model.ready:
            auto_ttft = auto_ttft_seconds(model, seq.num_tokens - first, AUTO_TTFT_FACTOR, first)
        return PrefillPlan(start, first, auto_ttft)

    def _plan_in(self, step: _StepBuilder, seq: Sequence) -> PrefillPlan:
        """`seq`'s prefill plan this step (`_prefill_plan`, kept by `_memo_in`)."""
        return self._memo_in(step, seq)[1]

    def _key_in(self, step: _StepBuilder, seq: Sequence) -> PrefillKey:
        """`seq`'s place in slo's prefill order this step (`_prefill_key`), kept with its plan."""
        return self._memo_in(step, seq)[2]

    def _memo_in(self, step: _StepBuilder, seq: Sequence) -> tuple[PlanState, PrefillPlan, PrefillKey]:
        """`seq`'s plan and prefill order, computed once a step: the step's order, its budget and every admission
        need them (with 250 prompts waiting, computed each time they took schedule() from 9.8 to 18.6 ms). They
        change only when the sequence moves (admitted, chunked or preempted) or the prefix cache does (a block
        published or evicted), and then they are computed again."""
        state = (seq.status, seq.num_computed_tokens, self.block_manager.cache_version)
        memo = step.plans.get(seq.seq_id)
        if memo is None or memo[0] != state:
            plan = self._prefill_plan(seq)
            memo = step.plans[seq.seq_id] = (state, plan, self._prefill_key(seq, step.now, plan))
        return memo

    def _cache_hit(self, seq: Sequence) -> int:
        """Tokens of a waiting sequence the prefix cache holds now (none for one that wants its prompt's
        logprobs: it computes every position)."""
        if seq.sampling_params.prompt_logprobs is not None:
            return 0
        return len(self.block_manager.find_cached_prefix(seq)) * self.block_manager.block_size

    def _prefill_key(self, seq: Sequence, now: float, plan: PrefillPlan | None = None) -> PrefillKey:
        """slo's prefill order: priority (aged), then the earliest deadline, arrival + AUTO_TTFT_FACTOR x the
        predicted prefill alone of what the prompt computes (from its prefix-cache hit): its own auto TTFT
        deadline, the one the budget rule checks (`plan`: the caller's _prefill_plan of it). A short prompt's
        first token does not queue behind a long prompt's chunks (its deadline is near), and among like prompts
        it is arrival order. Keyed by what was *left*, a long prompt's deadline moved up as it prefilled: a
        short prompt arriving behind its last few hundred tokens queued there, late, and was drained for at
        5-10x the ITL target (storm@0.7's ITL max, replayed); fewest tokens first, before that, let a stream of
        slightly shorter newcomers pass the oldest prompts under an overload (burst TTFT P99 1.19x fcfs's).
        Without a fitted model, the fewest tokens first."""
        plan = self._prefill_plan(seq) if plan is None else plan
        computes = seq.num_tokens - plan.first_start
        deadline = 0.0 if plan.auto_ttft is None else seq.arrival_time + plan.auto_ttft
        return (self._aged_priority(seq, now), deadline, computes, seq.arrival_time, seq.seq_id)

    def _chunk(self, step: _StepBuilder, seq: Sequence, start: int) -> int:
        """Tokens to compute for `seq` this step: its remainder, within the budget and the step's target."""
        num_new = min(seq.num_tokens - start, step.budget)
        # No target: no model yet, or fcfs/priority, or an idle step with no bound (_idle_step_bound).
        if num_new <= 1 or step.target is None or self.cost_model is None:
            return num_new
        capped = self.cost_model.max_chunk(step.shape, start, num_new, step.target)
        # Prefills still progress: the first prefill of every step gets at least the minimum chunk.
        floor = 0 if step.has_prefill else min(num_new, self.config.min_prefill_chunk)
        return max(capped, floor)

    def _next_waiting(self, now: float, step: _StepBuilder) -> Sequence | None:
        """The best waiting sequence; one preempted in this very step is not taken back at once, and one
        waiting for prefix blocks another request is computing is passed over."""
        if not self.uses_priority:
            return next((seq for seq in self.waiting if seq.seq_id not in step.deferred), None)
        skipped = set(step.output.preempted_seq_ids) | step.deferred
        candidates = [seq for seq in self.waiting if seq.seq_id not in skipped]
        return min(candidates, key=lambda seq: self._waiting_key(seq, now, step), default=None)

    def _waiting_key(self, seq: Sequence, now: float, step: _StepBuilder | None = None) -> PrefillKey:
        """Priority policies' admission order: aged priority then arrival; slo's is its prefill order (its plan
        from `step`'s, when a step is being built)."""
        if self.config.policy == "slo":
            return self._prefill_key(seq, now) if step is None else self._key_in(step, seq)
        return (self._aged_priority(seq, now), 0.0, 0, seq.arrival_time, seq.seq_id)

    def ahead_of(self, seq: Sequence) -> list[Sequence]:
        """The queued prefill work this policy would run before `seq` if it arrived now (admission prices it):
        running prompts still prefilling, and the waiting sequences that rank before it."""
        prefilling = [s for s in self.running if s.num_tokens - s.num_computed_tokens > 1]
        if not self.uses_priority:
            return prefilling + list(self.waiting)
        now = self.clock()
        key = self._waiting_key(seq, now)
        waiting = [s for s in self.waiting if self._waiting_key(s, now) < key]
        if self.config.policy == "priority":
            return prefilling + waiting  # running prefills are scheduled before any admission
        return [s for s in prefilling if self._prefill_key(s, now) < key] + waiting

    def _admit(self, seq: Sequence, num_cached: int, now: float) -> None:
        self.waiting.remove(seq)
        if seq.first_scheduled_time is None:
            seq.num_cached_tokens = num_cached
            seq.first_scheduled_time = now
            if self.demand is not None:
                self.demand.discount(seq.seq_id, num_cached)
        if seq.preempted_at is not None:
            seq.preempted_seconds += now - seq.preempted_at
            seq.preempted_at = None
        seq.status = SequenceStatus.RUNNING
        seq.effective_priority = self._aged_priority(seq, now)
        bisect.insort(self.running, seq, key=self._rank)

    def _allocate_or_preempt(self, step: _StepBuilder, seq: Sequence, num_new: int) -> bool:
        """Find blocks for `seq`, preempting the lowest-ranked running sequences if needed.

        False when `seq` itself had to go (it ranks lowest).
        """
        while not self.block_manager.allocate(seq, num_new):
            victim = self.running[-1]
            self._preempt(victim, step)
            if victim is seq:
                return False
        return True

    def _displace_for(self, step: _StepBuilder, seq: Sequence) -> bool:
        """Priority policies: preempt the lowest-ranked running sequence if `seq` strictly outranks it, in its
        own priority as well as aged.

        The victim keeps the aged priority it was admitted with, so a request that got in by aging is
        not pushed out at once by the requests it had waited behind. Aging orders the queue but never
        evicts running work of the same or a better priority: under a long overload every waiting request
        ages past the running ones, and each would displace one to recompute it later, wasting the machine.
        """
        if not self.uses_priority or not self.running:
            return False
        victim = self.running[-1]
        if seq.priority >= victim.priority or self._aged_priority(seq, self.clock()) >= victim.effective_priority:
            return False
        self._preempt(victim, step)
        return True

    def _scheduled(self, seq: Sequence, num_new: int, drafts: list[int] = ()) -> ScheduledSequence:
        start = seq.num_computed_tokens
        return ScheduledSequence(
            seq_id=seq.seq_id,
            token_ids=seq.token_ids_slice(start, start + num_new) + list(drafts),
            start_position=start,
            block_table=seq.block_table,
            sample=start + num_new == seq.num_tokens,
            sampling_params=seq.sampling_params,
            prompt_token_ids=seq.prompt_token_ids,
            output_token_ids=seq.output_token_ids,
            generator=seq.generator,
            grammar=seq.grammar,
            draft_token_ids=list(drafts),
        )

    def _preempt(self, seq: Sequence, step: _StepBuilder) -> None:
        """Drop the sequence's KV blocks and requeue it at the front; it recomputes on return."""
        step.remove(seq.seq_id)
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_recomputed_tokens += seq.num_computed_tokens
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.preempted_at = self.clock()
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        step.output.preempted_seq_ids.append(seq.seq_id)

    def commit(self, output: SchedulerOutput, runner_output: RunnerOutput) -> list[Advanced]:
        """After the runner returned: advance computed tokens, publish the blocks now written to the prefix
        cache, append sampled tokens and end sequences that hit a stop token or their length. Returns what
        each sequence got. A sequence preempted or aborted since it was scheduled is skipped, so none of its
        unwritten blocks is ever published. Rejected drafts are rolled back before anything is published:
        their positions do not count as computed and the blocks past the accepted tokens are freed."""
        verified = {v.seq_id: v for v in runner_output.verifications}
        computed: list[Sequence] = []
        for scheduled in output.scheduled:
            seq = self.sequences.get(scheduled.seq_id)
            if seq is None or seq.status is not SequenceStatus.RUNNING:
                continue
            rejected = 0
            verification = verified.get(seq.seq_id)
            if verification is not None:
                rejected = verification.num_drafts - verification.num_accepted
                if self.speculation is not None:
                    self.speculation.record(seq, verification.num_drafts, verification.num_accepted)
            seq.num_computed_tokens += scheduled.num_new_tokens - rejected
            if rejected:
                # Keep the blocks up to the next position to compute (the token sampled now).
                self.block_manager.trim(seq, seq.num_computed_tokens + 1)
            computed.append(seq)
        for chunk in runner_output.prompt_logprobs:
            seq = self.sequences.get(chunk.seq_id)
            if seq is not None and seq.status is SequenceStatus.RUNNING and seq.prompt_logprobs is not None:
                seq.prompt_logprobs[chunk.first_position:chunk.first_position + len(chunk.entries)] = chunk.entries
        advanced: dict[int, Advanced] = {}
        stopped: dict[int, tuple[Sequence, SequenceStatus]] = {}
        now = self.clock()
        for seq_id, token_id, entry in zip(runner_output.seq_ids, runner_output.token_ids, runner_output.logprobs,
                                           strict=True):
            seq = self.sequences.get(seq_id)
            if seq is None or seq.status is not SequenceStatus.RUNNING or seq_id in stopped:
                continue  # aborted while the step ran, or stopped by an earlier token of this step
            seq.output_token_ids.append(token_id)
            if seq.grammar is not None:
                seq.grammar.accept(token_id)
            if seq.first_token_time is None:
                seq.first_token_time = now
            if seq_id not in advanced:
                advanced[seq_id] = Advanced(seq, [], [])
            advanced[seq_id].token_ids.append(token_id)
            advanced[seq_id].logprobs.append(entry)
            status = self._stop_status(seq, token_id)
            if status is not None:
                stopped[seq_id] = (seq, status)
        # Publish once the accepted drafts are tokens of their sequences (block hashes cover token ids),
        # and before stopped sequences release their blocks.
        for seq in computed:
            self.block_manager.commit(seq)
        for seq, status in stopped.values():
            self.finish(seq, status)
        return list(advanced.values())

    def stop(self, stopped: list[tuple[Sequence, str, int]]) -> None:
        """End sequences the output stage found a stop string in (the string becomes their stop reason),
        keeping the output tokens up to the one that completed it."""
        for seq, stop_string, num_output_tokens in stopped:
            if seq.status is SequenceStatus.FINISHED_ABORTED:
                continue
            del seq.output_token_ids[num_output_tokens:]
            seq.stop_reason = stop_string
            if seq.is_finished:  # by a later token of the same step: the stop string came first
                seq.status = SequenceStatus.FINISHED_STOPPED
            else:
                self.finish(seq, SequenceStatus.FINISHED_STOPPED)

    def _stop_status(self, seq: Sequence, token_id: int) -> SequenceStatus | None:
        params = seq.sampling_params
        if seq.num_output_tokens >= params.min_tokens:
            if token_id in self.eos_token_ids and not params.ignore_eos:
                return SequenceStatus.FINISHED_STOPPED
            if token_id in params.stop_token_ids:
                seq.stop_reason = token_id
                return SequenceStatus.FINISHED_STOPPED
        if seq.num_tokens >= self.max_length(seq):
            return SequenceStatus.FINISHED_LENGTH
        if seq.grammar is not None and seq.grammar.finished:
            return SequenceStatus.FINISHED_STOPPED  # the grammar allows nothing more
        return None

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """End a sequence (stopped, length or aborted) and free all its blocks at once."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = status
        seq.finished_time = self.clock()
        self.sequences.pop(seq.seq_id, None)
        self.batches.forget(seq.seq_id)

    def abort(self, seq_id: int) -> Sequence | None:
        seq = self.sequences.get(seq_id)
        if seq is not None:
            self.finish(seq, SequenceStatus.FINISHED_ABORTED)
        return seq
