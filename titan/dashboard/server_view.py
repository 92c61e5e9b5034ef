"""`titan serve`'s live view: what `/debug/dashboard` answers, one poll at a time.

Everything comes from what the server already keeps: its Prometheus registry (read on the event loop,
like `/metrics`) and the engine's recent step records (the same snapshot `/debug/steps` takes on the
engine thread). The HTTP side reads these copies only; it never touches engine state.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from titan.bench.metrics_scraper import MetricsSample
from titan.dashboard.spikes import SpikeTracker, attribute_live, monotonic_offset
from titan.dashboard.window import History, Snapshot, read_registry

if TYPE_CHECKING:
    from titan.server.async_engine import AsyncEngine

P = "titan:"
RATE_SPAN = 2.0  # seconds over which rates (tokens/s, 429s/s) are taken: short, so a transient shows
SPIKE_SPAN = 2.0  # seconds of observations that make one spike-detection interval
STEPS_READ = 256  # engine step records read per poll for attribution (the engine keeps a bounded ring)


@dataclass(frozen=True)
class DashboardSettings:
    window: float = 30.0  # seconds of observations behind each P50/P99
    history: int = 600  # snapshots kept (one per poll: 10 minutes at the page's 1 Hz)
    max_spikes: int = 50  # spikes remembered and listed

    def validate(self) -> DashboardSettings:
        if self.window <= 0 or self.history < 2 or self.max_spikes < 1:
            raise ValueError("need --dashboard-window > 0, --dashboard-history >= 2, --dashboard-max-spikes >= 1")
        return self


SERVER_PANELS = [
    {"title": "TTFT (ms, sliding window)", "series": ["TTFT P50", "TTFT P99"], "spikes": "ttft"},
    {"title": "Inter-token latency (ms, sliding window)", "series": ["ITL P50", "ITL P99"], "spikes": "itl"},
    {"title": "Requests", "series": ["waiting", "running"]},
    {"title": "KV cache usage (%)", "series": ["KV usage"]},
    {"title": "Tokens/s", "series": ["generated tok/s", "prompt tok/s"]},
    {"title": "Preemptions and 429s (per s)", "series": ["preemptions/s", "429s/s"]},
    {"title": "GC pause (ms per s)", "series": ["GC ms/s"]},
]


def ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1000, 3)


def gauge_sample(snapshot: Snapshot, exposed: Callable[[str], str]) -> MetricsSample:
    values: dict[str, float] = {}
    for key, name in (("waiting", "num_requests_waiting"), ("running", "num_requests_running"),
                      ("kv_usage", "kv_cache_usage_perc")):
        value = snapshot.total(exposed(name))
        if value is not None:
            values[key] = value
    return MetricsSample(snapshot.t, values)


class ServerDashboard:
    def __init__(self, engine: AsyncEngine, settings: DashboardSettings) -> None:
        self.engine = engine
        self.settings = settings.validate()
        self.history = History(self.read, settings.history)
        self.spikes = SpikeTracker(settings.history, settings.max_spikes)
        self.last_spike_check: float | None = None

    def exposed(self, metric: str) -> str:
        """A metric's exposed name under the server's `--metrics-prefix`."""
        metrics = self.engine.metrics
        return metrics.name(metric) if metrics is not None else P + metric

    def read(self) -> Snapshot:
        metrics = self.engine.metrics
        if metrics is None:  # still loading: an empty reading
            return Snapshot(time.monotonic())
        return read_registry(metrics.registry)

    async def data(self) -> dict[str, Any]:
        now = self.history.take()
        history, window = self.history, self.settings.window
        ttft50, ttft99 = history.window_quantiles(self.exposed("time_to_first_token_seconds"), window, (0.5, 0.99))
        itl50, itl99 = history.window_quantiles(self.exposed("inter_token_latency_seconds"), window, (0.5, 0.99))
        kv = now.total(self.exposed("kv_cache_usage_perc"))
        gc = history.rate(self.exposed("gc_pause_seconds_sum"), RATE_SPAN)
        values = {
            "TTFT P50": ms(ttft50), "TTFT P99": ms(ttft99), "ITL P50": ms(itl50), "ITL P99": ms(itl99),
            "waiting": now.total(self.exposed("num_requests_waiting")),
            "running": now.total(self.exposed("num_requests_running")),
            "KV usage": None if kv is None else round(kv * 100, 2),
            "generated tok/s": history.rate(self.exposed("generation_tokens_total"), RATE_SPAN),
            "prompt tok/s": history.rate(self.exposed("prompt_tokens_total"), RATE_SPAN),
            "preemptions/s": history.rate(self.exposed("num_preemptions_total"), RATE_SPAN),
            "429s/s": history.rate(self.exposed("admission_rejections_total"), RATE_SPAN),
            "GC ms/s": None if gc is None else gc * 1000,
        }
        await self.check_spikes(now)
        offset = monotonic_offset()
        return {"object": "dashboard", "kind": "server", "title": f"Titan · {self.title()}",
                "time": now.t + offset, "window_s": window, "panels": SERVER_PANELS, "values": values,
                "spikes": [spike.to_json(offset) for spike in self.spikes.spikes]}

    def title(self) -> str:
        info = self.engine.info
        return info.model_name if info is not None else "loading"

    async def check_spikes(self, now: Snapshot) -> None:
        """One detection interval per SPIKE_SPAN seconds of polls, whatever the number of viewers."""
        if self.last_spike_check is not None and now.t - self.last_spike_check < SPIKE_SPAN:
            return
        start = self.last_spike_check if self.last_spike_check is not None else now.t - SPIKE_SPAN
        self.last_spike_check = now.t
        opened = []
        for metric, name in (("ttft", "time_to_first_token_seconds"), ("itl", "inter_token_latency_seconds")):
            (p99,) = self.history.window_quantiles(self.exposed(name), now.t - start, (0.99,))
            spike = self.spikes.observe(metric, start, now.t, p99)
            if spike is not None:
                opened.append(spike)
        if not opened:
            return
        records = await self.engine.recent_steps(STEPS_READ)
        steps = [{"t": r.started, "duration": r.duration, "num_prefill_tokens": r.num_prefill_tokens,
                  "num_preemptions": r.num_preemptions, "gc_pause": r.gc_pause} for r in records]
        ready = self.engine.ready_time
        ready_t = None if ready is None else ready - monotonic_offset()
        scrapes = [gauge_sample(snapshot, self.exposed) for snapshot in self.history.snapshots]
        for spike in opened:
            attribute_live(spike, scrapes, steps, ready_t)
