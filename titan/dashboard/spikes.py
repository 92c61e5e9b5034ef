"""Live spike detection: an interval's P99 far above its recent typical value opens (or extends) a spike,
which is then attributed by the same rules `titan bench` uses (titan/bench/attribution.py)."""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from titan.bench.analysis import MIN_BASELINE_S, Spike
from titan.bench.attribution import AttributionContext, attribute
from titan.bench.metrics_scraper import MetricsSample


@dataclass
class LiveSpike:
    metric: str  # "ttft" | "itl" | "first_byte" ...
    start: float  # monotonic
    end: float
    peak: float  # seconds
    baseline: float
    causes: list[str] = field(default_factory=list)
    number: int = 0

    def to_json(self, clock_offset: float) -> dict[str, Any]:
        return {"id": self.number, "metric": self.metric, "start": self.start + clock_offset,
                "end": self.end + clock_offset, "peak_ms": self.peak * 1000, "baseline_ms": self.baseline * 1000,
                "magnitude": self.peak / self.baseline if self.baseline else None, "causes": self.causes}


class SpikeTracker:
    """Per metric: the recent interval P99s (bounded by `history`) and the last `max_spikes` spikes."""

    def __init__(self, history: int, max_spikes: int, factor: float = 3.0, min_intervals: int = 5) -> None:
        self.factor = factor
        self.min_intervals = min_intervals  # no verdict before this many intervals set a baseline
        self.recent: dict[str, deque[float]] = {}
        self.history = history
        self.spikes: deque[LiveSpike] = deque(maxlen=max_spikes)
        self.open: dict[str, LiveSpike] = {}
        self.count = 0

    def observe(self, metric: str, start: float, end: float, p99: float | None) -> LiveSpike | None:
        """One interval's P99 (None: no observation in it, which neither opens nor closes a spike)."""
        if p99 is None:
            return self.open.get(metric)
        recent = self.recent.setdefault(metric, deque(maxlen=self.history))
        baseline = max(statistics.median(recent), MIN_BASELINE_S) if recent else 0.0
        hot = len(recent) >= self.min_intervals and p99 > self.factor * baseline
        spike = self.open.get(metric)
        if hot:
            if spike is None:
                self.count += 1
                spike = LiveSpike(metric, start, end, p99, baseline, number=self.count)
                self.open[metric] = spike
                self.spikes.append(spike)
            else:  # the spike goes on; its baseline stays the one it was judged against
                spike.end, spike.peak = end, max(spike.peak, p99)
        else:
            self.open.pop(metric, None)
            recent.append(p99)  # a spike's own intervals do not raise the baseline
        return spike if hot else None


def attribute_live(spike: LiveSpike, scrapes: Sequence[MetricsSample], steps: Sequence[dict[str, Any]],
                   ready_t: float | None) -> None:
    """Fill `spike.causes` from gauges (`scrapes`) and engine step records, all on the monotonic clock."""
    probe = Spike(metric=spike.metric, start=spike.start, end=spike.end, peak=spike.peak, max=spike.peak,
                  magnitude=spike.peak / max(spike.baseline, MIN_BASELINE_S), threshold=spike.baseline,
                  samples_over=0, requests=0)
    interval = 1.0
    if len(scrapes) >= 2:
        interval = max(statistics.median(b.t - a.t for a, b in zip(scrapes, scrapes[1:], strict=False)), 0.1)
    attribute(probe, AttributionContext(results=[], scrapes=scrapes, scrape_interval=interval,
                                        server_steps=steps, server_ready_t=ready_t))
    spike.causes = probe.causes


def monotonic_offset() -> float:
    """Add to a monotonic time to get wall-clock time (what the browser's charts use)."""
    return time.time() - time.monotonic()
