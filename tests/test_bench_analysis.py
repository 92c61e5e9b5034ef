"""`titan bench` analysis on constructed timelines: percentiles, goodput, windows, spikes, stalls, causes.

Times are multiples of 1/32 s so that every expected number below is exact in binary floating point.
"""

import json
import math

import pytest
from rich.console import Console

from titan.bench.analysis import (
    LatencySample,
    Slo,
    Spike,
    detect_spikes,
    detect_stalls,
    error_summary,
    goodput,
    itl_samples,
    summarize,
    throughput,
    ttft_samples,
    windowed_percentiles,
)
from titan.bench.attribution import NO_CAUSE, AttributionContext, attribute
from titan.bench.client import RequestResult
from titan.bench.metrics_scraper import MetricsSample
from titan.bench.report import AnalysisOptions, build_report, compare_rows, print_report
from titan.bench.runner import RunData

TICK = 1 / 32


def stream(index: int, sent: float, first: float, count: int, stall_after: int | None = None,
           stall: float = 0.0, **fields) -> RequestResult:
    """A successful request: first token at `first`, then one every TICK, with one optional longer gap."""
    times, now = [], first
    for number in range(count):
        times.append(now)
        now += stall if stall_after is not None and number == stall_after else TICK
    result = RequestResult(index, fields.pop("request_class", "default"), fields.pop("input_tokens", 16),
                           count, scheduled_at=sent, sent_at=sent, token_times=times, finished_at=times[-1],
                           status=200, completion_tokens=count, prompt_tokens=16, usage_source="usage")
    for name, value in fields.items():
        setattr(result, name, value)
    return result


def test_summarize_exact_and_ordered() -> None:
    stats = summarize([value / 1000 for value in range(1, 101)])  # 1..100 ms
    assert stats["count"] == 100
    assert stats["mean"] == pytest.approx(50.5)
    assert stats["min"] == pytest.approx(1.0) and stats["max"] == pytest.approx(100.0)
    assert stats["p50"] == pytest.approx(50.5)  # linear interpolation between 50 and 51
    assert stats["p99"] == pytest.approx(99.01)
    ordered = [stats[key] for key in ("min", "p50", "p90", "p95", "p99", "max")]
    assert ordered == sorted(ordered)
    empty = summarize([])
    assert empty["count"] == 0 and empty["p99"] is None and empty["mean"] is None


def test_slo_parse_units_and_errors() -> None:
    slo = Slo.parse("ttft=500, itl=100ms,e2e=2s,tpot=40")
    assert (slo.ttft, slo.itl, slo.e2e, slo.tpot) == (0.5, 0.1, 2.0, 0.04)
    assert slo.to_dict() == {"ttft": 500.0, "itl": 100.0, "tpot": 40.0, "e2e": 2000.0}
    for bad in ("", "ttft", "latency=5", "ttft=abc", "ttft=-1"):
        with pytest.raises(ValueError):
            Slo.parse(bad)


def test_goodput_counts_exactly() -> None:
    fast = stream(0, 0.0, 0.25, 9)  # TTFT 250 ms, gaps 31.25 ms, e2e 500 ms
    slow_first = stream(1, 0.0, 1.0, 9)  # TTFT 1000 ms
    stalled = stream(2, 0.0, 0.25, 9, stall_after=4, stall=0.5)  # one 500 ms gap
    failed = RequestResult(3, "default", 16, 9, 0.0, sent_at=0.0, finished_at=0.1, status=500, error="HTTP 500",
                           error_kind="http")
    results = [fast, slow_first, stalled, failed]
    assert goodput(results, Slo.parse("ttft=500"), 2.0) == {
        "slo_ms": {"ttft": 500.0}, "good": 2, "total": 4, "attainment": 0.5, "goodput_rps": 1.0}
    assert goodput(results, Slo.parse("ttft=500,itl=100"), 2.0)["good"] == 1
    # tpot of the stalled request: (0.25 + 7/32 + 0.5 - 0.25 - ...) -> its mean gap is (7/32 + 0.5) / 8
    assert stalled.tpot == pytest.approx((7 * TICK + 0.5) / 8)
    assert goodput(results, Slo.parse("tpot=100"), 2.0)["good"] == 3
    assert goodput(results, Slo.parse("e2e=600"), 4.0) == {
        "slo_ms": {"e2e": 600.0}, "good": 1, "total": 4, "attainment": 0.25, "goodput_rps": 0.25}
    # One output token has no time per token after the first: it meets a tpot bound (it missed every one).
    single = stream(4, 0.0, 0.05, 1)
    assert single.tpot is None and goodput([single], Slo.parse("ttft=100,tpot=100"), 1.0)["good"] == 1


