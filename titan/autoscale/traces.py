"""Traffic for the simulator: a request-rate curve (generated or from CSV) turned into seeded arrivals.

CSV traces come in two shapes, told apart by the header:

- `time_s,rate_rps`: the request rate at those times, linear in between; the trace ends at the last row.
- `arrival_s[,work]`: one row per request (e.g. taken from an access log); `work` is the request's size
  relative to the mean request of the capacity profile (default 1).

Generated patterns: `constant`, `diurnal` (a cosine day from `base_rate` at the trough to `peak_rate`, one
cycle per `period`), `bursty` (`base_rate` with a `burst_length` burst at `peak_rate` every `period`) and
`step` (base, peak for the middle third, base again).
"""

from __future__ import annotations

import bisect
import csv
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

PATTERNS = ("constant", "diurnal", "bursty", "step")


@dataclass(frozen=True)
class Arrival:
    time: float
    work: float = 1.0  # relative size: a request of work 2 takes twice the mean request's service


@dataclass(frozen=True)
class RateTrace:
    times: tuple[float, ...]  # increasing knots, seconds
    rates: tuple[float, ...]  # requests per second at each knot, linear in between
    name: str = "trace"

    def __post_init__(self) -> None:
        if len(self.times) < 2 or len(self.times) != len(self.rates):
            raise ValueError("a rate trace needs at least two (time, rate) points")
        if any(b <= a for a, b in zip(self.times, self.times[1:], strict=False)):
            raise ValueError("trace times must increase")
        if any(rate < 0 or not math.isfinite(rate) for rate in self.rates):
            raise ValueError("trace rates must be finite and >= 0")

    @property
    def duration(self) -> float:
        return self.times[-1]

    def rate_at(self, time: float) -> float:
        if time <= self.times[0]:
            return self.rates[0]
        if time >= self.times[-1]:
            return self.rates[-1]
        index = bisect.bisect_right(self.times, time)
        left, right = self.times[index - 1], self.times[index]
        share = (time - left) / (right - left)
        return self.rates[index - 1] + share * (self.rates[index] - self.rates[index - 1])

    def expected_requests(self) -> float:
        return sum((b - a) * (ra + rb) / 2 for a, b, ra, rb in
                   zip(self.times, self.times[1:], self.rates, self.rates[1:], strict=False))


def constant(rate: float, duration: float) -> RateTrace:
    return RateTrace((0.0, duration), (rate, rate), f"constant {rate:g} req/s")


def diurnal(base_rate: float, peak_rate: float, period: float, duration: float,
            knots_per_period: int = 96) -> RateTrace:
    step = period / knots_per_period
    times = np.arange(0.0, duration + step / 2, step)
    rates = base_rate + (peak_rate - base_rate) * (1 - np.cos(2 * math.pi * times / period)) / 2
    return RateTrace(tuple(times.tolist()), tuple(rates.tolist()),
                     f"diurnal {base_rate:g}-{peak_rate:g} req/s")


def bursty(base_rate: float, peak_rate: float, period: float, burst_length: float, duration: float,
           edge: float = 1.0) -> RateTrace:
    """A burst starts half a period in (after a quiet stretch), then one every period."""
    if not 0 < burst_length < period - 2 * edge:
        raise ValueError("need 0 < burst_length < period - 2 s")
    times, rates = [0.0], [base_rate]
    start = period / 2
    while start < duration:
        corners = ((start, base_rate), (start + edge, peak_rate), (start + edge + burst_length, peak_rate),
                   (start + 2 * edge + burst_length, base_rate))
        for time, rate in corners:
            if time < duration:
                times.append(time)
                rates.append(rate)
        start += period
    if times[-1] < duration:
        times.append(duration)
        rates.append(rates[-1])
    return RateTrace(tuple(times), tuple(rates), f"bursty {base_rate:g}/{peak_rate:g} req/s")


def step(base_rate: float, peak_rate: float, duration: float, edge: float = 1.0) -> RateTrace:
    third = duration / 3
    times = (0.0, third, third + edge, 2 * third, 2 * third + edge, duration)
    rates = (base_rate, base_rate, peak_rate, peak_rate, base_rate, base_rate)
    return RateTrace(times, rates, f"step {base_rate:g}->{peak_rate:g} req/s")


def generate(pattern: str, base_rate: float, peak_rate: float, duration: float, period: float,
             burst_length: float) -> RateTrace:
    if pattern == "constant":
        return constant(peak_rate, duration)
    if pattern == "diurnal":
        return diurnal(base_rate, peak_rate, period, duration)
    if pattern == "bursty":
        return bursty(base_rate, peak_rate, period, burst_length, duration)
    if pattern == "step":
        return step(base_rate, peak_rate, duration)
    raise ValueError(f"unknown pattern {pattern!r}; one of {', '.join(PATTERNS)}")


def work_sizes(count: int, cv: float, rng: np.random.Generator) -> np.ndarray:
    """Mean-1 request sizes with coefficient of variation `cv` (gamma distributed; 0: all equal)."""
    if cv <= 0:
        return np.ones(count)
    shape = 1.0 / cv**2
    return rng.gamma(shape, 1.0 / shape, size=count)


def sample_arrivals(trace: RateTrace, seed: int = 0, work_cv: float = 0.5) -> list[Arrival]:
    """A non-homogeneous Poisson process following the trace (thinning at the peak rate)."""
    rng = np.random.default_rng(seed)
    peak = max(trace.rates)
    if peak <= 0:
        return []
    expected = peak * trace.duration
    gaps = rng.exponential(1.0 / peak, size=int(expected + 10 * math.sqrt(expected) + 100))
    candidates = np.cumsum(gaps)
    candidates = candidates[candidates < trace.duration]
    rates = np.interp(candidates, trace.times, trace.rates)
    kept = candidates[rng.random(candidates.size) * peak < rates]
    sizes = work_sizes(kept.size, work_cv, rng)
    return [Arrival(float(time), float(size)) for time, size in zip(kept, sizes, strict=True)]


def load_trace_csv(path: str | Path) -> RateTrace | list[Arrival]:
    with open(path, newline="", encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle))
    if not rows:
        raise ValueError(f"{path}: empty trace")
    columns = set(rows[0])
    try:
        if {"time_s", "rate_rps"} <= columns:
            times = tuple(float(row["time_s"]) for row in rows)
            return RateTrace(times, tuple(float(row["rate_rps"]) for row in rows), Path(path).name)
        if "arrival_s" in columns:
            arrivals = [Arrival(float(row["arrival_s"]), float(row.get("work") or 1.0)) for row in rows]
            return sorted(arrivals, key=lambda arrival: arrival.time)
    except ValueError as error:
        raise ValueError(f"{path}: {error}") from error
    raise ValueError(f"{path}: need a 'time_s,rate_rps' or an 'arrival_s[,work]' header, "
                     f"got {sorted(columns)}")


def rate_series(arrivals: Sequence[Arrival], duration: float, window: float) -> tuple[np.ndarray, np.ndarray]:
    """Observed arrivals per second in consecutive windows (window midpoints, rates) for plots."""
    edges = np.arange(0.0, duration + window, window)
    counts, _ = np.histogram([arrival.time for arrival in arrivals], bins=edges)
    return (edges[:-1] + edges[1:]) / 2, counts / window
