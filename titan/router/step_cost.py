"""A backend's cost per computed token, from its scraped step metrics (for the score policy's TTFT)."""

from __future__ import annotations

from titan.bench.metrics_scraper import parse_prometheus_text

STEP_SUM_NAMES = ("titan:engine_step_seconds_sum",)
TOKENS_SUM_NAMES = ("titan:iteration_tokens_total_sum",)
SMOOTHING = 0.3  # weight of the newest interval in the moving average


def step_totals(text: str) -> tuple[float, float] | None:
    """(seconds spent in engine steps, tokens they computed), summed over label sets; None if not exposed."""
    seconds = tokens = None
    for sample in parse_prometheus_text(text):
        if sample.name in STEP_SUM_NAMES:
            seconds = (seconds or 0.0) + sample.value
        elif sample.name in TOKENS_SUM_NAMES:
            tokens = (tokens or 0.0) + sample.value
    if seconds is None or tokens is None:
        return None
    return seconds, tokens


class StepCost:
    """Seconds per computed token, averaged over the intervals between scrapes that computed something."""

    def __init__(self) -> None:
        self.last: tuple[float, float] | None = None
        self.value: float | None = None

    def update(self, totals: tuple[float, float] | None) -> float | None:
        if totals is None:
            return self.value
        if self.last is not None:
            seconds, tokens = totals[0] - self.last[0], totals[1] - self.last[1]
            if tokens > 0 and seconds > 0:
                newest = seconds / tokens
                self.value = newest if self.value is None else SMOOTHING * newest + (1 - SMOOTHING) * self.value
            elif tokens < 0:  # the backend restarted: its counters began again
                self.value = None
        elif totals[1] > 0 and totals[0] > 0:
            self.value = totals[0] / totals[1]
        self.last = totals
        return self.value
