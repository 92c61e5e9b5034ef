"""Numbers from a run: percentiles, goodput under an SLO, windowed percentiles, spikes and stalls.

Latencies are kept in seconds here and converted to milliseconds only in the dicts meant for people and
JSON. Every token gap and TTFT is placed on the timeline at the moment it was *observed* (the later
token's arrival); a spike's start reaches back to where its slowest gaps began.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from titan.bench.client import RequestResult

PERCENTILES = (50, 90, 95, 99)
# Below 1 ms a "median" mostly measures how the client's reads happened to group chunks.
MIN_BASELINE_S = 1e-3


def summarize(values: Sequence[float], scale: float = 1000.0) -> dict[str, float | int | None]:
    """count, mean, std, min, P50/P90/P95/P99, max; values scaled (seconds -> ms by default)."""
    summary: dict[str, float | int | None] = {"count": len(values)}
    keys = ("mean", "std", "min", *(f"p{p}" for p in PERCENTILES), "max")
    if not values:
        return summary | dict.fromkeys(keys)
    array = np.asarray(values, dtype=np.float64) * scale
    summary |= {"mean": float(array.mean()), "std": float(array.std()), "min": float(array.min())}
    for percentile, value in zip(PERCENTILES, np.percentile(array, PERCENTILES), strict=True):
        summary[f"p{percentile}"] = float(value)
    summary["max"] = float(array.max())
    return summary


@dataclass(frozen=True)
class Slo:
    """Per-request targets in seconds. `itl` bounds every token gap of a request (a single stall
    misses it); `tpot` bounds the mean time per output token."""

    ttft: float | None = None
    itl: float | None = None
    tpot: float | None = None
    e2e: float | None = None

    @classmethod
    def parse(cls, text: str) -> Slo:
        """`ttft=500,itl=100,e2e=10000`: milliseconds, or with an explicit `ms` / `s` suffix."""
        targets: dict[str, float] = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            key, separator, value = item.partition("=")
            key = key.strip().lower()
            if not separator or key not in cls.__dataclass_fields__:
                raise ValueError(f"bad SLO item {item!r}: use ttft=MS,itl=MS,tpot=MS,e2e=MS")
            value = value.strip().lower()
            try:
                seconds = float(value[:-2]) / 1000 if value.endswith("ms") else (
                    float(value[:-1]) if value.endswith("s") else float(value) / 1000)
            except ValueError:
                raise ValueError(f"bad SLO value {item!r}") from None
            if seconds <= 0:
                raise ValueError(f"SLO targets must be > 0: {item!r}")
            targets[key] = seconds
        if not targets:
            raise ValueError("empty SLO")
        return cls(**targets)

    def met_by(self, result: RequestResult) -> bool:
        if not result.success:
            return False
        checks = (
            (self.ttft, result.ttft),
            (self.e2e, result.e2e),
            # One output token has no time per token after the first: nothing to miss (vLLM's goodput reads 0)
            (self.tpot, 0.0 if result.tpot is None else result.tpot),
            (self.itl, max(result.itls, default=0.0)),
        )
        for target, value in checks:
            if target is not None and (value is None or value > target):
                return False
        return True

    def to_dict(self) -> dict[str, float]:
        return {key: getattr(self, key) * 1000 for key in self.__dataclass_fields__ if getattr(self, key)}


def goodput(results: Sequence[RequestResult], slo: Slo, duration: float) -> dict[str, Any]:
    good = sum(slo.met_by(result) for result in results)
    return {
        "slo_ms": slo.to_dict(),
        "good": good,
        "total": len(results),
        "attainment": good / len(results) if results else 0.0,
        "goodput_rps": good / duration if duration > 0 else 0.0,
    }


@dataclass(frozen=True)
class LatencySample:
    """One latency observed at `at` (seconds since start); it began at `at - value`."""

    at: float
    value: float
    request_index: int

    @property
    def start(self) -> float:
        return self.at - self.value


def itl_samples(results: Sequence[RequestResult]) -> list[LatencySample]:
    samples = [
        LatencySample(later, later - earlier, result.index)
        for result in results
        for earlier, later in zip(result.token_times, result.token_times[1:], strict=False)
    ]
    return sorted(samples, key=lambda sample: sample.at)


def ttft_samples(results: Sequence[RequestResult]) -> list[LatencySample]:
    samples = [LatencySample(r.token_times[0], r.token_times[0] - r.sent_at, r.index)
               for r in results if r.token_times]
    return sorted(samples, key=lambda sample: sample.at)


@dataclass(frozen=True)
class Window:
    start: float
    end: float
    count: int
    p50: float | None
    p99: float | None
    max: float | None

    def to_dict(self) -> dict[str, Any]:
        def ms(value: float | None) -> float | None:
            return None if value is None else value * 1000

        return {"start": self.start, "end": self.end, "count": self.count, "p50_ms": ms(self.p50),
                "p99_ms": ms(self.p99), "max_ms": ms(self.max)}


def _bucket(samples: Sequence[LatencySample], window: float, end_time: float) -> list[list[LatencySample]]:
    last = max([end_time, *(sample.at for sample in samples)], default=0.0)
    buckets: list[list[LatencySample]] = [[] for _ in range(int(last // window) + 1)]
    for sample in samples:
        buckets[int(sample.at // window)].append(sample)
    return buckets


def windowed_percentiles(samples: Sequence[LatencySample], window: float, end_time: float = 0.0) -> list[Window]:
    """Consecutive windows [k·w, (k+1)·w) from 0 to the last sample (or `end_time`); empty ones included."""
    windows = []
    for number, bucket in enumerate(_bucket(samples, window, end_time)):
        start, end = number * window, (number + 1) * window
        if not bucket:
            windows.append(Window(start, end, 0, None, None, None))
            continue
        values = np.asarray([sample.value for sample in bucket])
        p50, p99 = np.percentile(values, [50, 99])
        windows.append(Window(start, end, len(bucket), float(p50), float(p99), float(values.max())))
    return windows


@dataclass
class Spike:
    """A run of windows whose P99 exceeded `threshold` (= factor x the run's median)."""

    metric: str
    start: float
    end: float
    peak: float  # highest windowed P99, seconds
    max: float  # largest single sample, seconds
    magnitude: float  # peak / the run's median
    threshold: float
    samples_over: int
    requests: int  # distinct requests with a sample over the threshold
    causes: list[str] = field(default_factory=list)
    evidence: dict[str, Any] = field(default_factory=dict)

    @property
    def duration(self) -> float:
        return self.end - self.start

    def to_dict(self) -> dict[str, Any]:
        return {
            "metric": self.metric, "start_s": round(self.start, 4), "end_s": round(self.end, 4),
            "duration_s": round(self.duration, 4), "peak_p99_ms": self.peak * 1000, "max_ms": self.max * 1000,
            "magnitude": self.magnitude, "threshold_ms": self.threshold * 1000,
            "samples_over": self.samples_over, "requests": self.requests,
            "causes": self.causes, "evidence": self.evidence,
        }


def baseline(samples: Sequence[LatencySample]) -> float:
    return max(statistics.median(sample.value for sample in samples), MIN_BASELINE_S) if samples else 0.0


def detect_spikes(samples: Sequence[LatencySample], metric: str, window: float = 1.0,
                  factor: float = 3.0) -> list[Spike]:
    """Spikes: maximal runs of windows whose P99 > factor x median of all samples.

    Empty windows do not end a run (a stalled server produces no tokens until the stall ends); a
    non-empty window at or under the threshold does. A spike starts at the earlier of its first window
    and the start of its earliest over-threshold sample, and ends with its last hot window.
    """
    if not samples:
        return []
    median = baseline(samples)
    threshold = factor * median
    buckets = _bucket(samples, window, 0.0)
    runs: list[list[int]] = []
    current: list[int] = []
    for number, bucket in enumerate(buckets):
        if not bucket:
            continue
        if float(np.percentile([sample.value for sample in bucket], 99)) > threshold:
            current.append(number)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    spikes = []
    for run in runs:
        inside = [sample for number in range(run[0], run[-1] + 1) for sample in buckets[number]]
        over = [sample for sample in inside if sample.value > threshold]
        peak = max(float(np.percentile([sample.value for sample in buckets[n]], 99)) for n in run)
        start = max(0.0, min(run[0] * window, *(sample.start for sample in over)))
        spikes.append(Spike(
            metric=metric, start=start, end=(run[-1] + 1) * window, peak=peak,
            max=max(sample.value for sample in inside), magnitude=peak / median, threshold=threshold,
            samples_over=len(over), requests=len({sample.request_index for sample in over}),
        ))
    return spikes


@dataclass(frozen=True)
class Stall:
    request_index: int
    start: float
    duration: float

    def to_dict(self) -> dict[str, Any]:
        return {"request": self.request_index, "start_s": round(self.start, 4),
                "duration_ms": self.duration * 1000}


def detect_stalls(samples: Sequence[LatencySample], threshold: float) -> list[Stall]:
    """Token gaps longer than `threshold`, in order of when they began."""
    stalls = [Stall(s.request_index, s.start, s.value) for s in samples if s.value > threshold]
    return sorted(stalls, key=lambda stall: (stall.start, stall.request_index))


def error_summary(results: Sequence[RequestResult], examples_per_kind: int = 3) -> dict[str, Any]:
    failed = [result for result in results if not result.success]
    by_status = Counter("no response" if r.status == 0 else str(r.status) for r in failed)
    by_kind = Counter(r.error_kind or "unknown" for r in failed)
    examples: list[dict[str, Any]] = []
    shown: Counter[str] = Counter()
    for result in failed:
        kind = result.error_kind or "unknown"
        if shown[kind] < examples_per_kind:
            shown[kind] += 1
            examples.append({"request": result.index, "status": result.status, "kind": kind,
                             "message": result.error})
    return {"count": len(failed), "by_status": dict(by_status), "by_kind": dict(by_kind), "examples": examples}


def latency_summaries(results: Sequence[RequestResult]) -> dict[str, dict[str, Any]]:
    succeeded = [result for result in results if result.success]
    sent = [result for result in results if not math.isnan(result.sent_at)]
    return {
        "ttft": summarize([r.ttft for r in succeeded if r.ttft is not None]),
        "tpot": summarize([r.tpot for r in succeeded if r.tpot is not None]),
        "itl": summarize([gap for r in succeeded for gap in r.itls]),
        "e2e": summarize([r.e2e for r in succeeded if r.e2e is not None]),
        "client_wait": summarize([r.client_wait for r in sent]),
    }


def throughput(results: Sequence[RequestResult], duration: float) -> dict[str, Any]:
    succeeded = [result for result in results if result.success]
    output_tokens = sum(result.completion_tokens or 0 for result in succeeded)
    input_tokens = sum(r.prompt_tokens if r.prompt_tokens is not None else r.input_tokens_estimate
                       for r in succeeded)
    per_second = 1.0 / duration if duration > 0 else 0.0
    return {
        "requests": len(results),
        "succeeded": len(succeeded),
        "failed": len(results) - len(succeeded),
        "duration_s": duration,
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "request_throughput": len(succeeded) * per_second,
        "output_token_throughput": output_tokens * per_second,
        "total_token_throughput": (input_tokens + output_tokens) * per_second,
        "usage_reported": sum(result.usage_source == "usage" for result in succeeded),
    }
