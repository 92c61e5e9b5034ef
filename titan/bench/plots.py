"""PNG plots of a run (matplotlib, Agg backend; imported only when plots are asked for)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, never a window; must precede pyplot's import
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter  # noqa: E402
from matplotlib.transforms import blended_transform_factory  # noqa: E402

from titan.bench.client import RequestResult  # noqa: E402

MAX_SCATTER_POINTS = 50_000
# Log axes cannot show 0; gaps of 0 ms happen when two tokens arrive in one read.
FLOOR_MS = 0.01
PLAIN = FuncFormatter(lambda value, _: f"{value:g}")


def _wide(values: Sequence[float]) -> bool:
    """Worth a log axis: the values span more than a factor of 10."""
    return min(values) > 0 and max(values) / min(values) > 10


def _shade_spikes(axis: Any, spikes: Sequence[dict[str, Any]], metric: str | None = None) -> None:
    labelled = False
    for spike in spikes:
        if metric is not None and spike["metric"] != metric:
            continue
        axis.axvspan(spike["start_s"], spike["end_s"], color="tab:red", alpha=0.15,
                     label=None if labelled else "spike")
        labelled = True


def _window_lines(axis: Any, windows: Sequence[dict[str, Any]], color: str) -> None:
    centers = [(w["start"] + w["end"]) / 2 for w in windows if w["count"]]
    axis.plot(centers, [w["p50_ms"] for w in windows if w["count"]], color=color, lw=1.5, label="P50 (window)")
    axis.plot(centers, [w["p99_ms"] for w in windows if w["count"]], color=color, lw=1.5, ls="--",
              label="P99 (window)")


def _thin(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    step = max(1, len(points) // MAX_SCATTER_POINTS)
    return points[::step]


def latency_over_time(report: dict[str, Any], results: Sequence[RequestResult], path: Path) -> Path:
    transients = report["transients"]
    figure, (itl_axis, ttft_axis) = plt.subplots(2, 1, figsize=(11, 7), sharex=True)
    itl_points = _thin([(later, max((later - earlier) * 1000, FLOOR_MS)) for r in results
                        for earlier, later in zip(r.token_times, r.token_times[1:], strict=False)])
    if itl_points:
        itl_axis.scatter(*zip(*itl_points, strict=True), s=3, alpha=0.25, color="tab:gray", label="token gap")
    _window_lines(itl_axis, transients["windows"]["itl"], "tab:blue")
    if transients["itl_median_ms"]:
        itl_axis.axhline(transients["itl_median_ms"] * transients["spike_factor"], color="tab:red", lw=0.8,
                         ls=":", label=f"{transients['spike_factor']:g}x median")
    stalls = transients["stalls"]["longest"]
    if stalls:
        itl_axis.scatter([s["start_s"] + s["duration_ms"] / 1000 for s in stalls],
                         [s["duration_ms"] for s in stalls], s=25, marker="v", color="tab:red",
                         label=f"stall > {transients['stall_threshold_ms']:.0f} ms")
    _shade_spikes(itl_axis, transients["spikes"], "itl")
    itl_axis.set_ylabel("ITL (ms)")
    itl_axis.set_title(f"Latency over time - {report['meta'].get('model')} ({report['workload'].get('preset')})")

    ttft_points = [(r.token_times[0], max((r.token_times[0] - r.sent_at) * 1000, FLOOR_MS))
                   for r in results if r.token_times]
    if ttft_points:
        ttft_axis.scatter(*zip(*ttft_points, strict=True), s=8, alpha=0.5, color="tab:gray", label="TTFT")
    _window_lines(ttft_axis, transients["windows"]["ttft"], "tab:green")
    _shade_spikes(ttft_axis, transients["spikes"], "ttft")
    failed = [r.finished_at for r in results if not r.success and r.finished_at == r.finished_at]
    if failed:  # along the bottom edge, whatever the scale
        ttft_axis.plot(failed, [0.03] * len(failed), "x", color="tab:red", label="failed request",
                       transform=blended_transform_factory(ttft_axis.transData, ttft_axis.transAxes))
    ttft_axis.set_ylabel("TTFT (ms)")
    ttft_axis.set_xlabel("time since start (s)")
    for axis, points in ((itl_axis, itl_points), (ttft_axis, ttft_points)):
        if points and _wide([value for _, value in points]):
            axis.set_yscale("log")
            axis.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
            axis.yaxis.set_major_formatter(PLAIN)
            axis.yaxis.set_minor_formatter(NullFormatter())
        axis.legend(loc="upper left", fontsize=8)
        axis.grid(alpha=0.3)
    return _save(figure, path)


def _cdf(axis: Any, values_ms: Sequence[float], title: str) -> None:
    if values_ms:
        ordered = np.sort(np.asarray(values_ms))
        axis.plot(ordered, np.arange(1, len(ordered) + 1) / len(ordered), color="tab:blue")
        for percentile in (50, 99):
            axis.axvline(float(np.percentile(ordered, percentile)), color="tab:gray", ls=":", lw=0.8)
        if ordered[0] > 0 and _wide(ordered):
            axis.set_xscale("log")
            axis.xaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
            axis.xaxis.set_major_formatter(PLAIN)
            axis.xaxis.set_minor_formatter(NullFormatter())
    axis.set_title(title)
    axis.set_xlabel("ms")
    axis.set_ylabel("fraction of samples")
    axis.grid(alpha=0.3)


def latency_cdfs(results: Sequence[RequestResult], path: Path) -> Path:
    figure, (ttft_axis, itl_axis) = plt.subplots(1, 2, figsize=(11, 4))
    succeeded = [result for result in results if result.success]
    _cdf(ttft_axis, [r.ttft * 1000 for r in succeeded if r.ttft is not None], "TTFT CDF")
    _cdf(itl_axis, [gap * 1000 for r in succeeded for gap in r.itls], "ITL CDF")
    return _save(figure, path)


def in_flight_series(results: Sequence[RequestResult], end: float, step: float = 0.25) -> tuple[Any, Any]:
    """Requests the client had in flight over time (the client's view of the server's load)."""
    times = np.arange(0.0, max(end, step) + step, step)
    sent = np.sort([r.sent_at for r in results if r.sent_at == r.sent_at])
    done = np.sort([r.finished_at for r in results if r.finished_at == r.finished_at])
    return times, np.searchsorted(sent, times, side="right") - np.searchsorted(done, times, side="right")


def server_metrics(report: dict[str, Any], results: Sequence[RequestResult], path: Path) -> Path:
    figure, axis = plt.subplots(figsize=(11, 4))
    times, in_flight = in_flight_series(results, report["summary"]["duration_s"])
    axis.step(times, in_flight, where="post", color="tab:gray", lw=1, label="in flight (client)")
    samples = report["server_metrics"].get("samples", [])
    for key, color in (("waiting", "tab:orange"), ("running", "tab:blue")):
        points = [(s["t"], s[key]) for s in samples if key in s]
        if points:
            axis.plot(*zip(*points, strict=True), color=color, marker=".", label=f"{key} (server)")
    preemptions = [(s["t"], s["preemptions"]) for s in samples if "preemptions" in s]
    for (_, before), (t, after) in zip(preemptions, preemptions[1:], strict=False):
        if after > before:
            axis.axvline(t, color="tab:purple", lw=0.8, ls="--")
    axis.set_xlabel("time since start (s)")
    axis.set_ylabel("requests")
    kv = [(s["t"], s["kv_usage"] * 100) for s in samples if "kv_usage" in s]
    if kv:
        kv_axis = axis.twinx()
        kv_axis.plot(*zip(*kv, strict=True), color="tab:green", label="KV cache usage %")
        kv_axis.set_ylabel("KV cache usage (%)")
        kv_axis.set_ylim(0, 105)
        kv_axis.legend(loc="upper right", fontsize=8)
    _shade_spikes(axis, report["transients"]["spikes"])
    axis.set_title("Queue and KV cache over time" if samples else "Requests in flight (no server metrics)")
    axis.legend(loc="upper left", fontsize=8)
    axis.grid(alpha=0.3)
    return _save(figure, path)


def sweep_plot(points: Sequence[dict[str, Any]], path: Path) -> Path:
    figure, axis = plt.subplots(figsize=(7, 4))
    rates = [point["request_rate"] for point in points]
    axis.plot(rates, [point["request_throughput"] for point in points], marker="o", label="throughput")
    axis.plot(rates, [point["goodput_rps"] for point in points], marker="o", label="goodput")
    axis.set_xlabel("offered rate (req/s)")
    axis.set_ylabel("req/s")
    axis.grid(alpha=0.3)
    axis.legend()
    return _save(figure, path)


def _save(figure: Any, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def write_plots(report: dict[str, Any], results: Sequence[RequestResult], directory: Path) -> list[Path]:
    return [
        latency_over_time(report, results, directory / "latency_over_time.png"),
        latency_cdfs(results, directory / "latency_cdf.png"),
        server_metrics(report, results, directory / "server_metrics.png"),
    ]
