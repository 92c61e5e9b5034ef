"""What watches each engine step after it ran: step records, the cost model and request timelines.

The engine calls `observe` once per step, after commit; nothing here changes what the step did.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from titan.engine.cost_model import StepCostModel, shape_of
from titan.engine.gc_discipline import GcMonitor
from titan.engine.prefill_budget import BudgetDecision
from titan.engine.scheduler_output import RunnerOutput, SchedulerOutput
from titan.engine.sequence import Advanced, Sequence
from titan.engine.spec.planner import SpeculationPlanner

STEP_HISTORY = 2048  # engine steps kept for attribution (/debug/steps)


@dataclass(frozen=True)
class StepRecord:
    """One engine step, for transient attribution."""

    started: float  # time.monotonic()
    duration: float
    num_tokens: int
    num_sequences: int
    num_prefill_tokens: int  # tokens of sequences computing more than one token
    num_decodes: int
    num_preemptions: int
    predicted_duration: float | None  # the cost model's prediction, once it is fitted
    gc_pause: float  # seconds the garbage collector paused during the step
    num_draft_tokens: int = 0  # speculative decoding: drafts verified in this step, and accepted
    num_accepted_tokens: int = 0
    budget: BudgetDecision | None = None  # slo: the step's prefill budget and why (compare with the durations)

    @classmethod
    def of(cls, output: SchedulerOutput, runner_output: RunnerOutput, started: float, duration: float,
           predicted: float | None, gc_pause: float) -> StepRecord:
        prefill_tokens = sum(s.num_new_tokens for s in output.scheduled if not s.is_decode)
        verified = runner_output.verifications
        return cls(started, duration, output.num_batched_tokens, len(output.scheduled), prefill_tokens,
                   sum(1 for s in output.scheduled if s.is_decode), len(output.preempted_seq_ids),
                   predicted, gc_pause, sum(v.num_drafts for v in verified), sum(v.num_accepted for v in verified),
                   output.budget)


@dataclass(frozen=True)
class StepDone:
    """What the observer is told about one step, once it ran and committed."""

    decision: SchedulerOutput
    result: RunnerOutput
    scheduled_seqs: list[Sequence | None]  # behind `decision.scheduled` (None: gone before the step ran)
    advanced: list[Advanced]  # sequences that got tokens
    started: float  # time.monotonic()
    duration: float  # schedule + execute
    gc_pause_before: float  # the GC monitor's running total when the step started


class StepObserver:
    def __init__(self, cost_model: StepCostModel, gc_monitor: GcMonitor,
                 speculation: SpeculationPlanner | None = None) -> None:
        self.cost_model = cost_model
        self.speculation = speculation
        self.gc_monitor = gc_monitor
        self.steps: deque[StepRecord] = deque(maxlen=STEP_HISTORY)

    def observe(self, step: StepDone) -> None:
        """Record the step, fit the cost model, extend the timelines. The prediction is read before the
        fit, so it never saw the step it predicts."""
        decision = step.decision
        if not decision.is_empty:
            shape = shape_of(decision.scheduled)
            predicted = self.cost_model.predict(shape) if self.cost_model.ready else None
            self.cost_model.observe(shape, step.duration)
            if self.speculation is not None:
                self.speculation.observe(decision.scheduled, step.duration)
            gc_pause = self.gc_monitor.total_pause_seconds - step.gc_pause_before
            self.steps.append(StepRecord.of(decision, step.result, step.started, step.duration, predicted, gc_pause))
            for scheduled, seq in zip(decision.scheduled, step.scheduled_seqs, strict=True):
                if seq is not None and not scheduled.is_decode:
                    seq.timeline.record_chunk(step.started, scheduled.num_new_tokens, step.duration,
                                              seq.num_preemptions > 0)
        now = time.monotonic()
        for item in step.advanced:
            item.seq.timeline.record_token(now, item.seq.num_preemptions, reversed(self.steps))