def test_windowed_percentiles_counts_and_empty_windows() -> None:
    samples = [LatencySample(0.5, 0.125, 0), LatencySample(0.75, 0.25, 0), LatencySample(2.5, 0.5, 1)]
    windows = windowed_percentiles(samples, 1.0, end_time=3.5)
    assert [(w.start, w.end, w.count) for w in windows] == [(0, 1, 2), (1, 2, 0), (2, 3, 1), (3, 4, 0)]
    assert windows[0].p50 == 0.1875 and windows[0].max == 0.25
    assert windows[1].p99 is None
    assert windows[2].p50 == windows[2].p99 == 0.5


def test_spike_detector_finds_a_server_stall_exactly() -> None:
    # Four streams with a token every 1/32 s; all stall together from 4.75 s to 5.5 s (a 0.75 s gap).
    results = [stream(index, 0.0, 0.0, 300, stall_after=152, stall=0.75) for index in range(4)]
    assert results[0].token_times[152] == 4.75 and results[0].token_times[153] == 5.5
    spikes = detect_spikes(itl_samples(results), "itl", window=1.0, factor=3.0)
    assert len(spikes) == 1
    spike = spikes[0]
    assert (spike.metric, spike.start, spike.end, spike.duration) == ("itl", 4.75, 6.0, 1.25)
    assert (spike.peak, spike.max, spike.threshold, spike.magnitude) == (0.75, 0.75, 3 * TICK, 24.0)
    assert (spike.samples_over, spike.requests) == (4, 4)
    stalls = detect_stalls(itl_samples(results), threshold=5 * TICK)
    assert [(s.request_index, s.start, s.duration) for s in stalls] == [(i, 4.75, 0.75) for i in range(4)]


def test_spikes_bridge_empty_windows_but_not_calm_ones() -> None:
    calm = [LatencySample(t / 4, 0.01, 9) for t in range(40)]  # 4 samples a second, 10 ms, 0..10 s
    hot = [LatencySample(2.5, 0.2, 1), LatencySample(4.5, 0.3, 2), LatencySample(8.5, 0.1, 3)]
    # Windows 3 and 4 would have calm samples; drop them so window 3 is empty and bridges 2 and 4.
    samples = [s for s in calm if not 3 <= s.at < 4] + hot
    spikes = detect_spikes(samples, "itl", window=1.0, factor=3.0)
    assert [(s.start, s.end, s.samples_over, s.requests) for s in spikes] == [
        (2.0, 5.0, 2, 2), (8.0, 9.0, 1, 1)]
    # Window 4 holds four 10 ms samples and one of 300 ms: P99 interpolates 96% of the way up.
    assert spikes[0].peak == pytest.approx(0.01 + 0.96 * 0.29)
    assert spikes[0].magnitude == pytest.approx(28.84)
    assert detect_spikes([], "itl") == []
    assert detect_spikes(calm, "itl") == []  # a flat timeline has no spikes


def test_ttft_spike_from_a_queue_and_its_causes() -> None:
    # One request a second with TTFT 125 ms; requests 5..7 wait in a queue: TTFT 1 s.
    results = [stream(i, float(i), i + (1.0 if 5 <= i <= 7 else 0.125), 4) for i in range(12)]
    results[5].input_tokens_estimate = results[5].prompt_tokens = 4000  # a long prompt arrived first
    spikes = detect_spikes(ttft_samples(results), "ttft", window=1.0, factor=3.0)
    assert [(s.start, s.end, s.samples_over) for s in spikes] == [(5.0, 9.0, 3)]
    scrapes = [MetricsSample(t + 0.5, {"waiting": w, "running": 1, "kv_usage": kv, "preemptions": p,
                                       "gc_gen2_collections": 0})
               for t, w, kv, p in ((3, 0, 0.2, 0), (4, 0, 0.2, 0), (5, 3, 0.95, 1), (6, 4, 0.96, 2),
                                   (7, 1, 0.5, 2), (8, 0, 0.2, 2), (9, 0, 0.2, 2))]
    context = AttributionContext(results, scrapes, scrape_interval=1.0, lookback=1.0)
    spike = attribute(spikes[0], context)
    assert spike.causes == [
        "queue grew from 0 to 4 waiting requests",
        "2 preemption(s)",
        "KV cache 96% full",
        "long prefill arrived: 1 request(s) of up to 4000 prompt tokens",
    ]
    assert spike.evidence["waiting"] == {"before": 0, "max": 4}
    assert spike.evidence["long_prefills"] == [5]
    quiet = Spike("itl", 0.5, 1.0, 0.1, 0.1, 5.0, 0.06, 1, 1)
    assert attribute(quiet, AttributionContext(results[:1], [], 1.0, 1.0)).causes == [NO_CAUSE]


