"""The slo policy's per-step prefill budget: the ITL cap, or under a backlog the excursion bound until it drains.

Goodput (DistServe's definition) counts requests that meet both their TTFT target and their ITL target.
Capping every step at the ITL target protects the running decodes, and while the capped steps still get
every queued first token out in time nothing is gained by more. Under a backlog the cap starves the queue:
a short step spends most of its time on the fixed per-step cost, so prefill runs at a fraction of its speed
and the backlog spreads onto every request that arrives after it. The rule, evaluated once per step that
carries decodes:

* T is the ITL target (`step_target_seconds`), τᵢ request i's TTFT target (the given number, or with auto
  AUTO_TTFT_FACTOR x the predicted prefill alone of what its prompt computes, `auto_ttft_seconds`: the
  prefix-cache hit left out but attended to, so a long prompt may take longer than a short one), X the
  excursion bound (`max_itl_excursion`). Queued prompt tokens are priced at the position they start at on
  average (`queued_start`), arriving ones at theirs.
* Capped, a step holds b(T) prefill tokens: the largest chunk that keeps the predicted step (decodes +
  chunk) within T, or `min_prefill_chunk` if that is more; or, when more, the chunk that fills the paced
  step duration P. P is one duration for every step: the shortest with which a step of the typical recent
  decodes (titan.engine.prefill_demand.TypicalDecodes) keeps pace with the prompt tokens arriving (steady
  traffic then never builds a backlog, the prefill is spread evenly over the steps instead of drained in
  long ones), but never longer than MAX_PACED_FACTOR x those decodes' own (the arrival rate is measured over
  seconds and a Poisson cluster of arrivals reads as a flood; what pacing cannot keep up with waits in the
  queue). A step of fewer decodes than the typical takes a bigger chunk, one of more a smaller: sized per
  step at a multiple of its own decodes, the token gap followed the batch width, and the widths of 4-5
  were the P99 where 1-2 were the P50. The queue (running
  prompts still prefilling, then the waiting ones, in the policy's order) is on time if every request i is
  predicted to get its first token within τᵢ of its arrival when every step from now on computes b(T) of
  them: i finishes in step ⌈(tokens of i and of those ahead of it) / b(T)⌉, each step taking the predicted
  duration of decodes + b(T) plus the decode of every queued request already prefilled
  (titan.engine.queue_forecast: a burst's first requests decode in every step their followers prefill in).
* On time, with every first token predicted within BACKLOG_SHARE of its target: the step is capped at T
  (or paced). Otherwise the queue is a backlog (some first token is late, or about to be, at the cap) and
  the step takes the smallest chunk with which every queued first token is predicted within BACKLOG_SHARE
  of its target, up to X·T (or the whole token budget, if that is less; never slower than the arrivals,
  so under an overload the whole budget, as fcfs), with X·T itself at most D x the typical decodes' own
  step (D: `max_drain_step_factor`). If no chunk up to that bound gets the queue on time,
  FUTILE_DRAIN_FACTOR x the capped step (never slower than the arrivals), unless another chunk up to the
  bound gets more first tokens within their targets (then the smallest such chunk, `most_on_time`): the
  bound's excursion is paid only where it saves one. A small backlog so costs a small excursion. The
  drain goes on until the queue is on time at the cap with half of every target to spare
  (DRAIN_EXIT_SHARE): stopping as soon as the cap looks just fast enough again would leave the backlog's
  last requests right at their TTFT target, and the queue hovering there would switch between cap and
  drain step after step. Under a sustained overload the drain never ends, as fcfs never caps.
* A drain's widest step is at most the full batch's step F (titan.engine.overload: `max_num_seqs` decodes,
  or as many as the KV cache holds, beside the prompt tokens that refill their slots, once a request has
  finished and the output length is known), or the excursion bound if that is more: under an overload
  keeping pace with the arrivals asks for the whole budget, and a step past the one the full batch settles
  into only splits the gaps into long and short ones.
* A drain that no chunk up to its widest step gets on time, with OVERLOAD_BACKLOG_REQUESTS or more requests
  queued, is an overload's backlog and takes F (never more than the whole budget): otherwise it stays near
  the capped step, and a backlog whose arrivals have stopped (so nothing asks to keep pace) drains at a few
  decodes' pace while dozens of requests wait.

A queue holding a batch (`batch_min_requests` or more requests that arrived together, within
titan.engine.prefill_demand.BATCH_WINDOW_SECONDS of the first: a client fanning out, an eval job, a burst;
more under heavy traffic, where Poisson arrivals bring smaller clusters by chance: `ArrivalBatches`) is
drained at the whole token budget until the batch is prefilled, as fcfs would: its job is done when its last
request is, and the throughput rule bounds a burst's TTFT P99 at 1.1x fcfs's.

A step with no decodes has no token gap to protect and takes the whole budget, but once decodes have been
seen it stays within X x the ITL target of the typical decodes (`SloPlanner._idle_step_bound`): a
request arriving while it runs waits for all of it. A batch in the queue lifts that bound too.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from titan.engine.cost_model import StepCostModel, StepShape, smallest_passing
from titan.engine.prefill_demand import DEMAND_HEADROOM, paced_chunk
from titan.engine.queue_forecast import QueuedPrefill, QueueForecast, decode_growth, queued_start

# Why a step got the prefill budget it got (shown in /debug/steps).
NO_MODEL = "no_model"  # the cost model is not fitted yet: the whole token budget
NO_DECODES = "no_decodes"  # nobody is mid-stream: no gap to protect, the whole token budget
ITL_CAP = "itl_cap"  # capped at the ITL target: the queue's first tokens are on time at the cap
PACED = "paced"  # on time at the cap, widened past the ITL target to keep pace with arriving prompts
BACKLOG = "backlog"  # the excursion bound: at the cap a queued first token is late, or a backlog still drains
BATCH = "batch"  # the whole token budget: the queue holds a batch that arrived together (fcfs's speed)


# A drain ends when every queued first token is predicted within this share of its TTFT target at the cap.
DRAIN_EXIT_SHARE = 0.5
# A drain starts when a queued first token is predicted later than this share of its target at the cap, and
# its step is the smallest that gets every one within it. 0.8 once allowed for predictions ~1.2x short at
# P90; they now run 1.03-1.12x. Replayed over ten arrival draws per cell (benchmarks/policy_replay.py, with
# steps scattered 5 %), planning to the targets themselves drained less often and less: goodput rose in
# every cell, steady@0.7 ITL P99/P50 fell from 1.9-7.5x to 1.6-4.7x, storm@0.7's met 2x in 4 draws of 10
# instead of 1, and burst TTFT stayed level. The price is TTFT P99 at 0.7x load, 10-20 % later.
BACKLOG_SHARE = 1.0
# Pacing widens a step to at most this many times the typical decodes' own predicted duration. Prompts
# arriving faster than these steps prefill queue up, on time within their TTFT targets or drained as a
# backlog. 2 kept paced steps within the ITL rule's 2x of a decode-only step, but on this machine's steady
# traffic at 70% load (prompt rows ~70% of all rows) such steps fell behind the arrivals every few seconds,
# and the drains were the tail (benchmarks/default_policy.py, README). 3 let the paced step follow the
# typical width: served on an AVX2 EPYC, steady@0.7's pace went from 26 to 60 ms as the width rose from 1.3
# to 2.8 decodes, and those steps were its ITL P99 (2.8x the P50). Replayed with steps scattered as served
# ones are (15 %: actual/predicted P10-P90 0.81-1.19), 2.5 met steady@0.7's ITL rule in 13, 8 and 4 draws of
# 20 (AVX2 law twice, Zen 4 law) instead of 6, 4 and 2, storm@0.7's max rule in 26 of 60 instead of 20, and
# raised goodput in every steady and storm cell; storm@0.7's ITL rule went 16 -> 13 of 60, TTFT P50 ~15 %
# later. Since stop 51 it is 2 again: a drain that saves nobody no longer takes the excursion bound
# (FUTILE_DRAIN_FACTOR), so the queue a slower pace leaves costs a small step, not the tail. Replayed (12
# draws, the three laws: an AMX Xeon's, the AVX2 EPYC's, Zen 4's), 2 against 2.5 met steady@0.7's ITL rule
# in 6 / 6 / 2 draws instead of 0 / 5 / 1, storm@0.7's in 3 / 3 / 3 instead of 4 / 1 / 3 and its max rule in
# 3 / 6 / 6 instead of 6 / 4 / 5, raised goodput in every steady and storm cell (storm@0.7 +15 / +13 / +9 %),
# and cost 26-43 % of steady@0.7's TTFT P50 (and two of Zen 4's burst@0.7 TTFT draws: 9 of 12 met). Served
# twice on the Xeon (steady + storm at 0.7x): steady 1.53x and 1.57x (intervals 1.44-1.78 and 1.46-1.75,
# wholly below 2; 2.09-2.18x at 2.5), storm 2.15x and 2.00x with max 3.74x and 2.55x.
MAX_PACED_FACTOR = 2.0
# A drain whose widest step gets no more first tokens on time than a step of this many times the capped (or
# paced) one takes that step (never slower than the arrivals): the bound's excursion buys nothing then. It
# took the bound before, and in a served storm@0.7 on an AMX Xeon two such steps (447 and 344 ms, one late
# request predicted on time either way) were the ITL max, 10.7x the P50. Replayed over 12 draws per cell
# with three machines' cost laws (that Xeon's, the AVX2 EPYC's, Zen 4's; noise 0.15, correlation 0.5), the
# median storm@0.7 max fell from 8.7 / 8.8 / 3.7x the P50 to 3.0 / 3.7 / 3.7x and its max rule passed in
# 6 / 4 / 5 draws instead of 1 / 3 / 5; Zen 4's steady@0.7 max went from 8.7 to 3.0x, the EPYC's steady@0.7
# ITL rule passed in 5 draws instead of 3; the burst rules held. The cost is goodput where backlogs persist:
# storm@0.7 4 % lower on the Xeon's law, storm@1.5 9 % lower on the EPYC's, still >= fcfs in the same draws.
# 2.5 kept more of the goodput but left the storm max at 4.5x on the Xeon's law (2 draws of 12).
FUTILE_DRAIN_FACTOR = 1.5
# A drain's excursion bound is at most `max_drain_step_factor` (default 2, pacing's own bound, MAX_PACED_FACTOR)
# x the typical decodes' own step: X·T alone (10 x 1.5 x the step's decodes) let a drain run to ~15 decode-only
# steps, and wherever the queue turned into a backlog those steps were the token-gap tail. Keeping pace with the
# arrivals is not bounded by it. Replayed in stop 52 over 40 fresh draws per cell (seeds 200+, noise 0.15,
# correlation 0.5) with three machines' laws (an AMX Xeon's, the AVX2 EPYC's, Zen 4's), against no such bound:
# steady@0.7's ITL rule passed in 15 / 14 / 5 draws instead of 10 / 10 / 4, storm@0.7's in 26 / 18 / 14 instead
# of 20 / 16 / 16 and its max rule in 33 / 31 / 30 instead of 19 / 27 / 26; goodput rose in every steady, storm
# and shared cell at 0.7x, output tok/s stayed level everywhere, TTFT P99 at 0.7x rose 0-15 % (shared@0.7 on
# the Xeon's law 52 %). Bounding the arrivals' pace as well (unless even whole-budget steps fell behind
# them) doubled those ITL passes in replay, but served on steady@1.5, an overload of decodes that prefill keeps
# pace with, it held the batch at 12 decodes (steps ~2x those decodes' 45 ms) while 50 requests waited: 0.73x
# fcfs's output tok/s, TTFT P99 21 s against 2.5 s. Bounding every overload step passed both 1.5x ITL rules in
# 4-11 draws of 12 instead of none, at 0.71-0.86x fcfs's output tok/s there.
# A drain that gets no queued first token on time with this many requests queued or more is an overload's
# backlog, held at the full batch's step. Served storm@1.5 on an AMX Xeon over 120 s (prompts arriving 1.5x
# faster than this host prefills them): after 40 s of drains at 4-13 decodes while the queue grew to ~25, and
# 80 s at the full batch's step while it grew to ~80, the arrivals stopped, their demand left its window,
# and ~46 waiting requests drained at ~60 ms steps of 3-6 decodes: ITL P99 3.31x the P50 where fcfs's settled
# at 1.81x; held, 1.66x against fcfs's 1.84x, at 0.96x fcfs's output tok/s (0.92x before) and TTFT P99 1.26x
# fcfs's (1.54x). Replayed over 120 s (6 draws; an AMX Xeon's law / the AVX2 EPYC's) the ratio's median went from
# 2.20 / 4.31 to 1.65 / 1.88, passing in 6 / 4 draws instead of 1 / 0, at 0.98x fcfs's output tok/s instead
# of 0.95x. Over 40 s (12 draws) only storm@1.5 moved: 3.45 -> 2.49 on the Xeon's law, 6.40 -> 6.39 on the
# EPYC's. At 8, steady@1.5 and shared@0.7 moved too (the Xeon's law: shared@0.7's median max 2.6 -> 3.1x); at
# 20, storm@1.5 over 40 s less (2.93).
OVERLOAD_BACKLOG_REQUESTS = 12
# Chunk sizes a drain that gets no queue on time compares grow by this factor (most_on_time).
SEARCH_GROWTH = 1.25


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
    paced_step_ms: float | None = None  # the one duration paced steps take (None: no pacing this step)
    typical_decodes: float = 0.0  # decodes in a typical recent step, which the paced duration is sized at
    drain_bound_ms: float | None = None  # a backlog drain's widest step this time (None: not a drain)
    full_batch_step_ms: float | None = None  # the full batch's step, which bounds a drain (None: not known yet)

    @property
    def target_seconds(self) -> float | None:
        return None if self.step_target_ms is None else self.step_target_ms / 1000.0


def auto_ttft_seconds(cost_model: StepCostModel, prompt_tokens: int, auto_factor: float,
                      start_position: int = 0) -> float:
    """A request's auto TTFT target (`--ttft-target-ms auto`): `auto_factor` x the predicted prefill alone of
    the `prompt_tokens` it computes from `start_position` (its prefix-cache hit; the model must be fitted).
    Where it starts matters: a suffix behind a cached system prompt attends to all of it, and where every
    prompt does (shared-prefix traffic) the fit cannot tell a token's cost from its attention's, so the
    same suffix priced at position 0 came out at a tenth of its cost."""
    return auto_factor * cost_model.predict(StepShape().plus(prompt_tokens, start_position))


def choose_budget(cost_model: StepCostModel, decodes: StepShape, token_budget: int, itl_target: float,
                  queue: list[QueuedPrefill], fresh_decodes: int, max_excursion: float,
                  draining: bool = False, min_chunk: int = 1, demand: float = 0.0,
                  typical: StepShape | None = None, demand_start: int = 0,
                  batch: bool = False, max_drain_factor: float = 0.0, overload_step: float = 0.0) -> BudgetDecision:
    """The module docstring's rule for a step whose decodes have shape `decodes` and `token_budget` tokens
    left; `fresh_decodes` of them have had no gap over their ITL target yet; `draining`: the last step drained
    a backlog; `min_chunk`: prefill tokens a step computes even past the cap; `demand`: prompt tokens
    arriving per second, which the cap keeps pace with; `typical`: the decodes of a typical recent step
    (titan.engine.prefill_demand.TypicalDecodes), which pacing sizes its step duration at (default: these);
    `demand_start`: the position the arriving prompt tokens typically start at (their prefix-cache hits);
    `batch`: the queue holds an arrival batch (titan.engine.prefill_demand.ArrivalBatches), drained as one;
    `max_drain_factor`: the bound on a drain's excursion as a multiple of the typical decodes' own step (0: none);
    `overload_step`: the full batch's step (titan.engine.overload), which an overload is held at (0: none).
    The queue's tokens are priced at the position they start at on average (`queued_start`)."""
    position = queued_start(queue)
    forecast = QueueForecast(queue, decode_growth(cost_model, queue))

    def tokens_within(target: float) -> int:
        return cost_model.max_chunk(decodes, position, token_budget, target)

    def step_of(tokens: int) -> float:
        return cost_model.predict(decodes.plus(tokens, position))

    ms = 1000.0
    capped = tokens_within(itl_target)
    pacing = bool(queue) and max_excursion > 1.0
    typical = decodes if typical is None else typical
    paced = paced_chunk(cost_model, typical, token_budget, DEMAND_HEADROOM * demand, demand_start) if pacing else 0
    reason, cap_target = ITL_CAP, itl_target
    # One step duration for every step, sized at the typical decodes: a narrow step takes a bigger chunk, a
    # wide one a smaller, so the token gap does not follow the width. Pacing widens the cap only so far:
    # past that the arrivals build a queue, which the TTFT targets absorb.
    pace = min(cost_model.predict(typical.plus(paced, demand_start)),
               MAX_PACED_FACTOR * cost_model.predict(typical)) if paced else 0.0
    # To the nearest token, not the last one within: a token is a fifth of a narrow step here, and always
    # rounding down would pace a step of one decode at half the arrivals' rate.
    paced_within = tokens_within(pace + 0.5 * cost_model.marginal_token_cost(position)) if paced else 0
    paced_ms = pace * ms if paced else None
    if paced_within > capped:
        reason, capped = PACED, paced_within
        cap_target = step_of(paced_within)
    first_target = queue[0].ttft_target * ms if queue else None
    floor = max(capped, min(min_chunk, token_budget))
    floor_step = step_of(floor)
    met_capped = forecast.met(floor, floor_step)
    # A drain starts once the cap would get a queued first token later than the drain aims for (BACKLOG_SHARE
    # of its target). Started earlier, at 0.8, it made fewer jumps (a 130 ms step among 16 ms ones) but
    # drained more often, and its steps were the ITL tail. It ends once the queue is on time at the cap with
    # half its targets to spare: otherwise a backlog hovers at its targets, switching between cap and drain
    # step after step.
    share = DRAIN_EXIT_SHARE if draining else BACKLOG_SHARE
    on_time = forecast.met(floor, floor_step, share) == len(queue)
    # A batch that arrived together is one job, done when its last request is: on time or not, it is drained
    # at whole-budget steps, as fcfs would, not spread over its TTFT targets. On an AVX2-only EPYC (prompt
    # tokens 2.7x dearer than on Zen 4) a burst at 0.7x load is small next to its targets and was on time
    # at the cap: spread to them, its last first token came 1.36x fcfs's (served; 1.3-1.7x replayed).
    if not queue or token_budget <= capped or max_excursion <= 1.0 or (on_time and not batch):
        return BudgetDecision(reason, cap_target * ms, itl_target * ms, first_target, capped, len(queue),
                              met_capped, met_capped, 0, demand, paced_ms, typical.num_sequences)
    if batch:
        whole = step_of(token_budget)
        return BudgetDecision(BATCH, whole * ms, itl_target * ms, first_target, token_budget, len(queue), met_capped,
                              forecast.met(token_budget, whole), fresh_decodes, demand, paced_ms,
                              typical.num_sequences)
    # A drain is never slower than the arrivals (the whole budget under an overload, as fcfs), and within
    # that bound takes the smallest step that gets the queue on time, so a small backlog costs a small
    # excursion rather than the bound's. The arrivals themselves, without pacing's headroom: with it, one long
    # prompt in the window read as an overload and a drain step took the whole budget (~1 s).
    keeping_up = paced_chunk(cost_model, decodes, token_budget, demand, demand_start)
    excursion = max_excursion * itl_target
    if max_drain_factor:
        # The excursion stays within pacing's reach of the typical step, so the decodes' gaps stay near their
        # usual one while a backlog drains; keeping pace with the arrivals is not bounded by it (without that,
        # an overload of decodes kept the batch narrow and gave up 27 % of fcfs's output tok/s, served).
        excursion = min(excursion, max_drain_factor * cost_model.predict(typical))
    widest = min(max(excursion, cap_target, step_of(keeping_up)), step_of(token_budget))
    if overload_step > 0:
        # No drain runs past the full batch's own step (titan.engine.overload): under an overload keeping pace
        # asks for the whole budget, and those steps (860 ms while the batch grew, against ~185-450 ms once
        # it was full) were the token-gap tail.
        widest = min(widest, max(overload_step, excursion, cap_target))
    widest_tokens = tokens_within(widest)
    tokens = smallest_on_time(forecast, floor, widest_tokens, step_of)
    if tokens is None and overload_step > 0 and len(queue) >= OVERLOAD_BACKLOG_REQUESTS:
        # An overload's backlog: at the futile drain's step its requests wait longer still, and the batch
        # stays a few decodes wide; at the full batch's step it fills and settles, as fcfs's does.
        widest = min(max(widest, overload_step), step_of(token_budget))
        widest_tokens = tokens = tokens_within(widest)
    if tokens is None:
        futile = tokens_within(min(widest, FUTILE_DRAIN_FACTOR * cap_target))
        moderate = max(floor, min(keeping_up, widest_tokens), futile)
        tokens = most_on_time(forecast, floor, widest_tokens, step_of, moderate)
    bound = widest if tokens == widest_tokens else max(step_of(tokens), cap_target)
    itl_cost = fresh_decodes if bound > cap_target else 0
    return BudgetDecision(BACKLOG, bound * ms, itl_target * ms, first_target, tokens, len(queue), met_capped,
                          forecast.met(tokens, step_of(tokens)), itl_cost, demand, paced_ms,
                          typical.num_sequences, widest * ms, overload_step * ms if overload_step > 0 else None)


