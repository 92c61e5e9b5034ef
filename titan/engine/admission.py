"""Admission control: refuse work the server cannot start in time, rather than queue it forever.

A new request is checked against the queue (sequences and prompt tokens waiting) and against its
predicted time to first token: the prefill work the policy runs before it (running prompts still
prefilling and the queued requests ahead) plus its own, priced by the step cost model beside the
running decodes. A request predicted to miss the target is refused; with `admit_long_prompts`, a prompt
whose own prefill exceeds half the target is judged by the wait ahead of it alone. Batch-class
requests (priority > 0) only get `batch_share` of every limit, so they are shed first and interactive
traffic keeps its headroom. A refusal's Retry-After is never below the wait it predicts.

Servers bound the queue by default (`bound_queue_by_kv_pool`); the offline LLM queues everything.

Opt-in degradation (`degrade_batch_max_tokens`): a batch-class request admitted while others are already
waiting gets its max_tokens clamped, so the backlog drains sooner; the response says so.
"""

from __future__ import annotations

import dataclasses
import math

from titan.config import AdmissionConfig, SchedulerConfig
from titan.engine.cost_model import StepCostModel, StepShape, step_target_seconds
from titan.engine.sequence import Sequence


class AdmissionRejectedError(Exception):
    """The server is overloaded for this request's class (HTTP 429)."""

    def __init__(self, reason: str, message: str, retry_after_seconds: float) -> None:
        super().__init__(message)
        self.reason = reason  # queue_requests | queue_tokens | ttft_slo
        self.retry_after_seconds = retry_after_seconds


class AdmissionController:
    def __init__(self, config: AdmissionConfig, cost_model: StepCostModel, scheduling: SchedulerConfig) -> None:
        self.config = config
        self.cost_model = cost_model
        self.scheduling = scheduling
        self.max_num_batched_tokens = scheduling.max_num_batched_tokens
        # The slo policy's step target: prefill then runs in capped chunks beside the decodes.
        self.itl_slo_ms = scheduling.itl_slo_ms if scheduling.policy == "slo" else None
        self.rejections: dict[str, int] = {}
        self.degradations: dict[str, int] = {}

    def bound_queue_by_kv_pool(self, kv_pool_tokens: int) -> None:
        """Servers: queue limits left unset get finite defaults from the KV pool. More queued prompt tokens
        than the pool holds twice over, or more sequences than four full batches, only means waiting
        through several turnovers of the cache; such work is better refused at once (429)."""
        config = self.config
        updates = {}
        if config.max_queued_tokens is None:
            updates["max_queued_tokens"] = 2 * kv_pool_tokens
        if config.max_queued_requests is None:
            updates["max_queued_requests"] = 4 * self.scheduling.max_num_seqs
        self.config = dataclasses.replace(config, **updates)

    def predicted_prefill_seconds(self, tokens: int, decodes: StepShape) -> float:
        """Time to prefill `tokens` beside the running `decodes`, one chunk per step: the rest of the budget,
        or under the slo policy the chunk that keeps a step with those decodes within its target."""
        if not self.cost_model.ready or tokens <= 0:
            return 0.0
        chunk = max(self.max_num_batched_tokens - decodes.num_tokens, 1)
        target = step_target_seconds(self.itl_slo_ms, self.cost_model, decodes)
        if target is not None and decodes.num_sequences > 0:
            chunk = max(self.cost_model.max_chunk(decodes, 0, chunk, target),
                        min(self.scheduling.min_prefill_chunk, chunk))
        full_steps, rest = divmod(tokens, chunk)
        last = self.cost_model.predict(decodes.plus(rest, 0)) if rest else 0.0
        return full_steps * self.cost_model.predict(decodes.plus(chunk, 0)) + last

    def check(self, seq: Sequence, waiting: list[Sequence], running: list[Sequence],
              ahead: list[Sequence] | None = None) -> None:
        """Raise AdmissionRejectedError if `seq` should not join the queue now. `ahead` is the queued prefill
        work the scheduler would run before `seq` (Scheduler.ahead_of); None: all of it, in arrival order."""
        config = self.config
        share = config.batch_share if seq.priority > 0 else 1.0
        queued_tokens = sum(s.num_tokens - s.num_computed_tokens for s in waiting)
        # Every running sequence as one decode at its context: the steps any prefill will share.
        decodes = StepShape()
        for other in running:
            decodes = decodes.plus(1, other.num_tokens - 1)
        drain_seconds = self.predicted_prefill_seconds(queued_tokens, decodes)
        if config.max_queued_requests and len(waiting) + 1 > share * config.max_queued_requests:
            self._reject("queue_requests", f"{len(waiting)} sequences are already queued", drain_seconds)
        if config.max_queued_tokens and queued_tokens + seq.num_tokens > share * config.max_queued_tokens:
            self._reject("queue_tokens", f"{queued_tokens} prompt tokens are already queued", drain_seconds)
        if config.ttft_slo_ms is not None:
            target = share * config.ttft_slo_ms / 1000.0
            if ahead is None:  # running prompts still prefilling compete for the same chunks as the waiting
                ahead = [s for s in running if s.num_tokens - s.num_computed_tokens > 1] + waiting
            ahead_tokens = sum(s.num_tokens - s.num_computed_tokens for s in ahead)
            ttft = self.predicted_prefill_seconds(ahead_tokens + seq.num_tokens, decodes)
            judged = ttft
            if config.admit_long_prompts:
                # Asked for: a prompt whose own prefill takes over half the target is long rather than late,
                # refused only for the wait ahead of it (over half the target).
                own = self.predicted_prefill_seconds(seq.num_tokens, decodes)
                judged = ttft - own + min(own, target / 2)
            if judged > target:
                self._reject("ttft_slo", f"its predicted time to first token is {ttft * 1000:.0f} ms, over the "
                             f"{target * 1000:.0f} ms target", max(ttft, drain_seconds))

    def degrade(self, seq: Sequence, waiting: list[Sequence], max_tokens: int) -> None:
        """Clamp a batch-class request's max_tokens (`max_tokens` is its effective limit now) under pressure."""
        limit = self.config.degrade_batch_max_tokens
        if limit is None or seq.priority <= 0 or not waiting or max_tokens <= limit:
            return
        params = seq.sampling_params
        seq.sampling_params = dataclasses.replace(params, max_tokens=limit, min_tokens=min(params.min_tokens, limit))
        seq.degradations["max_tokens"] = {"requested": max_tokens, "applied": limit}
        self.degradations["max_tokens"] = self.degradations.get("max_tokens", 0) + 1

    def _reject(self, reason: str, detail: str, wait_seconds: float) -> None:
        """Refuse; Retry-After is the predicted wait rounded up (at least 1 s), never below it."""
        self.rejections[reason] = self.rejections.get(reason, 0) + 1
        retry_after = max(1, math.ceil(wait_seconds))
        raise AdmissionRejectedError(reason, f"The server is overloaded: {detail}. Retry in {retry_after} s.",
                                     retry_after)