def test_arrival_burst_client_lag_and_step_time_causes() -> None:
    results = [stream(i, float(i), i + 0.125, 4) for i in range(20)]
    results += [stream(20 + i, 10.25, 10.5, 4) for i in range(6)]  # six at once at 10.25 s
    scrapes = [MetricsSample(float(t), {"step_seconds_max": 0.01 if t != 11 else 0.5}) for t in range(20)]
    spike = Spike("itl", 10.5, 11.0, 0.4, 0.5, 10.0, 0.1, 3, 3)
    context = AttributionContext(results, scrapes, 1.0, 1.0, loop_lags=[(10.7, 0.08)], client_gc=[(10.8, 0.03)])
    assert attribute(spike, context).causes == [
        "engine steps took up to 500 ms (typically 10 ms)",
        "arrival burst: 8 requests in 1.5 s (3.9x the mean rate)",
        "the client's event loop lagged 80 ms: part of this spike is the client's",
        "the client's GC paused 30 ms: part of this spike is the client's",
    ]


def test_errors_and_throughput_accounting() -> None:
    ok = stream(0, 0.0, 0.5, 10)
    results = [
        ok,
        RequestResult(1, "default", 8, 10, 0.0, sent_at=0.1, finished_at=0.2, status=503,
                      error="HTTP 503: busy", error_kind="http"),
        RequestResult(2, "default", 8, 10, 0.0, sent_at=0.1, finished_at=0.2, status=0,
                      error="cannot connect", error_kind="connect"),
        RequestResult(3, "default", 8, 10, 0.0, sent_at=0.1, finished_at=0.3, status=200,
                      error="SSE data is not JSON", error_kind="malformed_sse", token_times=[0.2]),
    ]
    summary = error_summary(results)
    assert summary["count"] == 3
    assert summary["by_status"] == {"503": 1, "no response": 1, "200": 1}
    assert summary["by_kind"] == {"http": 1, "connect": 1, "malformed_sse": 1}
    assert [e["request"] for e in summary["examples"]] == [1, 2, 3]
    numbers = throughput(results, 2.0)
    assert (numbers["succeeded"], numbers["failed"]) == (1, 3)
    assert (numbers["output_tokens"], numbers["input_tokens"]) == (10, 16)
    assert numbers["request_throughput"] == 0.5 and numbers["output_token_throughput"] == 5.0
    assert numbers["total_token_throughput"] == 13.0


def test_report_is_strict_json_and_consistent() -> None:
    results = [stream(i, i * 0.5, i * 0.5 + 0.25, 20, request_class="batch" if i % 2 else "interactive")
               for i in range(8)]
    results[3] = stream(3, 1.5, 1.75, 20, stall_after=10, stall=1.0, request_class="batch")
    results.append(RequestResult(8, "interactive", 16, 20, 4.0, sent_at=4.0, finished_at=4.1, status=500,
                                 error="HTTP 500: boom", error_kind="http"))
    run = RunData(results, duration=6.0, started_at="2026-01-01T00:00:00+00:00",
                  metrics={"available": False, "samples": [], "error": "none"}, scrapes=[], loop_lags=[],
                  client_gc=[], interrupted=False)
    report = build_report(run, meta={"model": "m", "base_url": "u", "endpoint": "completions"}, config={},
                          workload={"preset": "mixed-priority"},
                          options=AnalysisOptions(slo=Slo.parse("ttft=500,itl=500")), include_requests=True)
    text = json.dumps(report, allow_nan=False)
    again = json.loads(text)
    assert again["summary"]["succeeded"] == 8 and again["errors"]["by_status"] == {"500": 1}
    assert again["goodput"]["good"] == 7
    assert set(again["classes"]) == {"batch", "interactive"}
    assert again["classes"]["batch"]["summary"]["requests"] == 4
    assert again["transients"]["stalls"]["count"] == 1
    assert again["transients"]["stalls"]["longest"][0] == {"request": 3, "start_s": 2.0625, "duration_ms": 1000.0}
    assert [s["metric"] for s in again["transients"]["spikes"]] == ["itl"]
    for stats in again["latency_ms"].values():
        if stats["count"]:
            ordered = [stats[key] for key in ("min", "p50", "p90", "p95", "p99", "max")]
            assert ordered == sorted(ordered)
    assert len(again["requests"]) == 9
    assert RequestResult.from_dict(again["requests"][3]).itls == results[3].itls
    assert math.isclose(again["latency_ms"]["ttft"]["p50"], 250.0)
    rows = {label: (values, ratios) for label, values, ratios in compare_rows([again, again])}
    assert rows["TTFT p50 (ms)"] == ([250.0, 250.0], [1.0, 1.0])
    assert rows["stalls"][0] == [1.0, 1.0]
    # 6 s of gaps is three 2 s blocks: too few to say how far the ITL tail could move
    assert again["transients"]["itl_tail_ratio"] is None and rows["ITL P99 / P50"][0] == [None, None]


