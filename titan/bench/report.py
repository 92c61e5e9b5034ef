"""The report: one JSON-ready dict per run, a rich console rendering of it, and `bench compare`."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from titan.bench.analysis import (
    Slo,
    baseline,
    detect_spikes,
    detect_stalls,
    error_summary,
    goodput,
    itl_samples,
    latency_summaries,
    throughput,
    ttft_samples,
    windowed_percentiles,
)
from titan.bench.attribution import AttributionContext, attribute
from titan.bench.runner import RunData
from titan.bench.uncertainty import BLOCK_SECONDS, tail_ratio_interval

SCHEMA = "titan-bench/1"
RESULT_FILE = "result.json"


@dataclass(frozen=True)
class AnalysisOptions:
    window: float = 1.0  # seconds per window for windowed percentiles and spikes
    spike_factor: float = 3.0  # a window is hot when its P99 exceeds this x the run's median
    stall_threshold: float | None = None  # seconds; None: stall_factor x the median ITL
    stall_factor: float = 5.0
    slo: Slo | None = None


def transient_analysis(run: RunData, options: AnalysisOptions, scrape_interval: float) -> dict[str, Any]:
    itls, ttfts = itl_samples(run.results), ttft_samples(run.results)
    spikes = detect_spikes(itls, "itl", options.window, options.spike_factor)
    spikes += detect_spikes(ttfts, "ttft", options.window, options.spike_factor)
    context = AttributionContext(run.results, run.scrapes, scrape_interval,
                                 max(options.window, scrape_interval), run.loop_lags, run.client_gc,
                                 run.server_steps, run.server_ready_t)
    for spike in spikes:
        attribute(spike, context)
    spikes.sort(key=lambda spike: (spike.start, spike.metric))
    threshold = options.stall_threshold
    if threshold is None:
        threshold = options.stall_factor * baseline(itls) if itls else math.inf
    stalls = detect_stalls(itls, threshold)
    return {
        "window_s": options.window,
        "spike_factor": options.spike_factor,
        "itl_median_ms": baseline(itls) * 1000 if itls else None,
        # how far the run's ITL P99 / P50 could move on another draw of the same traffic: over the gaps of the
        # requests that succeeded, as latency_ms's percentiles are
        "itl_tail_ratio": interval.to_dict() if (interval := tail_ratio_interval(
            itl_samples([result for result in run.results if result.success]))) else None,
        "ttft_median_ms": baseline(ttfts) * 1000 if ttfts else None,
        "spikes": [spike.to_dict() for spike in spikes],
        "stall_threshold_ms": threshold * 1000 if math.isfinite(threshold) else None,
        "stalls": {
            "count": len(stalls),
            "total_ms": sum(stall.duration for stall in stalls) * 1000,
            "longest": [s.to_dict() for s in sorted(stalls, key=lambda s: -s.duration)[:20]],
        },
        "windows": {
            "itl": [w.to_dict() for w in windowed_percentiles(itls, options.window, run.duration)],
            "ttft": [w.to_dict() for w in windowed_percentiles(ttfts, options.window, run.duration)],
        },
    }


def build_report(run: RunData, *, meta: dict[str, Any], config: dict[str, Any], workload: dict[str, Any],
                 options: AnalysisOptions, scrape_interval: float = 1.0,
                 include_requests: bool = False) -> dict[str, Any]:
    results = run.results
    classes = sorted({result.request_class for result in results})
    report: dict[str, Any] = {
        "schema": SCHEMA,
        "meta": {**meta, "started_at": run.started_at, "interrupted": run.interrupted},
        "config": config,
        "workload": workload,
        "summary": throughput(results, run.duration),
        "latency_ms": latency_summaries(results),
        "goodput": goodput(results, options.slo, run.duration) if options.slo else None,
        "errors": error_summary(results),
        "classes": {},
        "transients": transient_analysis(run, options, scrape_interval),
        "server_metrics": run.metrics,
        "client_health": {
            "loop_lag_max_ms": max((lag for _, lag in run.loop_lags), default=0.0) * 1000,
            "loop_lag_events": len(run.loop_lags),
            "gc_pause_max_ms": max((pause for _, pause in run.client_gc), default=0.0) * 1000,
            "gc_pauses": len(run.client_gc),
        },
    }
    if len(classes) > 1:
        for name in classes:
            members = [result for result in results if result.request_class == name]
            report["classes"][name] = {
                "summary": throughput(members, run.duration),
                "latency_ms": latency_summaries(members),
                "goodput": goodput(members, options.slo, run.duration) if options.slo else None,
            }
    if include_requests:
        report["requests"] = [result.to_dict() for result in results]
    return report


def write_json(report: dict[str, Any], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1, allow_nan=False, default=_json_default), encoding="utf-8")
    return path


def _json_default(value: Any) -> Any:
    raise TypeError(f"not JSON serializable: {type(value).__name__}")


def load_report(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if path.is_dir():
        path = path / RESULT_FILE
    report = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(report, dict) or report.get("schema") != SCHEMA:
        raise ValueError(f"{path}: not a titan bench result (schema {SCHEMA})")
    return report


def _number(value: Any, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, int):
        return str(value)
    return f"{value:,.{digits}f}"


def print_report(report: dict[str, Any], console: Any = None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    meta, summary = report["meta"], report["summary"]
    console.print(f"[bold]titan bench[/bold]  {meta.get('model')} @ {meta.get('base_url')}  "
                  f"preset={report['workload'].get('preset')}  endpoint={meta.get('endpoint')}"
                  + ("  [yellow](interrupted)[/yellow]" if meta.get("interrupted") else ""))
    overview = Table(title="Run", show_header=False)
    overview.add_row("requests", f"{summary['succeeded']} ok / {summary['failed']} failed / {summary['requests']}")
    overview.add_row("duration", f"{summary['duration_s']:.2f} s")
    overview.add_row("request throughput", f"{summary['request_throughput']:.2f} req/s")
    overview.add_row("output token throughput", f"{summary['output_token_throughput']:.1f} tok/s")
    overview.add_row("total token throughput", f"{summary['total_token_throughput']:.1f} tok/s")
    if report.get("goodput"):
        good = report["goodput"]
        slo = ", ".join(f"{key}<={value:g}ms" for key, value in good["slo_ms"].items())
        overview.add_row("goodput", f"{good['goodput_rps']:.2f} req/s ({good['attainment']:.1%} meet {slo})")
    tail = (report.get("transients") or {}).get("itl_tail_ratio")
    if tail:
        overview.add_row("ITL P99 / P50", f"{tail['estimate']:.2f} ({tail['level']:.0%} interval {tail['low']:.2f}-"
                                          f"{tail['high']:.2f}, {BLOCK_SECONDS:g} s blocks redrawn)")
    console.print(overview)

    latency = Table(title="Latency (ms)")
    columns = ("mean", "std", "p50", "p90", "p95", "p99", "max")
    latency.add_column("metric")
    latency.add_column("n", justify="right")
    for column in columns:
        latency.add_column(column, justify="right")
    for metric, stats in report["latency_ms"].items():
        latency.add_row(metric, str(stats["count"]), *(_number(stats.get(column)) for column in columns))
    console.print(latency)

    if report.get("classes"):
        per_class = Table(title="By request class (ms)")
        for column in ("class", "ok/n", "TTFT p50", "TTFT p99", "ITL p99", "E2E p50", "goodput"):
            per_class.add_column(column, justify="left" if column == "class" else "right")
        for name, data in report["classes"].items():
            lat, good = data["latency_ms"], data.get("goodput")
            per_class.add_row(name, f"{data['summary']['succeeded']}/{data['summary']['requests']}",
                              _number(lat["ttft"]["p50"]), _number(lat["ttft"]["p99"]), _number(lat["itl"]["p99"]),
                              _number(lat["e2e"]["p50"]), f"{good['attainment']:.0%}" if good else "-")
        console.print(per_class)

    transients = report["transients"]
    spikes = transients["spikes"]
    stalls = transients["stalls"]
    threshold = transients["stall_threshold_ms"]
    console.print(f"Transients: {len(spikes)} spike(s) (window {transients['window_s']:g} s, "
                  f"P99 > {transients['spike_factor']:g}x median), {stalls['count']} stall(s) "
                  f"(gaps > {_number(threshold)} ms)")
    for stall in stalls["longest"][:3]:
        console.print(f"  stall: request {stall['request']} waited {stall['duration_ms']:.0f} ms for a token "
                      f"at {stall['start_s']:.2f} s")
    if spikes:
        table = Table(title="Spikes")
        for column in ("metric", "start s", "duration s", "peak P99 ms", "x median", "causes"):
            table.add_column(column, justify="left" if column in ("metric", "causes") else "right")
        for spike in spikes[:30]:
            table.add_row(spike["metric"], f"{spike['start_s']:.2f}", f"{spike['duration_s']:.2f}",
                          _number(spike["peak_p99_ms"]), f"{spike['magnitude']:.1f}", "; ".join(spike["causes"]))
        console.print(table)

    errors = report["errors"]
    if errors["count"]:
        table = Table(title=f"Errors ({errors['count']})")
        table.add_column("status / kind")
        table.add_column("count", justify="right")
        for status, count in errors["by_status"].items():
            table.add_row(f"status {status}", str(count))
        for kind, count in errors["by_kind"].items():
            table.add_row(f"kind {kind}", str(count))
        console.print(table)
        for example in errors["examples"][:5]:
            console.print(f"  request {example['request']}: {example['message']}", markup=False)
    server = report["server_metrics"]
    if not server.get("available"):
        console.print(f"Server metrics: not available ({server.get('error')})", markup=False)


COMPARE_ROWS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("requests ok", ("summary", "succeeded")),
    ("requests failed", ("summary", "failed")),
    ("request throughput (req/s)", ("summary", "request_throughput")),
    ("output throughput (tok/s)", ("summary", "output_token_throughput")),
    ("goodput (req/s)", ("goodput", "goodput_rps")),
    ("SLO attainment", ("goodput", "attainment")),
    *((f"{metric.upper()} {stat} (ms)", ("latency_ms", metric, stat))
      for metric in ("ttft", "tpot", "itl", "e2e") for stat in ("p50", "p99")),
    ("ITL max (ms)", ("latency_ms", "itl", "max")),
    ("ITL P99 / P50", ("transients", "itl_tail_ratio", "estimate")),
    ("spikes", ("transients", "spikes")),
    ("stalls", ("transients", "stalls", "count")),
)


COUNT_ROWS = ("requests ok", "requests failed", "spikes", "stalls")


def run_name(path: str | Path) -> str:
    """A short column title: the file's stem, or its folder's name for `.../result.json` and folders."""
    path = Path(path)
    if path.is_dir() or path.name == RESULT_FILE:
        return (path if path.is_dir() else path.parent).resolve().name
    return path.stem


def compare_value(report: dict[str, Any], path: tuple[str, ...]) -> float | None:
    value: Any = report
    for key in path:
        if not isinstance(value, dict) or key not in value:
            return None
        value = value[key]
    if isinstance(value, list):
        return float(len(value))
    return float(value) if isinstance(value, int | float) else None


def compare_rows(reports: list[dict[str, Any]]) -> list[tuple[str, list[float | None], list[float | None]]]:
    """(label, values per run, ratio of each run to the first) for each compared metric."""
    rows = []
    for label, path in COMPARE_ROWS:
        values = [compare_value(report, path) for report in reports]
        first = values[0]
        ratios = [None if value is None or not first else value / first for value in values]
        rows.append((label, values, ratios))
    return rows


def print_compare(reports: list[dict[str, Any]], names: list[str], console: Any = None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    table = Table(title="titan bench compare (ratio = run / first run)")
    table.add_column("metric")
    for position, name in enumerate(names):
        table.add_column(name, justify="right")
        if position:
            table.add_column("ratio", justify="right")
    for label, values, ratios in compare_rows(reports):
        cells = []
        digits = 3 if label == "SLO attainment" else 2 if label == "ITL P99 / P50" else 0 if label in COUNT_ROWS else 1
        for position, (value, ratio) in enumerate(zip(values, ratios, strict=True)):
            cells.append(_number(value, digits))
            if position:
                cells.append("-" if ratio is None else f"{ratio:.2f}x")
        table.add_row(label, *cells)
    console.print(table)
