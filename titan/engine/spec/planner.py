"""How many of each sequence's drafts the next step verifies: the scheduler's speculation decision.

Adaptive rule (per step, greedy in marginal gain). A sequence's first draft is accepted with probability
α, and each later one with probability β once the one before it was; the j-th draft counts only if the
j-1 before it were accepted, so verifying it yields α·β^(j-1) more expected tokens and makes the step
longer by the cost model's marginal token cost c. With E expected tokens in a step of predicted length T,
the draft pays when the step's tokens per second rise: (E + g) / (T + c) > E / T, i.e. g · T > c · E.
Drafts are added best first while that holds. The two estimates differ because drafts come in runs: an
n-gram match that starts a copied span keeps matching to its end (measured on the copy-heavy benchmark,
k = 8: first draft accepted 0.6-0.9 of the time, a draft after an accepted one 0.97), so one per-draft
rate α^j undervalued the deep drafts of exactly the requests that accept them. A quiet
server (E small, T dominated by reading the weights) verifies several drafts; a busy one (E large, T
growing with the batch) verifies few or none; a sequence whose acceptance collapsed stops drafting, and
its estimate drifts back towards the server's recent average so it is retried now and then; a new
request starts at that average.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from titan.config import SpeculativeConfig
from titan.engine.cost_model import StepCostModel, StepShape, shape_of
from titan.engine.scheduler_output import ScheduledSequence
from titan.engine.sequence import Sequence

# How fast acceptance estimates move. A sequence starts at the server's recent average acceptance (itself
# starting at PRIOR_ACCEPTANCE), so on a workload whose drafts fail, new requests do not start optimistic.
PRIOR_ACCEPTANCE = 0.6
PRIOR_CONTINUATION = 0.8
ACCEPTANCE_RATE = 0.3
SERVER_ACCEPTANCE_RATE = 0.05
# Per step a sequence with drafts is not verified, its estimate relaxes this share back to the prior.
RELAXATION = 0.02
# After this many steps in a row with drafts available and none verified, the likeliest sequence's drafts
# are verified anyway (all of them: the wider the probe, the more it tells the fit about a draft's cost).
# The cost model learns what a draft costs only from steps that verify one: a fit that once overpriced
# drafts (steps slowed by a noisy neighbour) would otherwise be confirmed by every 1-token step after it,
# and speculation would stay off for good.
PROBE_INTERVAL = 16


def toward(estimate: float, observed: float, rate: float) -> float:
    """An exponential average moved `rate` of the way to `observed`."""
    return estimate + rate * (observed - estimate)


@dataclass
class SpecStats:
    """Counters since start (vLLM's spec_decode_* metrics)."""

    num_drafts: int = 0  # verifications: sequence-steps that carried drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)


class SpeculationPlanner:
    """`cost_model` is fitted to decode-only steps (verification included) by `observe`: their cost per
    row is what a draft adds, and prefill chunks, which run on other kernels, would blur it. While only one
    batch width has been seen, the fit splits a step's time evenly between the fixed cost and the row, so
    a quiet server starts by verifying a likely draft and learns the real split from it."""

    def __init__(self, config: SpeculativeConfig, cost_model: StepCostModel | None = None) -> None:
        self.config = config
        self.cost_model = cost_model if cost_model is not None else StepCostModel()
        self.stats = SpecStats(accepted_per_position=[0] * config.num_speculative_tokens)
        self.server_acceptance = PRIOR_ACCEPTANCE
        self.server_continuation = PRIOR_CONTINUATION
        self.steps_without_drafts = 0  # consecutive steps that had drafts and verified none

    def acceptance(self, seq: Sequence) -> float:
        """The chance that the sequence's first draft is accepted."""
        return self.server_acceptance if seq.spec_acceptance is None else seq.spec_acceptance

    def continuation(self, seq: Sequence) -> float:
        """The chance that a draft is accepted once the one before it was."""
        return self.server_continuation if seq.spec_continuation is None else seq.spec_continuation

    def observe(self, scheduled: list[ScheduledSequence], seconds: float) -> None:
        """A step ran: learn from it if it only decoded."""
        if scheduled and all(item.is_decode for item in scheduled):
            self.cost_model.observe(shape_of(scheduled), seconds)

    def plan(self, decodes: list[tuple[Sequence, int]]) -> dict[int, int]:
        """Drafts to verify per seq_id, for decodes given with the most drafts each may carry. A sequence
        with drafts that are not worth verifying drifts back towards the prior acceptance."""
        plan = self._probe(decodes, self.choose(decodes))
        for seq, _ in decodes:
            if seq.draft_token_ids and seq.seq_id not in plan and seq.spec_acceptance is not None:
                seq.spec_acceptance = toward(seq.spec_acceptance, self.server_acceptance, RELAXATION)
        return plan

    def _draft_cap(self, limit: int, num_drafts: int) -> int:
        """Drafts a sequence may have verified: what it has, within its room and the configured k."""
        return max(0, min(limit, num_drafts, self.config.num_speculative_tokens))

    def _probe(self, decodes: list[tuple[Sequence, int]], plan: dict[int, int]) -> dict[int, int]:
        """`plan`, or the likeliest sequence's drafts when PROBE_INTERVAL steps verified none."""
        if plan:
            self.steps_without_drafts = 0
            return plan
        if not self.config.adaptive or not self.cost_model.ready:
            return plan
        offered = {seq: cap for seq, limit in decodes if (cap := self._draft_cap(limit, len(seq.draft_token_ids)))}
        if not offered:
            return plan
        self.steps_without_drafts += 1
        if self.steps_without_drafts < PROBE_INTERVAL:
            return plan
        self.steps_without_drafts = 0
        likeliest = max(offered, key=self.acceptance)
        return {likeliest.seq_id: offered[likeliest]}

    def choose(self, decodes: list[tuple[Sequence, int]], available: dict[int, int] | None = None,
               draft_seconds: float = 0.0) -> dict[int, int]:
        """The rule above, changing nothing; `available` (seq_id → drafts) replaces each sequence's own
        drafts and `draft_seconds` adds what computing one draft costs (a draft model asks how many drafts
        would be wanted before it computes them)."""
        def drafts_of(seq: Sequence) -> int:
            return len(seq.draft_token_ids) if available is None else available.get(seq.seq_id, 0)

        candidates = [(seq, self._draft_cap(limit, drafts_of(seq))) for seq, limit in decodes]
        candidates = [(seq, limit) for seq, limit in candidates if limit > 0]
        if not candidates:
            return {}
        if not self.config.adaptive:
            return {seq.seq_id: limit for seq, limit in candidates}
        model = self.cost_model
        if not model.ready:
            return {}  # no cost estimate yet: do not gamble
        shape = StepShape()
        for seq, _ in decodes:
            shape = shape.plus(1, seq.num_computed_tokens)
        step_seconds, expected_tokens = model.predict(shape), float(len(decodes))
        heap = [(-self.acceptance(seq), 1, index) for index, (seq, _) in enumerate(candidates)]
        heapq.heapify(heap)
        chosen = [0] * len(candidates)
        while heap:
            negative_gain, position, index = heapq.heappop(heap)
            seq, limit = candidates[index]
            cost = model.marginal_token_cost(seq.num_computed_tokens + position) + draft_seconds
            gain = -negative_gain
            if gain * step_seconds <= cost * expected_tokens:
                break  # the best remaining draft does not pay, so none after it does
            chosen[index] = position
            step_seconds += cost
            expected_tokens += gain
            if position < limit:
                heapq.heappush(heap, (-gain * self.continuation(seq), position + 1, index))
        return {seq.seq_id: count for (seq, _), count in zip(candidates, chosen, strict=True) if count}

    def record(self, seq: Sequence, num_drafts: int, num_accepted: int) -> None:
        """A verification's outcome: update the sequence's acceptance estimate and the counters."""
        stats = self.stats
        stats.num_drafts += 1
        stats.num_draft_tokens += num_drafts
        stats.num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            stats.accepted_per_position[position] += 1
        first = float(num_accepted > 0)
        seq.spec_acceptance = toward(self.acceptance(seq), first, ACCEPTANCE_RATE)
        self.server_acceptance = toward(self.server_acceptance, first, SERVER_ACCEPTANCE_RATE)
        # The drafts after an accepted one: num_accepted - 1 successes, then one failure unless every
        # draft was accepted.
        trials = num_accepted - 1 + (num_accepted < num_drafts) if num_accepted else 0
        if trials:
            observed = (num_accepted - 1) / trials
            seq.spec_continuation = toward(self.continuation(seq), observed, ACCEPTANCE_RATE)
            self.server_continuation = toward(self.server_continuation, observed, SERVER_ACCEPTANCE_RATE)
        seq.timeline.num_draft_tokens += num_drafts
        seq.timeline.num_accepted_tokens += num_accepted
