"""How fast prompt tokens arrive, so the slo policy's cap keeps pace with steady traffic.

A cap sized by the ITL target alone holds a handful of prompt tokens per step. Under steady traffic that
prefills slower than the prompts arrive: every few seconds the queue turns into a backlog and is drained
with long steps, and those few drain steps are the token-gap tail. Pacing instead spreads the same prefill
work evenly over the steps: each capped step computes at least the tokens that keep up with the arrival
rate measured over the last `window_seconds` (with DEMAND_HEADROOM to spare), so the queue stays on time
and the steps look alike. Under an overload no chunk keeps pace and the steps take the whole budget, as
fcfs's do.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from titan.engine.cost_model import StepCostModel, StepShape, smallest_passing, within

# Prefill at least this much faster than prompts arrive: arrivals are bursty (Poisson), and a cap that only
# matched the mean would let the queue's random walk reach a backlog anyway. Paced at 1.25x, the prefill ran
# at 80 % utilisation and its queueing was most of a request's TTFT: replayed (Zen 4 cost law, 40 draws),
# 2x took steady@0.7's TTFT P50 from 3.3x to 2.5x fcfs's (shared-prefix 2.9x to 2.0x) and met the ITL rule
# in 22 draws instead of 13; goodput 1-2 % lower, still ~2.8x fcfs's. On the AVX2 EPYC the pace's cap
# (MAX_PACED_FACTOR) binds first and little changed.
DEMAND_HEADROOM = 2.0
MIN_SPAN_SHARE = 0.25  # the shortest span a rate is measured over, as a share of the window
MAX_TRACKED_ARRIVALS = 4096  # bounds the memory whatever the arrival rate
# The typical decodes average the steps of about this many recent seconds (exponentially weighted): long
# enough that a few wide or narrow steps do not move the pace, short enough to follow the load.
TYPICAL_DECODES_SECONDS = 5.0
# Requests arriving within this many seconds of the first of them are one batch (a client that fans out, an
# eval job, `titan bench --preset burst`). A 20 ms chain (each within 20 ms of the one before) missed bursts
# the bench sent within 10 ms (AVX2 EPYC, burst@0.7: 4 batch steps in the cell, TTFT P99 1.49x fcfs's); the
# server stamps arrivals in its HTTP handlers, and those stamps landed further apart.
BATCH_WINDOW_SECONDS = 0.1
# A batch is a cluster that the recent Poisson traffic would bring by chance in fewer than this share of
# arrivals. Four arrivals within 0.1 s come once in ~2,000 requests at 1.5 req/s, but once in ~130 at 4 req/s:
# served storm@1.5 (AMX Xeon, ~4 req/s) met such a cluster once a cell, and its members, queued behind ~26
# others, kept the whole budget (~800 ms steps against a ~130 ms P50) until most of the queue was prefilled.
# A batch now takes 4 up to 0.8 req/s, 5 up to 2.3, 6 up to 4.4, 7 up to 7 (benchmarks/default_policy.py's
# bursts are 12-26).
CHANCE_CLUSTER_SHARE = 1e-4
BATCH_RATE_WINDOW_SECONDS = 10.0  # the arrival rate a cluster is judged against is over this many seconds


@dataclass(slots=True)
class _Arrival:
    time: float
    seq_id: int
    tokens: int  # still counted: the prompt less what the prefix cache held
    cached: int  # prompt tokens the prefix cache held when it arrived (already left out)


class PrefillDemand:
    """Prompt tokens to compute that arrived in the last `window_seconds`, per second."""

    def __init__(self, window_seconds: float) -> None:
        self.window_seconds = window_seconds
        self._arrivals: deque[_Arrival] = deque()  # oldest first
        self._by_seq: dict[int, _Arrival] = {}
        self._tokens = 0
        self._start_weighted = 0  # Σ tokens x the position they start at (after the prefix-cache hit)

    def record(self, seq_id: int, num_tokens: int, now: float, num_cached: int = 0) -> None:
        """A prompt of `num_tokens` arrived, `num_cached` of them in the prefix cache already: a prompt behind a
        hot system prompt is its suffix's work, also while it waits (counted whole, a few waiting ones read
        as a flood and paced the steps far past their token-gap target)."""
        if len(self._arrivals) >= MAX_TRACKED_ARRIVALS:
            self._drop_oldest()
        num_cached = min(num_cached, num_tokens)
        entry = _Arrival(now, seq_id, num_tokens - num_cached, num_cached)
        self._arrivals.append(entry)
        self._by_seq[seq_id] = entry
        self._count(entry)

    def discount(self, seq_id: int, num_cached: int) -> None:
        """When it was admitted `num_cached` of a recorded prompt's tokens were in the prefix cache: no work to
        pace past what it arrived with."""
        entry = self._by_seq.pop(seq_id, None)
        if entry is not None:
            taken = min(entry.tokens, max(num_cached - entry.cached, 0))
            self._forget(entry)
            entry.tokens -= taken
            entry.cached += taken
            self._count(entry)

    def rate(self, now: float) -> float:
        """Tokens per second over the window. After an idle spell the window is not full yet: the rate is
        over the time since the oldest arrival in it, but at least MIN_SPAN_SHARE of the window, so the
        first request of a busy spell does not look like a flood and the next ones are not taken for a
        trickle."""
        while self._arrivals and self._arrivals[0].time < now - self.window_seconds:
            self._drop_oldest()
        if not self._arrivals:
            return 0.0
        span = max(now - self._arrivals[0].time, MIN_SPAN_SHARE * self.window_seconds)
        return self._tokens / span

    def mean_tokens(self) -> float:
        """Tokens to compute per prompt, on average over those counted in `rate` (0 with none)."""
        return self._tokens / len(self._arrivals) if self._arrivals else 0.0

    def start_position(self) -> int:
        """The position the tokens counted in `rate` start at, on average over them (weighted by their count):
        behind a hot system prompt they all attend to it, which makes each of them dearer."""
        return round(self._start_weighted / self._tokens) if self._tokens > 0 else 0

    def _count(self, entry: _Arrival) -> None:
        self._tokens += entry.tokens
        self._start_weighted += entry.tokens * entry.cached

    def _forget(self, entry: _Arrival) -> None:
        self._tokens -= entry.tokens
        self._start_weighted -= entry.tokens * entry.cached

    def _drop_oldest(self) -> None:
        entry = self._arrivals.popleft()
        self._forget(entry)
        self._by_seq.pop(entry.seq_id, None)


class TypicalDecodes:
    """The decodes of a typical recent step: their shapes averaged, exponentially weighted by time.

    Pacing sizes one step duration for every step from it rather than a chunk per step: a step of narrow
    decodes takes a bigger chunk, one of wide decodes a smaller, and the token gap is the same whatever
    the width. The average keeps pace because a step's duration is linear in its shape. It is weighted by
    time, not by steps: after an overload's wide, long steps it follows the traffic within seconds rather
    than after hundreds of steps; and it restarts once the engine has gone idle (`forget`).
    """

    def __init__(self, time_constant_seconds: float = TYPICAL_DECODES_SECONDS) -> None:
        self.time_constant = time_constant_seconds
        self.shape: StepShape | None = None
        self._last: float | None = None

    def observe(self, decodes: StepShape, now: float) -> StepShape:
        """Fold in one step's decodes, scheduled at `now`; returns the typical shape now."""
        if self.shape is None or self._last is None:
            self.shape = decodes
        else:
            weight = 1.0 - math.exp(-max(now - self._last, 0.0) / self.time_constant)

            def mix(old: float, new: float) -> float:
                return old + weight * (new - old)

            self.shape = StepShape(mix(self.shape.num_tokens, decodes.num_tokens),
                                   mix(self.shape.num_sequences, decodes.num_sequences),
                                   mix(self.shape.attention_pairs, decodes.attention_pairs))
        self._last = now
        return self.shape

    def forget(self) -> None:
        """The engine went idle: the next step's decodes are typical (the shape stays until then). Weighted by
        time alone, a few seconds of idleness kept most of the last traffic's width: an overload's 38 decodes
        paced the first steps of the next, light traffic at 120-185 ms, three times 38 decodes' step, and
        those steps were its ITL P99."""
        self._last = None


