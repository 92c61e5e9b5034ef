"""Scrape the server's Prometheus `/metrics` once a second while the load runs.

Reads vLLM's metric names under either prefix, `titan:` or `vllm:`, and reduces each scrape to a few
canonical series (queue, running, KV usage, preemptions, GC, engine step time) that spike attribution and
the plots use. Servers without such metrics (llama.cpp, TGI) simply yield no series.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

PREFIXES = ("titan", "vllm")

# canonical name -> metric names (without prefix) to try in order; values are summed over label sets.
GAUGES = {
    "waiting": ("num_requests_waiting",),
    "running": ("num_requests_running",),
    "kv_usage": ("kv_cache_usage_perc", "gpu_cache_usage_perc"),
}
COUNTERS = {
    "preemptions": ("num_preemptions_total",),
    "prompt_tokens": ("prompt_tokens_total",),
    "generation_tokens": ("generation_tokens_total",),
    "requests_finished": ("request_success_total",),
    "step_seconds_sum": ("engine_step_seconds_sum",),
    "step_count": ("engine_step_seconds_count",),
}
# Histograms whose largest observation in each scrape interval we bound from the bucket deltas.
HISTOGRAM_MAX = {
    "step_seconds_max": "engine_step_seconds",
    "iteration_tokens_max": "iteration_tokens_total",
}

# Metric families the reducer reads, under either prefix (a counter's family drops its `_total`).
READ_FAMILIES = tuple(
    f"{prefix}:{name.removesuffix('_total')}"
    for prefix in PREFIXES
    for name in [*(n for options in (*GAUGES.values(), *COUNTERS.values()) for n in options), *HISTOGRAM_MAX.values()]
) + ("python_gc_collections",)


def read_lines(text: str, families: tuple[str, ...] = READ_FAMILIES) -> str:
    """The sample and # HELP / # TYPE lines whose metric name starts with one of `families` (a histogram's
    `_sum` line alone keeps no # TYPE line: it then parses as an untyped sample of the same name).

    Scrapes run on an event loop that has other work: the bench client stamps every token's arrival on
    it, the router proxies streams. Titan's whole `/metrics` (~600 lines) took 10-15 ms to parse, 20-30 ms
    on a busy 2-core host, and each parse delayed what arrived meanwhile (the bench read those delays as
    the server's token gaps). Kept to the families a reader needs, the parse is a few lines' work.
    """
    kept = []
    for line in text.splitlines():
        words = line.split()
        if not words:
            continue
        name = words[2] if words[0] == "#" and len(words) > 2 else words[0].split("{", 1)[0]
        if name.startswith(families):
            kept.append(line)
    return "\n".join(kept) + "\n"


def parse_prometheus_text(text: str) -> list[Sample]:
    """Prometheus text exposition format, through prometheus_client's parser. A server whose text does not
    parse as a whole (some exporters bend the format) is read line by line, and the lines that still do
    not parse are skipped, not fatal."""
    try:
        return [sample for family in text_string_to_metric_families(text) for sample in family.samples]
    except ValueError:
        pass
    samples: list[Sample] = []
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        try:
            samples.extend(sample for family in text_string_to_metric_families(line + "\n")
                           for sample in family.samples)
        except ValueError:
            continue
    return samples


@dataclass
class MetricsSample:
    """One scrape: `t` is seconds since the run's start; `values` holds the canonical series found."""

    t: float
    values: dict[str, float] = field(default_factory=dict)


def detect_prefix(samples: list[Sample]) -> str | None:
    names = {sample.name for sample in samples}
    for prefix in PREFIXES:
        if any(f"{prefix}:{metric}" in names for options in GAUGES.values() for metric in options):
            return prefix
    return None


def _sum(samples: list[Sample], name: str) -> float | None:
    values = [sample.value for sample in samples if sample.name == name]
    return sum(values) if values else None


def _buckets(samples: list[Sample], name: str) -> dict[float, float]:
    buckets: dict[float, float] = {}
    for sample in samples:
        if sample.name == f"{name}_bucket" and "le" in sample.labels:
            bound = float(sample.labels["le"])
            buckets[bound] = buckets.get(bound, 0.0) + sample.value
    return buckets


def max_bound(previous: dict[float, float], current: dict[float, float]) -> float | None:
    """Upper bound of the largest observation between two cumulative bucket snapshots (None: none)."""
    total = current.get(math.inf, 0.0) - previous.get(math.inf, 0.0)
    if total <= 0:
        return None
    for bound in sorted(current):
        if current[bound] - previous.get(bound, 0.0) >= total:
            return bound
    return math.inf


class MetricsReducer:
    """Turns raw scrapes into canonical values, remembering bucket counts between scrapes."""

    def __init__(self) -> None:
        self.prefix: str | None = None
        self._previous_buckets: dict[str, dict[float, float]] = {}

    def reduce(self, samples: list[Sample]) -> dict[str, float]:
        if self.prefix is None:
            self.prefix = detect_prefix(samples)
        values: dict[str, float] = {}
        if self.prefix is not None:
            for table in (GAUGES, COUNTERS):
                for canonical, names in table.items():
                    for name in names:
                        value = _sum(samples, f"{self.prefix}:{name}")
                        if value is not None:
                            values[canonical] = value
                            break
            if "kv_usage" in values and values["kv_usage"] > 1.0:  # a server reporting 0..100
                values["kv_usage"] /= 100.0
            for canonical, name in HISTOGRAM_MAX.items():
                current = _buckets(samples, f"{self.prefix}:{name}")
                if not current:
                    continue
                previous = self._previous_buckets.get(canonical)
                self._previous_buckets[canonical] = current
                if previous is not None:
                    bound = max_bound(previous, current)
                    if bound is not None and math.isfinite(bound):
                        values[canonical] = bound
        # prometheus_client's default GC collector, on any server written with it.
        collections = [s for s in samples if s.name == "python_gc_collections_total"]
        if collections:
            values["gc_collections"] = sum(s.value for s in collections)
            values["gc_gen2_collections"] = sum(s.value for s in collections if s.labels.get("generation") == "2")
        return values


class MetricsScraper:
    """Background task: GET /metrics every `interval` seconds until stopped."""

    def __init__(self, client: httpx.AsyncClient, url: str, start: float, interval: float = 1.0,
                 max_failures: int = 3) -> None:
        self.client = client
        self.url = url
        self.start = start
        self.interval = interval
        self.max_failures = max_failures
        self.samples: list[MetricsSample] = []
        self.reducer = MetricsReducer()
        self.error: str | None = None
        self._failures = 0

    async def scrape_once(self) -> bool:
        sent = time.perf_counter()
        try:
            response = await self.client.get(self.url, timeout=max(self.interval, 1.0))
            if response.status_code != 200:
                raise RuntimeError(f"HTTP {response.status_code}")
            samples = parse_prometheus_text(read_lines(response.text))
        except (httpx.HTTPError, RuntimeError) as error:
            self._failures += 1
            self.error = f"{self.url}: {type(error).__name__}: {error}"
            return False
        received = time.perf_counter()
        self._failures = 0
        self.error = None
        # The server read its gauges somewhere in between; the midpoint is the best guess.
        moment = (sent + received) / 2 - self.start
        self.samples.append(MetricsSample(moment, self.reducer.reduce(samples)))
        return True

    async def run(self, stop: asyncio.Event) -> None:
        next_due = time.perf_counter()
        while not stop.is_set() and self._failures < self.max_failures:
            await self.scrape_once()
            next_due += self.interval
            try:
                await asyncio.wait_for(stop.wait(), timeout=max(next_due - time.perf_counter(), 0.0))
            except TimeoutError:
                pass
        if stop.is_set() and self._failures < self.max_failures:
            await self.scrape_once()  # the state right after the last request

    def to_dict(self) -> dict[str, Any]:
        available = any(sample.values for sample in self.samples)
        return {
            "available": available,
            "prefix": self.reducer.prefix,
            "url": self.url,
            "interval_s": self.interval,
            "error": None if available else (self.error or "no titan:/vllm: metrics found"),
            "samples": [{"t": round(s.t, 4), **s.values} for s in self.samples] if available else [],
        }
