"""When to send: open-loop arrival times (gamma renewal, linear ramp-up, periodic bursts).

The closed loop (`--max-concurrency`) is not an arrival process: the runner gates sends on a semaphore,
so with an infinite rate every request is due at t=0 and the semaphore alone paces them.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class ArrivalProcess:
    """Offsets (seconds from the run's start) at which requests are due.

    Gaps are gamma distributed with shape `burstiness` and mean 1/rate: shape 1 is a Poisson process,
    below 1 arrivals clump together, above 1 they become more regular. With `ramp_up` seconds the rate
    rises linearly from 0 to `rate`; with `burst_size` > 0 a burst of that many simultaneous requests is
    added every `burst_interval` seconds on top of the background traffic.
    """

    rate: float
    burstiness: float = 1.0
    ramp_up: float = 0.0
    burst_size: int = 0
    burst_interval: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.rate < 0 or math.isnan(self.rate):
            raise ValueError("request rate must be >= 0 (inf = all at once)")
        if self.burstiness <= 0:
            raise ValueError("burstiness must be > 0")
        if self.ramp_up < 0:
            raise ValueError("ramp-up must be >= 0")
        if self.burst_size > 0 and self.burst_interval <= 0:
            raise ValueError("bursts need a burst interval > 0")
        if self.rate == 0 and self.burst_size <= 0:
            raise ValueError("a zero rate sends nothing (add bursts or raise the rate)")

    def offsets(self) -> Iterator[float]:
        """Non-decreasing offsets, endless; the runner stops at --num-requests or --duration."""
        streams: list[Iterator[float]] = []
        if self.rate > 0:
            streams.append(self._background())
        if self.burst_size > 0:
            streams.append(self._bursts())
        return heapq.merge(*streams) if len(streams) > 1 else streams[0]

    def _background(self) -> Iterator[float]:
        if math.isinf(self.rate):
            return itertools.repeat(0.0)
        return (self._to_time(work) for work in self._renewal(random.Random(f"{self.seed}:arrivals")))

    def _renewal(self, rng: random.Random) -> Iterator[float]:
        """Event times of a unit-rate gamma renewal process (mean gap 1)."""
        total = 0.0
        while True:
            total += rng.gammavariate(self.burstiness, 1.0 / self.burstiness)
            yield total

    def _to_time(self, work: float) -> float:
        """Invert the expected arrival count Λ(t): rate·t²/(2·ramp) during the ramp, linear after it."""
        ramp_work = self.rate * self.ramp_up / 2
        if work < ramp_work:
            return math.sqrt(2 * self.ramp_up * work / self.rate)
        return self.ramp_up + (work - ramp_work) / self.rate

    def _bursts(self) -> Iterator[float]:
        for number in itertools.count(1):
            yield from itertools.repeat(number * self.burst_interval, self.burst_size)

    def expected_count(self, duration: float) -> float:
        """Mean number of arrivals in [0, duration) (for progress bars and tests)."""
        if math.isinf(self.rate):
            return math.inf
        if duration <= self.ramp_up:
            background = self.rate * duration**2 / (2 * self.ramp_up) if self.ramp_up else 0.0
        else:
            background = self.rate * (duration - self.ramp_up / 2)
        bursts = self.burst_size * math.ceil(duration / self.burst_interval - 1) if self.burst_size else 0
        return background + max(bursts, 0)
