"""Iteration-level scheduling: which tokens of which sequences run in the next step.

Every step has a token budget and a sequence cap. Running sequences go first (a decode needs one
token); the remaining budget feeds prefill chunks of waiting requests, so a long prompt is spread over
several steps and shares each of them with the decodes. When KV blocks run out, the lowest-priority,
latest-arrived running sequence is preempted: its blocks are freed and it is recomputed later.

The slo policy's prefill order and budget are titan.engine.slo_planner's; what a step's results do to its
sequences is titan.engine.commit's.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from collections.abc import Callable

from titan.config import SchedulerConfig
from titan.engine.block_manager import BlockManager, cdiv
from titan.engine.commit import CommitStage
from titan.engine.cost_model import StepCostModel
from titan.engine.scheduler_output import RunnerOutput, ScheduledSequence, SchedulerOutput
from titan.engine.sequence import Advanced, Sequence, SequenceStatus
from titan.engine.slo_planner import PrefillKey, SloPlanner
from titan.engine.spec.planner import SpeculationPlanner
from titan.engine.step_builder import StepBuilder


class RequestRejectedError(ValueError):
    """The request can never run (too long for the context or the KV pool); `param` names the cause."""

    def __init__(self, message: str, param: str = "prompt") -> None:
        super().__init__(message)
        self.param = param


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
        self.uses_priority = config.policy != "fcfs"
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # kept sorted by _rank; victims come from the tail
        self.sequences: dict[int, Sequence] = {}
        self.num_preemptions = 0
        self.slo = SloPlanner(config, block_manager, cost_model) if config.policy == "slo" else None
        self.committer = CommitStage(self.sequences, block_manager, eos_token_ids, self.max_length, self.finish,
                                     speculation, clock)

    def _rank(self, seq: Sequence) -> tuple[float, float, int]:
        """Order of running sequences (victims come from the end). Lower priority value runs first, as
        in vLLM; fcfs ignores priority. Ties go to the earlier arrival."""
        return (seq.effective_priority if self.uses_priority else 0, seq.arrival_time, seq.seq_id)

    def _aged_priority(self, seq: Sequence, now: float) -> float:
        return seq.aged_priority(now, self.config.aging_seconds)

    # ---- admission -----------------------------------------------------------------------------
    def max_length(self, seq: Sequence) -> int:
        """The most tokens (prompt + output) this sequence can ever hold. Without max_tokens, the context or
        the whole KV cache, whichever is less (llama.cpp's n_ctx): a cache smaller than the context used to
        refuse every such request."""
        max_tokens = seq.sampling_params.max_tokens
        if max_tokens is None:
            return min(self.max_model_len, self.block_manager.num_tokens)
        return min(seq.num_prompt_tokens + max_tokens, self.max_model_len)

    def check_admissible(self, seq: Sequence) -> None:
        if seq.num_prompt_tokens == 0:
            raise RequestRejectedError("the prompt is empty", param="prompt")
        if seq.num_prompt_tokens >= self.max_model_len:
            raise RequestRejectedError(
                f"the prompt has {seq.num_prompt_tokens} tokens, but this model's context is "
                f"{self.max_model_len} tokens and at least one must be left to generate"
            )
        cache_tokens = self.block_manager.num_tokens
        if seq.num_prompt_tokens >= cache_tokens:  # no max_tokens helps: name the prompt
            raise RequestRejectedError(
                f"the prompt has {seq.num_prompt_tokens} tokens, but the whole KV cache holds {cache_tokens} "
                "and at least one must be left to generate; shorten the prompt or raise --kv-cache-memory",
                param="prompt",
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
        if self.slo is not None:
            self.slo.arrived(seq, self.clock())

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step ------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        now = self.clock()
        step = StepBuilder(self.config.max_num_batched_tokens, now)
        if self.slo is not None and not self.running:
            self.slo.idle()
        # Decodes first: a long prompt that is still prefilling must never starve them of budget.
        decodes = [seq for seq in self.running if seq.num_tokens - seq.num_computed_tokens == 1]
        prefills = [seq for seq in self.running if seq.num_tokens - seq.num_computed_tokens > 1]
        deferred: list[Sequence] = []
        if self.slo is not None:
            # A prefill already running yields to a waiting one with an earlier deadline.
            prefills, deferred = self.slo.split_prefills(step, prefills, self.waiting)
        drafts = self._plan_drafts(decodes)
        for seq in decodes:
            self._schedule_running(step, seq, drafts.get(seq.seq_id, 0))
        step.decode_shape = step.shape
        if self.slo is not None:
            self.slo.plan_budget(step, decodes, prefills + deferred, list(self.waiting), now)
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

    def _schedule_running(self, step: StepBuilder, seq: Sequence, num_drafts: int = 0) -> None:
        if step.budget == 0 or seq.status is not SequenceStatus.RUNNING:
            return  # out of budget, or preempted as a victim earlier in this step
        num_new = self._chunk(step, seq, seq.num_computed_tokens)
        drafts = seq.draft_token_ids[:min(num_drafts, step.budget - num_new)] if num_new == 1 else []
        # Drafts are optional: fewer of them, rather than preempt anyone (the drafting sequence included) for
        # their slots; only the token every decode computes may preempt.
        while drafts and not self.block_manager.allocate(seq, num_new + len(drafts)):
            drafts = drafts[:-1]
        if num_new > 0 and (drafts or self._allocate_or_preempt(step, seq, num_new)):
            step.add(self._scheduled(seq, num_new, drafts))

    def _chunk(self, step: StepBuilder, seq: Sequence, start: int) -> int:
        """Tokens to compute for `seq` this step: its remainder, within the budget and the step's target."""
        num_new = min(seq.num_tokens - start, step.budget)
        # No target: fcfs/priority, or slo with no fitted model yet or an idle step with no bound.
        if num_new <= 1 or step.target is None or self.slo is None:
            return num_new
        return self.slo.chunk(step, start, num_new)

    def _next_waiting(self, now: float, step: StepBuilder) -> Sequence | None:
        """The best waiting sequence; one preempted in this very step is not taken back at once, and one
        waiting for prefix blocks another request is computing is passed over."""
        if not self.uses_priority:
            return next((seq for seq in self.waiting if seq.seq_id not in step.deferred), None)
        skipped = set(step.output.preempted_seq_ids) | step.deferred
        candidates = [seq for seq in self.waiting if seq.seq_id not in skipped]
        return min(candidates, key=lambda seq: self._waiting_key(seq, now, step), default=None)

    def _waiting_key(self, seq: Sequence, now: float, step: StepBuilder | None = None) -> PrefillKey:
        """Priority policies' admission order: aged priority then arrival; slo's is its prefill order (its plan
        from `step`'s, when a step is being built)."""
        if self.slo is not None:
            return self.slo.prefill_key(seq, now) if step is None else self.slo.key(step, seq)
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
        assert self.slo is not None
        return [s for s in prefilling if self.slo.prefill_key(s, now) < key] + waiting

    def _admit(self, seq: Sequence, num_cached: int, now: float) -> None:
        self.waiting.remove(seq)
        if seq.first_scheduled_time is None:
            seq.num_cached_tokens = num_cached
            seq.first_scheduled_time = now
            if self.slo is not None:
                self.slo.admitted(seq, num_cached)
        if seq.preempted_at is not None:
            seq.preempted_seconds += now - seq.preempted_at
            seq.preempted_at = None
        seq.status = SequenceStatus.RUNNING
        seq.effective_priority = self._aged_priority(seq, now)
        bisect.insort(self.running, seq, key=self._rank)

    def _allocate_or_preempt(self, step: StepBuilder, seq: Sequence, num_new: int) -> bool:
        """Find blocks for `seq`, preempting the lowest-ranked running sequences if needed.

        False when `seq` itself had to go (it ranks lowest).
        """
        while not self.block_manager.allocate(seq, num_new):
            victim = self.running[-1]
            self._preempt(victim, step)
            if victim is seq:
                return False
        return True

    def _displace_for(self, step: StepBuilder, seq: Sequence) -> bool:
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

    def _preempt(self, seq: Sequence, step: StepBuilder) -> None:
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
        """After the runner returned (titan.engine.commit): what each sequence got."""
        return self.committer.commit(output, runner_output)

    def stop(self, stopped: list[tuple[Sequence, str, int]]) -> None:
        """End sequences the output stage found a stop string in (titan.engine.commit)."""
        self.committer.stop(stopped)

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
        if self.slo is not None:
            self.slo.finished(seq)

    def abort(self, seq_id: int) -> Sequence | None:
        seq = self.sequences.get(seq_id)
        if seq is not None:
            self.finish(seq, SequenceStatus.FINISHED_ABORTED)
        return seq
