"""Sliding-window figures from a Prometheus registry, without keeping per-request samples.

Each time the dashboard is polled it snapshots the registry (cumulative histogram buckets, counters,
gauges) into a history bounded by count. A window's P50/P99 is Prometheus' `histogram_quantile` over
the bucket deltas between now and the snapshot about `window` seconds ago, and a rate is a counter's
delta over a shorter span: the same figures a Grafana panel over `rate(...[30s])` would show, read from
the numbers the server already keeps.
"""

from __future__ import annotations

import bisect
import math
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry

Labels = tuple[tuple[str, str], ...]  # a series' labels, sorted, without `le`


@dataclass
class Snapshot:
    """One reading of the registry at `t` (time.monotonic())."""

    t: float
    values: dict[tuple[str, Labels], float] = field(default_factory=dict)  # counters, gauges, _sum, _count
    buckets: dict[tuple[str, Labels], list[tuple[float, float]]] = field(default_factory=dict)  # (le, count)

    def total(self, name: str, where: Callable[[Labels], bool] = lambda _: True) -> float | None:
        """Sum over the label sets of `name` that `where` accepts (None: no such series)."""
        found = [value for (metric, labels), value in self.values.items() if metric == name and where(labels)]
        return sum(found) if found else None

    def label_values(self, name: str, label: str) -> list[str]:
        seen = {dict(labels).get(label) for (metric, labels) in [*self.values, *self.buckets] if metric == name}
        return sorted(value for value in seen if value is not None)


def read_registry(registry: CollectorRegistry, now: float | None = None) -> Snapshot:
    snapshot = Snapshot(time.monotonic() if now is None else now)
    for family in registry.collect():
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "le"))
            if sample.name.endswith("_bucket") and "le" in sample.labels:
                base = sample.name[: -len("_bucket")]
                snapshot.buckets.setdefault((base, labels), []).append((float(sample.labels["le"]), sample.value))
            else:
                snapshot.values[(sample.name, labels)] = sample.value
    for series in snapshot.buckets.values():
        series.sort()
    return snapshot


def merged_buckets(snapshot: Snapshot, name: str, where: Callable[[Labels], bool]) -> list[tuple[float, float]]:
    """Cumulative buckets of `name` summed over the accepted label sets (all share one bucket layout)."""
    total: dict[float, float] = {}
    for (metric, labels), series in snapshot.buckets.items():
        if metric == name and where(labels):
            for bound, count in series:
                total[bound] = total.get(bound, 0.0) + count
    return sorted(total.items())


def histogram_quantile(quantile: float, buckets: list[tuple[float, float]]) -> float | None:
    """Prometheus' rule: linear interpolation inside the bucket holding the rank; None with no observations.
    A rank in the +Inf bucket answers the highest finite bound (a lower bound on the truth)."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = quantile * buckets[-1][1]
    counts = [count for _, count in buckets]
    index = bisect.bisect_left(counts, rank)
    index = min(index, len(buckets) - 1)
    upper, count_upper = buckets[index]
    if math.isinf(upper):
        finite = [bound for bound, _ in buckets if not math.isinf(bound)]
        return finite[-1] if finite else None
    lower, count_lower = (0.0, 0.0) if index == 0 else buckets[index - 1]
    if count_upper == count_lower:
        return upper
    return lower + (upper - lower) * (rank - count_lower) / (count_upper - count_lower)


def bucket_delta(new: list[tuple[float, float]], old: list[tuple[float, float]]) -> list[tuple[float, float]]:
    before = dict(old)
    return [(bound, count - before.get(bound, 0.0)) for bound, count in new]


class History:
    """The last `max_snapshots` readings (the bound is the dashboard's `--dashboard-history` flag)."""

    def __init__(self, registry_reader: Callable[[], Snapshot], max_snapshots: int) -> None:
        if max_snapshots < 2:
            raise ValueError("the dashboard history needs at least 2 snapshots")
        self.read = registry_reader
        self.snapshots: deque[Snapshot] = deque(maxlen=max_snapshots)

    def take(self) -> Snapshot:
        snapshot = self.read()
        self.snapshots.append(snapshot)
        return snapshot

    def at_or_before(self, t: float) -> Snapshot | None:
        """The newest snapshot taken at or before `t`, else the oldest one kept (a young history)."""
        chosen = None
        for snapshot in self.snapshots:
            if snapshot.t <= t:
                chosen = snapshot
            else:
                break
        return chosen or (self.snapshots[0] if self.snapshots else None)

    def window_quantiles(self, name: str, span: float, quantiles: Iterable[float],
                         where: Callable[[Labels], bool] = lambda _: True) -> list[float | None]:
        """Quantiles of the observations of histogram `name` made in the last `span` seconds."""
        newest = self.snapshots[-1]
        oldest = self.at_or_before(newest.t - span)
        new = merged_buckets(newest, name, where)
        old = merged_buckets(oldest, name, where) if oldest is not None and oldest is not newest else []
        delta = bucket_delta(new, old)
        return [histogram_quantile(q, delta) for q in quantiles]

    def rate(self, name: str, span: float, where: Callable[[Labels], bool] = lambda _: True) -> float | None:
        """Per-second increase of a counter (or a histogram's _sum/_count) over the last `span` seconds."""
        newest = self.snapshots[-1]
        oldest = self.at_or_before(newest.t - span)
        if oldest is None or oldest is newest or newest.t <= oldest.t:
            return None
        now, before = newest.total(name, where), oldest.total(name, where)
        if now is None:
            return 0.0  # a labelled counter has no series until it first counts
        return max(now - (before or 0.0), 0.0) / (newest.t - oldest.t)