def most_on_time(forecast: QueueForecast, low: int, high: int, step_of: Callable[[int], float],
                 default: int | None = None) -> int:
    """With no chunk in [low, high] getting the queue on time: `default` (or `high`, the drain's widest step,
    as fcfs under an overload) unless another chunk is predicted to get more first tokens within their
    targets, then the smallest of those. A whole-budget step makes every request wait for all of it: one late
    long prompt queued with short ones on time at the cap took a 0.9 s step that got one fewer of them on
    time; and where the widest step saves nobody, it is an excursion for nothing (FUTILE_DRAIN_FACTOR)."""
    start = high if default is None else default
    best, best_met = start, forecast.met(start, step_of(start))
    tokens = max(low, 1)
    while True:
        # The starting chunk is already counted; a forecast is a walk over the whole queue.
        met = forecast.met(tokens, step_of(tokens)) if tokens != start else best_met
        if met > best_met:
            best, best_met = tokens, met
        if tokens >= high:
            return best
        tokens = min(high, max(tokens + 1, math.ceil(SEARCH_GROWTH * tokens)))


def smallest_on_time(forecast: QueueForecast, low: int, high: int, step_of: Callable[[int], float]) -> int | None:
    """The fewest prefill tokens per step, in [low, high], with which every queued first token is predicted
    within BACKLOG_SHARE of its target (steps of `step_of` seconds); None if even `high` is not enough. Steps
    count as a fraction (`QueueForecast.first_token_seconds`)."""

    def on_time(tokens: int) -> bool:
        return forecast.met(tokens, step_of(tokens), BACKLOG_SHARE, whole_steps=False) == forecast.size

    low = max(low, 1)
    if low > high or not on_time(high):
        return None
    # a step's time per token falls as its fixed cost is shared by more tokens
    return smallest_passing(low, high, on_time)
