"""The slo policy's per-step prefill budget: the ITL cap, widened under a backlog when that raises goodput.

Goodput (DistServe's definition) counts requests that meet both their TTFT target and their ITL target.
Capping every step at the ITL target protects the running decodes, but under a backlog it starves the queue:
a short step spends most of its time on the fixed per-step cost, so prefill runs slowly and waiting
requests miss their TTFT. The rule, evaluated once per step that carries decodes while prefill work is
queued:

* T is the ITL target (`step_target_seconds`), τᵢ request i's TTFT target (`ttft_target_seconds`: the
  given number, or auto AUTO_TTFT_FACTOR x its whole prompt's predicted prefill alone, so a long prompt may
  take longer than a short one), X the excursion bound (`max_itl_excursion`). Candidate step durations
  are T, 2T, 4T, ... up to X·T, and the duration that
  spends the whole remaining token budget if that is below X·T. A candidate t allows b(t) prefill tokens per
  step: the largest chunk that keeps the predicted step (decodes + chunk) within t.
* Met(t): the queued prefills (running prompts still prefilling, then the waiting ones, in the policy's
  order) predicted to get their first token by their deadline if every step from now on computed b(t) of
  them: request i finishes in step ⌈(tokens of i and of those ahead of it) / b(t)⌉, each step taking the
  predicted duration of decodes + b(t). The deadline is τᵢ after arrival; for a request that has already
  waited w > τᵢ it is the next multiple of τᵢ, ⌊w/τᵢ⌋·τᵢ + τᵢ, so under a backlog no budget clears in time the
  rule still prefers the budget that gets more first tokens out sooner (plain deadlines would all be
  missed whatever the budget, leaving the cap to starve the queue).
* Cost(t): 0 for t = T; otherwise the decodes in this step that have not yet had a gap over their ITL
  target (a request with one such gap already misses its ITL target, so another costs no goodput).
* The step uses the smallest t maximizing Met(t) − Cost(t): wider only when it saves strictly more first
  tokens than it breaks token gaps, and never past X·T. When widening costs nothing (every decode in the
  step already had a gap over its target) it takes the widest t that saves no fewer: throughput for the
  requests still to come.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from titan.engine.cost_model import StepCostModel, StepShape

# Why a step got the prefill budget it got (shown in /debug/steps).
NO_MODEL = "no_model"  # the cost model is not fitted yet: the whole token budget
NO_DECODES = "no_decodes"  # nobody is mid-stream: no gap to protect, the whole token budget
ITL_CAP = "itl_cap"  # capped at the ITL target: nothing queued, or widening would not raise goodput
GOODPUT = "goodput"  # widened: more queued requests meet their TTFT than decodes lose their ITL target


@dataclass(frozen=True)
class QueuedPrefill:
    """Prefill work waiting for the budget: tokens still to compute, seconds since arrival, its TTFT target."""

    remaining_tokens: int
    waited_seconds: float
    ttft_target: float


@dataclass(frozen=True)
class BudgetDecision:
    """What the slo policy chose for one step, and why."""

    reason: str
    step_target_ms: float | None  # the step's predicted-duration bound (None: the whole token budget)
    itl_target_ms: float | None
    ttft_target_ms: float | None  # the first queued request's
    prefill_tokens: int | None  # b(t): prefill tokens a step within the target holds
    queued: int = 0  # queued prefills considered
    ttft_met_capped: int = 0  # Met(T)
    ttft_met: int = 0  # Met(chosen t)
    itl_cost: int = 0  # Cost(chosen t)

    @property
    def target_seconds(self) -> float | None:
        return None if self.step_target_ms is None else self.step_target_ms / 1000.0


def ttft_target_seconds(ttft_target_ms: float | str, cost_model: StepCostModel, prompt_tokens: int,
                        auto_factor: float) -> float:
    """A request's TTFT target: the given number, or with auto `auto_factor` x its whole prompt's predicted
    prefill alone (the model must be fitted)."""
    if ttft_target_ms != "auto":
        return float(ttft_target_ms) / 1000.0
    return auto_factor * cost_model.predict(StepShape().plus(prompt_tokens, 0))


def ttft_met(queue: list[QueuedPrefill], tokens_per_step: int, step_seconds: float) -> int:
    """Queued prefills (in service order) predicted to reach their first token by their deadline: the target
    after arrival, or for one already past it the next multiple of the target."""
    if tokens_per_step <= 0:
        return 0
    met, ahead = 0, 0
    for item in queue:
        ahead += item.remaining_tokens
        target = max(item.ttft_target, 1e-6)
        deadline = (math.floor(max(item.waited_seconds, 0.0) / target) + 1) * target
        if item.waited_seconds + math.ceil(ahead / tokens_per_step) * step_seconds <= deadline:
            met += 1
    return met


def choose_budget(cost_model: StepCostModel, decodes: StepShape, token_budget: int, itl_target: float,
                  queue: list[QueuedPrefill], fresh_decodes: int, max_excursion: float) -> BudgetDecision:
    """The module docstring's rule for a step whose decodes have shape `decodes` and `token_budget` tokens
    left; `fresh_decodes` of them have had no gap over their ITL target yet."""

    def tokens_within(target: float) -> int:
        return cost_model.max_chunk(decodes, 0, token_budget, target)

    capped = tokens_within(itl_target)
    ms = 1000.0
    base = BudgetDecision(ITL_CAP, itl_target * ms, itl_target * ms, queue[0].ttft_target * ms if queue else None,
                          capped, len(queue))
    if not queue or token_budget <= capped or max_excursion <= 1.0:
        return base

    def met_within(tokens: int) -> int:
        return ttft_met(queue, tokens, cost_model.predict(decodes.plus(tokens, 0)))

    met_capped = met_within(capped)
    best = BudgetDecision(ITL_CAP, itl_target * ms, itl_target * ms, base.ttft_target_ms, capped, len(queue),
                          met_capped, met_capped, 0)
    ceiling = max_excursion * itl_target
    whole = cost_model.predict(decodes.plus(token_budget, 0))
    candidates = [itl_target * 2**k for k in range(1, 64) if itl_target * 2**k < min(ceiling, whole)]
    candidates.append(min(ceiling, whole))
    for target in candidates:
        tokens = tokens_within(target)
        if tokens <= best.prefill_tokens:
            continue
        met = met_within(tokens)
        # Free widening (every decode already missed its ITL target) that saves no fewer first tokens drains
        # the queue faster for the requests still to come: take it.
        if met - fresh_decodes > best.ttft_met - best.itl_cost or (fresh_decodes == 0 and met >= best.ttft_met):
            best = BudgetDecision(GOODPUT, target * ms, itl_target * ms, base.ttft_target_ms, tokens, len(queue),
                                  met_capped, met, fresh_decodes)
    return best
