"""The step being assembled by the scheduler: what is scheduled so far, the budget left and the predicted shape."""

from __future__ import annotations

from typing import TYPE_CHECKING

from titan.engine.cost_model import StepShape
from titan.engine.scheduler_output import ScheduledSequence, SchedulerOutput

if TYPE_CHECKING:
    from titan.engine.slo_planner import PlanMemo


class StepBuilder:
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
        # slo: each queued prompt's plan and prefill order, with the state they were computed in (SloPlanner.memo)
        self.plans: dict[int, PlanMemo] = {}

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