def test_report_says_how_far_the_itl_tail_could_move() -> None:
    # 40 s of streams, one every 2 s; those in the middle 20 s each stall once for 100 ms (10 of 780 gaps)
    results = [stream(i, 2.0 * i, 2.0 * i + 0.25, 40, **({"stall_after": 5, "stall": 0.1} if 5 <= i < 15 else {}))
               for i in range(20)]
    # a request that broke off mid-stream after twenty 0.5 s gaps: not in latency_ms's percentiles, so not in the
    # ratio (with them the P99 would be 0.5 s)
    broken = stream(20, 20.0, 20.25, 21, error="connection reset", error_kind="connect")
    broken.token_times = [20.25 + 0.5 * k for k in range(21)]
    results.append(broken)
    run = RunData(results, duration=42.0, started_at="2026-01-01T00:00:00+00:00",
                  metrics={"available": False, "samples": [], "error": "none"}, scrapes=[], loop_lags=[],
                  client_gc=[], interrupted=False)
    report = build_report(run, meta={"model": "m", "base_url": "u", "endpoint": "completions"}, config={},
                          workload={"preset": "steady"}, options=AnalysisOptions(), include_requests=False)
    tail = json.loads(json.dumps(report, allow_nan=False))["transients"]["itl_tail_ratio"]
    assert tail["estimate"] == pytest.approx(report["latency_ms"]["itl"]["p99"] / report["latency_ms"]["itl"]["p50"])
    assert tail["estimate"] > 2 and tail["low"] <= tail["estimate"] <= tail["high"] and tail["level"] == 0.9
    console = Console(record=True, width=160)
    print_report(report, console)
    row = next(line for line in console.export_text().splitlines() if "ITL P99 / P50" in line)
    assert f"{tail['estimate']:.2f} (90% interval {tail['low']:.2f}-{tail['high']:.2f}" in row


def test_server_step_records_name_gc_preemption_and_prefill_interference() -> None:
    results = [stream(i, float(i), i + 0.125, 4) for i in range(12)]
    # Titan's /debug/steps: 50 ms decode steps, then around 6 s a GC pause, a preemption and a prefill.
    steps = [{"t": t / 20, "duration": 0.05, "num_prefill_tokens": 0, "num_preemptions": 0, "gc_pause": 0.0}
             for t in range(240)]
    steps[120] = {**steps[120], "duration": 0.4, "num_prefill_tokens": 512}
    steps[122] = {**steps[122], "num_preemptions": 2, "gc_pause": 0.03}
    scrapes = [MetricsSample(float(t), {"step_seconds_max": 0.05 if t != 7 else 0.4, "preemptions": 0})
               for t in range(12)]
    spike = Spike("itl", 6.0, 6.5, 0.4, 0.45, 8.0, 0.15, 3, 3)
    causes = attribute(spike, AttributionContext(results, scrapes, 1.0, 0.5, server_steps=steps)).causes
    assert causes == [
        "GC: the server's garbage collector paused the engine 30 ms",
        "preemption: 2 request(s) lost their KV cache and were recomputed",
        "prefill interference: 1 step(s) carrying up to 512 prefill tokens took up to 400 ms (typically 50 ms)",
    ]
    # Without step records the coarse 1 Hz rule speaks instead.
    same_spike = Spike("itl", 6.0, 6.5, 0.4, 0.45, 8.0, 0.15, 3, 3)
    coarse = attribute(same_spike, AttributionContext(results, scrapes, 1.0, 0.5))
    assert coarse.causes == ["engine steps took up to 400 ms (typically 50 ms)"]


def test_cold_start_is_named_for_a_young_server_only() -> None:
    results = [stream(i, float(i), i + 0.125, 4) for i in range(12)]
    young = attribute(Spike("itl", 2.0, 2.5, 0.4, 0.45, 8.0, 0.15, 3, 3),
                      AttributionContext(results, [], 1.0, 0.5, server_ready_t=-1.5))
    assert young.causes == ["cold start: the server had been ready for only 3.5 s"]
    assert young.evidence["server_ready_for_s"] == 3.5
    old = attribute(Spike("itl", 2.0, 2.5, 0.4, 0.45, 8.0, 0.15, 3, 3),
                    AttributionContext(results, [], 1.0, 0.5, server_ready_t=-60.0))
    assert old.causes == [NO_CAUSE]
