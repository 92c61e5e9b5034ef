"""The slo policy's per-step prefill budget: the ITL cap, or under a backlog the excursion bound until it drains.

Goodput (DistServe's definition) counts requests that meet both their TTFT target and their ITL target.
Capping every step at the ITL target protects the running decodes, and while the capped steps still get
every queued first token out in time nothing is gained by more. Under a backlog the cap starves the queue:
a short step spends most of its time on the fixed per-step cost, so prefill runs at a fraction of its speed
and the backlog spreads onto every request that arrives after it. The rule, evaluated once per step that
carries decodes:

* T is the ITL target (`step_target_seconds`), τᵢ request i's TTFT target (`ttft_target_seconds`: the
  given number, or auto AUTO_TTFT_FACTOR x the predicted prefill alone of what its prompt computes, the
  prefix-cache hit left out, so a long prompt may take longer than a short one), X the excursion bound
  (`max_itl_excursion`).
* Capped, a step holds b(T) prefill tokens: the largest chunk that keeps the predicted step (decodes +
  chunk) within T, or `min_prefill_chunk` if that is more; or, when more, the smallest chunk that keeps pace
  with the prompt tokens arriving (titan.engine.prefill_demand: steady traffic then never builds a backlog,
  the prefill is spread evenly over the steps instead of drained in long ones). The queue (running prompts
  still prefilling, then the waiting ones, in the policy's order) is on time if every request i is predicted
  to get its first token within τᵢ of its arrival when every step from now on computes b(T) of them: i
  finishes in step ⌈(tokens of i and of those ahead of it) / b(T)⌉, each step taking the predicted duration
  of decodes + b(T).
* On time: the step is capped at T (or paced). Otherwise the queue is a backlog — some first token is late
  whatever this step does — and the step runs to X·T (or the whole token budget, if that is less), as fcfs
  would up to that bound. It keeps doing so until the queue is on time at the cap with half of every target
  to spare (DRAIN_EXIT_SHARE): stopping as soon as the cap looks just fast enough again would leave the
  backlog's last requests right at their TTFT target, and the queue hovering there would switch between cap
  and drain step after step. Under a sustained overload the drain never ends, as fcfs never caps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from titan.engine.cost_model import StepCostModel, StepShape
from titan.engine.prefill_demand import DEMAND_HEADROOM, paced_chunk

# Why a step got the prefill budget it got (shown in /debug/steps).
NO_MODEL = "no_model"  # the cost model is not fitted yet: the whole token budget
NO_DECODES = "no_decodes"  # nobody is mid-stream: no gap to protect, the whole token budget
ITL_CAP = "itl_cap"  # capped at the ITL target: the queue's first tokens are on time at the cap
PACED = "paced"  # on time at the cap, widened past the ITL target to keep pace with arriving prompts
BACKLOG = "backlog"  # the excursion bound: at the cap a queued first token is late, or a backlog still drains


# A drain ends when every queued first token is predicted within this share of its TTFT target at the cap.
DRAIN_EXIT_SHARE = 0.5


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
    ttft_met_capped: int = 0  # of them, predicted to get their first token in time at the cap
    ttft_met: int = 0  # ... at the chosen bound
    itl_cost: int = 0  # decodes whose first gap over the ITL target this step is
    demand_tokens_per_s: float = 0.0  # prompt tokens arriving per second (titan.engine.prefill_demand)

    @property
    def target_seconds(self) -> float | None:
        return None if self.step_target_ms is None else self.step_target_ms / 1000.0


def ttft_target_seconds(ttft_target_ms: float | str, cost_model: StepCostModel, prompt_tokens: int,
                        auto_factor: float) -> float:
    """A request's TTFT target: the given number, or with auto `auto_factor` x the predicted prefill alone of
    the `prompt_tokens` it computes (the model must be fitted)."""
    if ttft_target_ms != "auto":
        return float(ttft_target_ms) / 1000.0
    return auto_factor * cost_model.predict(StepShape().plus(prompt_tokens, 0))


def ttft_met(queue: list[QueuedPrefill], tokens_per_step: int, step_seconds: float, share: float = 1.0) -> int:
    """Queued prefills (in service order) predicted to reach their first token within `share` x their target
    of arrival."""
    if tokens_per_step <= 0:
        return 0
    met, ahead = 0, 0
    for item in queue:
        ahead += item.remaining_tokens
        if item.waited_seconds + math.ceil(ahead / tokens_per_step) * step_seconds <= share * item.ttft_target:
            met += 1
    return met


def choose_budget(cost_model: StepCostModel, decodes: StepShape, token_budget: int, itl_target: float,
                  queue: list[QueuedPrefill], fresh_decodes: int, max_excursion: float,
                  draining: bool = False, min_chunk: int = 1, demand: float = 0.0) -> BudgetDecision:
    """The module docstring's rule for a step whose decodes have shape `decodes` and `token_budget` tokens
    left; `fresh_decodes` of them have had no gap over their ITL target yet; `draining`: the last step drained
    a backlog; `min_chunk`: prefill tokens a step computes even past the cap; `demand`: prompt tokens
    arriving per second, which the cap keeps pace with."""

    def tokens_within(target: float) -> int:
        return cost_model.max_chunk(decodes, 0, token_budget, target)

    def met_within(tokens: int) -> int:
        return ttft_met(queue, tokens, cost_model.predict(decodes.plus(tokens, 0)))

    ms = 1000.0
    capped = tokens_within(itl_target)
    pacing = bool(queue) and max_excursion > 1.0
    paced = paced_chunk(cost_model, decodes, token_budget, DEMAND_HEADROOM * demand) if pacing else 0
    reason, cap_target = ITL_CAP, itl_target
    if paced > capped:
        reason, capped = PACED, paced
        cap_target = cost_model.predict(decodes.plus(paced, 0))
    first_target = queue[0].ttft_target * ms if queue else None
    floor = max(capped, min(min_chunk, token_budget))
    capped_step = cost_model.predict(decodes.plus(floor, 0))
    met_capped = ttft_met(queue, floor, capped_step)
    # A drain ends once the queue is on time at the cap with half its targets to spare, not just on time:
    # otherwise a backlog hovers at its targets, switching between cap and drain step after step.
    on_time = met_capped == len(queue) and (
        not draining or ttft_met(queue, floor, capped_step, share=DRAIN_EXIT_SHARE) == len(queue))
    if not queue or token_budget <= capped or max_excursion <= 1.0 or on_time:
        return BudgetDecision(reason, cap_target * ms, itl_target * ms, first_target, capped, len(queue),
                              met_capped, met_capped, 0, demand)
    # A drain is never slower than pacing: a backlog that arrives faster than X·T steps clear it is drained
    # at the arrival rate's chunk (the whole budget under an overload, as fcfs).
    widest = min(max(max_excursion * itl_target, cap_target), cost_model.predict(decodes.plus(token_budget, 0)))
    tokens = tokens_within(widest)
    return BudgetDecision(BACKLOG, widest * ms, itl_target * ms, first_target, tokens, len(queue), met_capped,
                          met_within(tokens), fresh_decodes, demand)