def paced_chunk(cost_model: StepCostModel, decodes: StepShape, token_budget: int, tokens_per_second: float,
                start_position: int = 0) -> int:
    """The smallest prefill chunk whose step, beside `decodes`, computes prompt tokens (starting at
    `start_position`) at least at `tokens_per_second`; the whole budget when none keeps pace (an overload)."""
    if tokens_per_second <= 0 or token_budget <= 0:
        return 0

    def keeps_pace(chunk: int) -> bool:
        return within(tokens_per_second * cost_model.predict(decodes.plus(chunk, start_position)), chunk)

    if not keeps_pace(token_budget):
        return token_budget
    # chunk / step time grows with the chunk: the step's fixed cost is shared
    return smallest_passing(1, token_budget, keeps_pace)


class ArrivalBatches:
    """Which requests arrived together: within BATCH_WINDOW_SECONDS of the batch's first. A batch is one client's
    job, done when its last request is; the slo policy prefills it at whole-budget steps, as fcfs would
    (titan.engine.prefill_budget). A cluster counts as a batch only if it is bigger than the recent arrivals
    bring by chance (`_least_cluster`): under heavy Poisson traffic four requests within 0.1 s are routine.
    Batches are kept for the requests still in the scheduler (`forget`)."""

    def __init__(self) -> None:
        self._opened: float | None = None  # the open batch's first arrival
        self._current: list[int] = [0, 0]  # the open batch's size and the size a batch needed then, shared
        self._of: dict[int, list[int]] = {}
        self._recent: deque[float] = deque(maxlen=MAX_TRACKED_ARRIVALS)  # arrival times, oldest first

    def record(self, seq_id: int, now: float) -> None:
        if self._opened is None or now - self._opened > BATCH_WINDOW_SECONDS:
            self._opened, self._current = now, [0, self._least_cluster(now)]
        self._current[0] += 1
        self._of[seq_id] = self._current
        self._recent.append(now)

    def is_batch(self, seq_id: int, least: int) -> bool:
        """Whether `seq_id` arrived in a batch of `least` or more that chance does not explain."""
        batch = self._of.get(seq_id)
        return least > 0 and batch is not None and batch[0] >= max(least, batch[1])

    def forget(self, seq_id: int) -> None:
        self._of.pop(seq_id, None)

    def _least_cluster(self, now: float) -> int:
        """The smallest cluster (its first arrival and those within the window) that the arrival rate of the
        last BATCH_RATE_WINDOW_SECONDS brings by chance after fewer than CHANCE_CLUSTER_SHARE of arrivals."""
        while self._recent and self._recent[0] < now - BATCH_RATE_WINDOW_SECONDS:
            self._recent.popleft()
        return 1 + poisson_quantile(len(self._recent) / BATCH_RATE_WINDOW_SECONDS * BATCH_WINDOW_SECONDS,
                                    CHANCE_CLUSTER_SHARE)


def poisson_quantile(mean: float, tail: float) -> int:
    """The smallest n with P(N >= n) < `tail` for N ~ Poisson(`mean`). The mean here is at most
    MAX_TRACKED_ARRIVALS / BATCH_RATE_WINDOW_SECONDS x BATCH_WINDOW_SECONDS (~41); past ~700 exp(-mean) would
    underflow, and a normal bound stands in."""
    term = cumulative = math.exp(-mean)
    if term == 0.0:
        return math.ceil(mean + 6.0 * math.sqrt(mean))
    count = 1
    while 1.0 - cumulative >= tail:
        term *= mean / count
        cumulative += term
        count += 1
    return count
