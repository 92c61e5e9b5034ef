"""What a simulated policy cost and how it behaved: latency percentiles, SLO misses, replica-minutes,
flapping.

Oscillation: every change of the Deployment's size is a scale event; a *reversal* is an event in the opposite
direction of the one before it. Traffic that rises and falls needs a reversal at each peak and trough; a
*flap* is a reversal that comes within `flap_window_s` of the previous reversal - capacity bought and
returned (or returned and bought back) within minutes, far faster than traffic turns. A policy with at least
`flap_threshold` flaps is reported as flapping: it pays cold starts for nothing and its latency follows.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from titan.autoscale.simulator import SimulationResult, SyncSample


@dataclass(frozen=True)
class Slo:
    queue_s: float | None = 1.0  # waiting before a request enters a batch
    e2e_s: float | None = None  # arrival to last token

    def describe(self) -> str:
        parts = [f"queue <= {self.queue_s:g} s"] if self.queue_s is not None else []
        parts += [f"e2e <= {self.e2e_s:g} s"] if self.e2e_s is not None else []
        return " and ".join(parts) or "none"


@dataclass(frozen=True)
class ScaleChange:
    time: float
    before: int
    after: int

    @property
    def direction(self) -> int:
        return 1 if self.after > self.before else -1


@dataclass(frozen=True)
class Oscillation:
    scale_events: int
    scale_ups: int
    scale_downs: int
    reversals: int
    flaps: int
    flapping: bool


def scale_changes(samples: Sequence[SyncSample]) -> list[ScaleChange]:
    return [ScaleChange(s.time, s.decision.current, s.decision.desired) for s in samples
            if s.decision.desired != s.decision.current]


def oscillation(changes: Sequence[ScaleChange], flap_window_s: float = 600.0,
                flap_threshold: int = 3) -> Oscillation:
    reversals = flaps = 0
    last_reversal: float | None = None
    for previous, change in zip(changes, changes[1:], strict=False):
        if change.direction != previous.direction:
            reversals += 1
            if last_reversal is not None and change.time - last_reversal <= flap_window_s:
                flaps += 1
            last_reversal = change.time
    ups = sum(1 for change in changes if change.direction > 0)
    return Oscillation(len(changes), ups, len(changes) - ups, reversals, flaps, flaps >= flap_threshold)


def _percentile(values: np.ndarray, percentile: float) -> float | None:
    finite = values[np.isfinite(values)]
    return float(np.percentile(finite, percentile)) if finite.size else None


def slo_violations(result: SimulationResult, slo: Slo) -> np.ndarray:
    """Per request: missed the SLO (aborted requests always do)."""
    missed = result.aborted.copy()
    if slo.queue_s is not None:
        missed |= result.queue_delay > slo.queue_s
    if slo.e2e_s is not None:
        missed |= result.latency > slo.e2e_s
    return missed


def summarize(result: SimulationResult, slo: Slo, flap_window_s: float = 600.0,
              flap_threshold: int = 3) -> dict[str, Any]:
    queue, latency = result.queue_delay, result.latency
    missed = slo_violations(result, slo)
    samples = result.samples
    ready = [sample.ready for sample in samples] or [0]
    count = int(result.arrival.size)
    return {
        "policy": result.policy.name,
        "description": result.policy.describe(),
        "requests": count,
        "aborted": int(result.aborted.sum()),
        "queue_delay_s": {"p50": _percentile(queue, 50), "p90": _percentile(queue, 90),
                          "p99": _percentile(queue, 99), "max": _percentile(queue, 100)},
        "e2e_latency_s": {"p50": _percentile(latency, 50), "p99": _percentile(latency, 99)},
        "slo_violations": int(missed.sum()),
        "slo_violation_rate": float(missed.mean()) if count else 0.0,
        "replica_minutes": result.replica_seconds / 60,
        "mean_replicas": result.replica_seconds / result.duration if result.duration > 0 else 0.0,
        "peak_ready_replicas": max(ready),
        "oscillation": asdict(oscillation(scale_changes(samples), flap_window_s, flap_threshold)),
    }


def windowed_p99(result: SimulationResult, window: float,
                 values: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """P99 of `values` (default: queueing delay) over requests arriving in each window (NaN where none)."""
    values = result.queue_delay if values is None else values
    edges = np.arange(0.0, result.duration + window, window)
    index = np.clip(np.digitize(result.arrival, edges) - 1, 0, len(edges) - 2)
    p99 = np.full(len(edges) - 1, math.nan)
    for bucket in range(len(edges) - 1):
        selected = values[index == bucket]
        selected = selected[np.isfinite(selected)]
        if selected.size:
            p99[bucket] = np.percentile(selected, 99)
    return (edges[:-1] + edges[1:]) / 2, p99


def _cell(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return str(value)
    return f"{value:.{digits}f}"


def format_table(summaries: Sequence[dict[str, Any]], slo: Slo) -> str:
    header = ("policy", "p99 queue s", "max queue s", f"SLO miss ({slo.describe()})", "replica-min",
              "mean repl", "peak", "scale ev", "reversals", "flaps", "flapping")
    rows = [header]
    for summary in summaries:
        osc = summary["oscillation"]
        rows.append((
            summary["policy"], _cell(summary["queue_delay_s"]["p99"]), _cell(summary["queue_delay_s"]["max"]),
            f"{summary['slo_violations']} ({summary['slo_violation_rate']:.2%})",
            _cell(summary["replica_minutes"], 1), _cell(summary["mean_replicas"]),
            _cell(summary["peak_ready_replicas"]), _cell(osc["scale_events"]), _cell(osc["reversals"]),
            _cell(osc["flaps"]), _cell(osc["flapping"]),
        ))
    widths = [max(len(row[column]) for row in rows) for column in range(len(header))]
    lines = ["  ".join(cell.ljust(width) if column == 0 else cell.rjust(width)
                       for column, (cell, width) in enumerate(zip(row, widths, strict=True))) for row in rows]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)
