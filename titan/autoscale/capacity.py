"""What one replica can do: a latency curve over concurrency, from a capacity file or `titan bench` results.

The simulator treats a replica as continuous batching does: the requests it runs share it, each progressing
at 1 / latency(n) of its work per second while n run together (processor sharing). So a replica running n
requests completes n / latency(n) of them per second, the throughput a closed-loop benchmark at concurrency n
measures. Beyond the last measured point throughput is held flat (latency grows with n); beyond
`max_concurrency` requests wait in the replica's queue (`titan:num_requests_waiting`).

Accepted inputs (`load_capacity`):

- a capacity file, `{"schema": "titan-capacity/1", "max_concurrency": 32, "cold_start_s": 40, "points":
  [{"concurrency": 1, "latency_s": 2.0}, {"concurrency": 8, "latency_s": 2.6}, ...]}`; a point may give
  `{"throughput_rps", "latency_s"}` instead of a concurrency (then concurrency = throughput x latency,
  Little's law);
- `titan bench` results (`result.json`, schema titan-bench/1) - one point each: the run's
  `config.max_concurrency` when it ran closed-loop (no request rate), else request throughput x mean E2E
  latency; latency is the mean E2E latency. Several files, a directory of them, or a sweep directory (its
  `rate-*/result.json`) give several points. Open-loop points past the server's saturation carry server-side
  queueing in their latency; they still describe throughput correctly (that is all the curve uses there).
"""

from __future__ import annotations

import bisect
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CAPACITY_SCHEMA = "titan-capacity/1"
BENCH_SCHEMA = "titan-bench/1"
SWEEP_SCHEMA = "titan-bench-sweep/1"


@dataclass(frozen=True)
class CapacityProfile:
    concurrency: tuple[float, ...]  # increasing
    latency_s: tuple[float, ...]  # E2E latency of a mean-sized request at that concurrency
    max_concurrency: int  # requests a replica runs at once; more wait in its queue
    cold_start_s: float | None = None  # pod created -> ready, when the source says
    source: str = ""

    def __post_init__(self) -> None:
        if not self.concurrency or len(self.concurrency) != len(self.latency_s):
            raise ValueError("a capacity profile needs matching, non-empty concurrency and latency lists")
        if any(b <= a for a, b in zip(self.concurrency, self.concurrency[1:], strict=False)):
            raise ValueError("capacity points must have distinct concurrencies")
        if any(value <= 0 for value in (*self.concurrency, *self.latency_s)) or self.max_concurrency < 1:
            raise ValueError("concurrency, latency and max_concurrency must be positive")

    def latency_at(self, running: int | float) -> float:
        """Per-request latency with `running` requests sharing the replica (piecewise linear in between)."""
        points, latencies = self.concurrency, self.latency_s
        if running <= points[0]:
            return latencies[0]
        if running >= points[-1]:
            return latencies[-1] * running / points[-1]  # throughput stays at its last measured value
        index = bisect.bisect_right(points, running)
        left, right = points[index - 1], points[index]
        share = (running - left) / (right - left)
        return latencies[index - 1] + share * (latencies[index] - latencies[index - 1])

    def throughput_at(self, running: int) -> float:
        return running / self.latency_at(running) if running > 0 else 0.0

    @property
    def max_throughput(self) -> float:
        """Requests per second one replica completes when full (at the best concurrency it may run)."""
        return max(self.throughput_at(n) for n in range(1, self.max_concurrency + 1))

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": CAPACITY_SCHEMA, "source": self.source, "max_concurrency": self.max_concurrency,
            "cold_start_s": self.cold_start_s, "max_throughput_rps": self.max_throughput,
            "points": [{"concurrency": concurrency, "latency_s": latency}
                       for concurrency, latency in zip(self.concurrency, self.latency_s, strict=True)],
        }


# Illustrative only (roughly a small model on a few CPU cores): used when no capacity is given.
EXAMPLE_PROFILE = CapacityProfile(
    concurrency=(1.0, 4.0, 8.0, 16.0), latency_s=(2.0, 2.4, 3.0, 4.4), max_concurrency=16, cold_start_s=30.0,
    source="built-in example (not measured)",
)


