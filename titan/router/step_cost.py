"""A backend's step costs from its scraped step metrics, for the score policy's predicted TTFT.

Between two scrapes a backend ran Δsteps steps computing Δtokens tokens in Δseconds. Over the recent
intervals the router fits Δseconds ≈ overhead·Δsteps + per_token·Δtokens (least squares, both ≥ 0): a
decode-heavy interval then prices the per-step overhead and a prefill-heavy one the per-token cost, so a
short prompt is not priced as if each of its tokens were a whole decode step.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from titan.bench.metrics_scraper import parse_prometheus_text, read_lines

STEP_SUM = "titan:engine_step_seconds_sum"
STEP_COUNT = "titan:engine_step_seconds_count"
TOKENS_SUM = "titan:iteration_tokens_total_sum"
INTERVALS = 30  # recent scrape intervals in the fit


@dataclass(frozen=True)
class StepTotals:
    seconds: float
    steps: float
    tokens: float


def step_totals(text: str) -> StepTotals | None:
    """Cumulative step seconds, step count and computed tokens (summed over label sets); None if absent."""
    found: dict[str, float] = {}
    for sample in parse_prometheus_text(read_lines(text, (STEP_SUM, STEP_COUNT, TOKENS_SUM))):
        if sample.name in (STEP_SUM, STEP_COUNT, TOKENS_SUM):
            found[sample.name] = found.get(sample.name, 0.0) + sample.value
    if len(found) < 3:
        return None
    return StepTotals(found[STEP_SUM], found[STEP_COUNT], found[TOKENS_SUM])


class StepCost:
    def __init__(self) -> None:
        self.last: StepTotals | None = None
        self.intervals: deque[tuple[float, float, float]] = deque(maxlen=INTERVALS)  # (steps, tokens, seconds)
        self.overhead: float | None = None  # seconds per step
        self.per_token: float | None = None  # seconds per computed token

    def update(self, totals: StepTotals | None) -> None:
        if totals is None:
            return
        last, self.last = self.last, totals
        if last is None:
            return
        steps, tokens, seconds = totals.steps - last.steps, totals.tokens - last.tokens, totals.seconds - last.seconds
        if steps < 0 or tokens < 0:  # the backend restarted: its counters began again
            self.intervals.clear()
            self.overhead = self.per_token = None
            return
        if steps > 0 and tokens > 0 and seconds > 0:
            self.intervals.append((steps, tokens, seconds))
            self.fit()

    def fit(self) -> None:
        data = np.asarray(self.intervals)
        design, target = data[:, :2], data[:, 2]
        if len(data) >= 2 and np.linalg.matrix_rank(design) == 2:
            (overhead, per_token), *_ = np.linalg.lstsq(design, target, rcond=None)
            if overhead >= 0 and per_token > 0:
                self.overhead, self.per_token = float(overhead), float(per_token)
                return
        if self.per_token is not None and self.overhead is not None:
            return  # too alike to tell the two apart (e.g. decode only): keep the last fit that could
        # Nothing to go on yet: every second priced per token.
        self.overhead, self.per_token = 0.0, float(target.sum() / data[:, 1].sum())
