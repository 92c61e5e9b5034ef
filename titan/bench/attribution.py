"""Why a spike happened: what changed around it in the server's metrics and in the client's own traffic.

Named causes: queueing (the queue grew), prefill interference, preemption and GC (from Titan's step
records, or coarser from metrics), KV cache saturation, cold start (a young server), arrival bursts, long
prompts, and the client's own event-loop lag or GC.

Each rule compares the last scrape at or before the spike's start with the scrapes during it (plus one
interval after, since a 1 Hz gauge shows an event late), and looks at what the client sent in the spike and
the `lookback` seconds before it. The causes are hints for a person, in plain words, with the numbers kept
in `evidence`.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from titan.bench.analysis import Spike
from titan.bench.client import RequestResult
from titan.bench.metrics_scraper import MetricsSample

NO_CAUSE = "no cause found in the scraped metrics or the client's traffic"
# A spike this soon after the server became ready is blamed (also) on its cold start: first-touch page
# faults of the weights, allocator growth and lazy initialization on shapes warm-up did not cover.
COLD_START_SECONDS = 10.0


@dataclass
class AttributionContext:
    results: Sequence[RequestResult]
    scrapes: Sequence[MetricsSample]
    scrape_interval: float = 1.0
    lookback: float = 1.0
    loop_lags: Sequence[tuple[float, float]] = field(default_factory=list)  # (t, lag seconds)
    client_gc: Sequence[tuple[float, float]] = field(default_factory=list)  # (t, pause seconds)
    # Titan's `GET /debug/steps` records, each with `t` = seconds since the run started (empty for
    # servers without it). When present they replace the coarse 1 Hz step-time rules.
    server_steps: Sequence[dict[str, Any]] = field(default_factory=list)
    server_ready_t: float | None = None  # when the server became ready, on the same clock as `t`


def _series_median(scrapes: Sequence[MetricsSample], key: str) -> float | None:
    values = [sample.values[key] for sample in scrapes if key in sample.values]
    return statistics.median(values) if values else None


def _server_causes(spike: Spike, context: AttributionContext, causes: list[str], evidence: dict[str, Any]) -> None:
    scrapes = context.scrapes
    if not scrapes:
        return
    earlier = [sample for sample in scrapes if sample.t <= spike.start]
    before = earlier[-1] if earlier else scrapes[0]
    during = [s for s in scrapes if spike.start < s.t <= spike.end + context.scrape_interval]
    if not during:
        return

    def peak(key: str) -> float | None:
        values = [sample.values[key] for sample in during if key in sample.values]
        return max(values) if values else None

    def grew(key: str, minimum: float) -> tuple[float, float] | None:
        start, top = before.values.get(key), peak(key)
        if start is None or top is None:
            return None
        evidence[key] = {"before": start, "max": top}
        return (start, top) if top - start >= max(minimum, 0.5 * start) else None

    if (change := grew("waiting", 1)) is not None:
        causes.append(f"queue grew from {change[0]:g} to {change[1]:g} waiting requests")
    if (change := grew("running", 2)) is not None:
        causes.append(f"running requests rose from {change[0]:g} to {change[1]:g}")
    for key, words in (("preemptions", "preemption(s)"), ("gc_gen2_collections", "full (gen-2) server GC(s)")):
        if context.server_steps:
            break  # the engine's own step records say it more precisely
        if key in before.values and key in during[-1].values:
            delta = during[-1].values[key] - before.values[key]
            evidence[key] = delta
            if delta > 0:
                causes.append(f"{delta:g} {words}")
    kv = peak("kv_usage")
    if kv is not None:
        evidence["kv_usage_max"] = kv
        if kv >= 0.9:
            causes.append(f"KV cache {kv:.0%} full")
    for key, template in (("step_seconds_max", "engine steps took up to {0:g} ms (typically {1:g} ms)"),
                          ("iteration_tokens_max", "steps of up to {0:g} tokens (typically {1:g}): big prefills")):
        if context.server_steps:
            break
        top, typical = peak(key), _series_median(scrapes, key)
        if top is None or typical is None:
            continue
        scale = 1000 if key == "step_seconds_max" else 1
        evidence[key] = {"max": top, "typical": typical}
        if top >= 2 * typical and top > 0:
            causes.append(template.format(top * scale, typical * scale))


def _client_causes(spike: Spike, context: AttributionContext, causes: list[str], evidence: dict[str, Any]) -> None:
    results = [result for result in context.results if result.sent_at == result.sent_at]  # not NaN
    if not results:
        return
    begin, end = spike.start - context.lookback, spike.end
    sent = [result for result in results if begin <= result.sent_at <= end]

    def size(result: RequestResult) -> int:
        return result.prompt_tokens if result.prompt_tokens is not None else result.input_tokens_estimate

    typical = statistics.median(size(result) for result in results)
    long_prompts = [r for r in sent if r.request_class == "long-prefill" or size(r) >= 4 * max(typical, 1)]
    if long_prompts:
        evidence["long_prefills"] = [result.index for result in long_prompts]
        causes.append(f"long prefill arrived: {len(long_prompts)} request(s) of up to "
                      f"{max(size(result) for result in long_prompts)} prompt tokens")
    span = max(result.sent_at for result in results) - min(result.sent_at for result in results)
    if span > 0 and len(results) > 1:
        expected = len(results) / span * (end - begin)
        evidence["arrivals"] = {"count": len(sent), "expected": round(expected, 2)}
        if len(sent) >= 3 and len(sent) >= 2 * expected:
            causes.append(f"arrival burst: {len(sent)} requests in {end - begin:.1f} s "
                          f"({len(sent) / expected:.1f}x the mean rate)")
    lag = max((lag for t, lag in context.loop_lags if begin <= t <= end), default=0.0)
    if lag >= 0.05:
        evidence["client_loop_lag_ms"] = lag * 1000
        causes.append(f"the client's event loop lagged {lag * 1000:.0f} ms: part of this spike is the client's")
    pause = max((pause for t, pause in context.client_gc if begin <= t <= end), default=0.0)
    if pause >= 0.02:
        evidence["client_gc_ms"] = pause * 1000
        causes.append(f"the client's GC paused {pause * 1000:.0f} ms: part of this spike is the client's")


def _step_causes(spike: Spike, context: AttributionContext, causes: list[str], evidence: dict[str, Any]) -> None:
    """Name the engine-side cause from the server's step records: GC, preemption, prefill interference."""
    steps = context.server_steps
    if not steps:
        return
    # A step that ended inside the spike (or in the lookback before it) shaped its token gaps.
    window = [s for s in steps if spike.start - context.lookback <= s["t"] + s["duration"] and s["t"] <= spike.end]
    if not window:
        return
    gc_pause = sum(s.get("gc_pause", 0.0) for s in window)
    if gc_pause >= 0.02:
        evidence["server_gc_ms"] = gc_pause * 1000
        causes.append(f"GC: the server's garbage collector paused the engine {gc_pause * 1000:.0f} ms")
    preemptions = sum(s["num_preemptions"] for s in window)
    if preemptions:
        evidence["server_preemptions"] = preemptions
        causes.append(f"preemption: {preemptions} request(s) lost their KV cache and were recomputed")
    typical = statistics.median(s["duration"] for s in steps)
    slow = [s for s in window if s["num_prefill_tokens"] > 0 and s["duration"] >= 2 * typical]
    if slow:
        worst = max(slow, key=lambda s: s["duration"])
        evidence["prefill_steps"] = {"count": len(slow), "max_ms": worst["duration"] * 1000,
                                     "typical_ms": typical * 1000}
        causes.append(f"prefill interference: {len(slow)} step(s) carrying up to "
                      f"{max(s['num_prefill_tokens'] for s in slow)} prefill tokens took up to "
                      f"{worst['duration'] * 1000:.0f} ms (typically {typical * 1000:.0f} ms)")


def _cold_start_cause(spike: Spike, context: AttributionContext, causes: list[str],
                      evidence: dict[str, Any]) -> None:
    ready = context.server_ready_t
    if ready is None:
        return
    uptime = spike.start - ready
    evidence["server_ready_for_s"] = uptime
    if uptime < COLD_START_SECONDS:
        causes.append(f"cold start: the server had been ready for only {max(uptime, 0.0):.1f} s")


def attribute(spike: Spike, context: AttributionContext) -> Spike:
    """Fill `spike.causes` and `spike.evidence`; returns the spike for chaining."""
    causes: list[str] = []
    evidence: dict[str, Any] = {}
    _server_causes(spike, context, causes, evidence)
    _step_causes(spike, context, causes, evidence)
    _cold_start_cause(spike, context, causes, evidence)
    _client_causes(spike, context, causes, evidence)
    spike.causes = causes or [NO_CAUSE]
    spike.evidence = evidence
    return spike