def _merge_points(points: Iterable[tuple[float, float]]) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Sort by concurrency; points at (nearly) the same concurrency are averaged."""
    merged: dict[float, list[float]] = {}
    for concurrency, latency in points:
        merged.setdefault(round(concurrency, 6), []).append(latency)
    keys = sorted(merged)
    return tuple(keys), tuple(sum(merged[key]) / len(merged[key]) for key in keys)


def profile_from_capacity_json(data: dict[str, Any], source: str = "") -> CapacityProfile:
    points = []
    for point in data.get("points", []):
        latency = float(point["latency_s"])
        if "concurrency" in point:
            concurrency = float(point["concurrency"])
        elif "throughput_rps" in point:
            concurrency = float(point["throughput_rps"]) * latency
        else:
            raise ValueError(f"{source}: each point needs 'concurrency' or 'throughput_rps' "
                             "beside 'latency_s'")
        points.append((concurrency, latency))
    if not points:
        raise ValueError(f"{source}: no points")
    concurrency, latency = _merge_points(points)
    max_concurrency = int(data.get("max_concurrency") or math.ceil(concurrency[-1]))
    cold_start = data.get("cold_start_s")
    return CapacityProfile(concurrency, latency, max_concurrency,
                           float(cold_start) if cold_start is not None else None, source)


def point_from_bench_result(report: dict[str, Any], source: str = "") -> tuple[float, float]:
    """(concurrency, mean E2E seconds) from one `titan bench` result."""
    try:
        e2e_ms = report["latency_ms"]["e2e"]["mean"]
        throughput = float(report["summary"]["request_throughput"])
    except (KeyError, TypeError) as error:
        raise ValueError(f"{source}: titan bench result without latency_ms.e2e.mean / summary") from error
    if e2e_ms is None or e2e_ms <= 0 or throughput <= 0:
        raise ValueError(f"{source}: the bench run completed no requests")
    config = report.get("config", {})
    latency = float(e2e_ms) / 1000
    closed_loop = config.get("request_rate") is None and config.get("max_concurrency")
    concurrency = float(config["max_concurrency"]) if closed_loop else throughput * latency
    return concurrency, latency


def _bench_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    direct = path / "result.json"
    if direct.is_file():
        return [direct]
    return sorted(path.glob("*/result.json"))


def load_capacity(paths: Sequence[str | Path], max_concurrency: int | None = None,
                  cold_start_s: float | None = None) -> CapacityProfile:
    """A profile from one capacity file or from `titan bench` results; the keywords override the files."""
    points: list[tuple[float, float]] = []
    cold_start, declared_max, sources = None, None, []
    for raw in paths:
        path = Path(raw)
        files = _bench_files(path)
        if path.is_file() and path.suffix == ".json":
            data = json.loads(path.read_text(encoding="utf-8"))
            if isinstance(data, dict) and data.get("schema") == CAPACITY_SCHEMA:
                profile = profile_from_capacity_json(data, str(path))
                points += zip(profile.concurrency, profile.latency_s, strict=True)
                declared_max = max(declared_max or 0, profile.max_concurrency)
                cold_start = profile.cold_start_s if cold_start is None else cold_start
                sources.append(str(path))
                continue
            if isinstance(data, dict) and data.get("schema") == SWEEP_SCHEMA:
                files = sorted(path.parent.glob("rate-*/result.json"))
                if not files:
                    raise ValueError(f"{path}: a sweep summary has no latencies; keep its rate-*/result.json "
                                     "folders beside it")
        if not files:
            raise ValueError(f"{path}: no capacity file or titan bench result.json found")
        for file in files:
            report = json.loads(file.read_text(encoding="utf-8"))
            if not isinstance(report, dict) or report.get("schema") != BENCH_SCHEMA:
                raise ValueError(f"{file}: neither {CAPACITY_SCHEMA} nor a titan bench result "
                                 f"({BENCH_SCHEMA})")
            points.append(point_from_bench_result(report, str(file)))
            sources.append(str(file))
    if not points:
        raise ValueError("no capacity points")
    concurrency, latency = _merge_points(points)
    chosen_max = max_concurrency or declared_max or max(1, math.ceil(concurrency[-1] - 1e-9))
    chosen_cold_start = cold_start_s if cold_start_s is not None else cold_start
    return CapacityProfile(concurrency, latency, chosen_max, chosen_cold_start, ", ".join(sources))
