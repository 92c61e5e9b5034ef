"""`titan router`'s live view, per backend: first-byte latency (a stream's first output event: about its
TTFT) P50/P99 over the window, outstanding requests, the backends' scraped queues and KV usage, request
and error rates; spikes in a backend's first-byte P99, attributed from its scraped gauges."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from titan.bench.metrics_scraper import MetricsSample
from titan.dashboard.server_view import RATE_SPAN, SPIKE_SPAN, DashboardSettings, ms
from titan.dashboard.spikes import SpikeTracker, attribute_live, monotonic_offset
from titan.dashboard.window import History, Labels, Snapshot, read_registry

if TYPE_CHECKING:
    from titan.router.app import RouterApp

P = "titan_router:"


def of_backend(name: str) -> Any:
    def where(labels: Labels) -> bool:
        return ("backend", name) in labels
    return where


class RouterDashboard:
    def __init__(self, app: RouterApp, settings: DashboardSettings) -> None:
        self.app = app
        self.settings = settings.validate()
        self.history = History(lambda: read_registry(app.metrics.registry), settings.history)
        self.spikes = SpikeTracker(settings.history, settings.max_spikes)
        self.last_spike_check: float | None = None

    def backends(self) -> list[str]:
        pool = self.app.pool
        return [backend.name for backend in [*pool.backends, *pool.retiring.values()]]

    async def data(self) -> dict[str, Any]:
        now = self.history.take()
        history, window, names = self.history, self.settings.window, self.backends()
        values: dict[str, float | None] = {}
        for name in names:
            where = of_backend(name)
            p50, p99 = history.window_quantiles(P + "first_byte_seconds", window, (0.5, 0.99), where)
            kv = now.total(P + "backend_kv_cache_usage", where)
            values.update({
                f"{name} P50": ms(p50), f"{name} P99": ms(p99),
                f"{name} outstanding": now.total(P + "backend_outstanding", where),
                f"{name} waiting": nan_to_none(now.total(P + "backend_waiting", where)),
                f"{name} KV": None if kv is None or kv != kv else round(kv * 100, 2),
                f"{name} req/s": history.rate(P + "requests_total", RATE_SPAN, where),
                f"{name} errors/s": history.rate(P + "errors_total", RATE_SPAN, where),
                f"{name} ready": now.total(P + "backend_ready", where),
            })
        values["degraded/s"] = history.rate(P + "degraded_requests_total", RATE_SPAN)
        values["unrouted/s"] = history.rate(P + "unrouted_total", RATE_SPAN)

        def per_backend(suffix: str) -> list[str]:
            return [f"{name} {suffix}" for name in names]

        panels = [
            {"title": "First byte ≈ TTFT P99 (ms, sliding window)", "series": per_backend("P99"),
             "spikes": "first_byte"},
            {"title": "First byte ≈ TTFT P50 (ms, sliding window)", "series": per_backend("P50")},
            {"title": "Outstanding requests", "series": per_backend("outstanding")},
            {"title": "Queue (scraped num_requests_waiting)", "series": per_backend("waiting")},
            {"title": "KV cache usage (%, scraped)", "series": per_backend("KV")},
            {"title": "Requests/s", "series": per_backend("req/s")},
            {"title": "Failed attempts/s, degraded and unrouted requests/s",
             "series": [*per_backend("errors/s"), "degraded/s", "unrouted/s"]},
            {"title": "In the pool (1 = ready)", "series": per_backend("ready")},
        ]
        self.check_spikes(now, names)
        offset = monotonic_offset()
        return {"object": "dashboard", "kind": "router", "title": f"Titan router · policy {self.app.config.policy}",
                "time": now.t + offset, "window_s": window, "panels": panels, "values": values,
                "spikes": [spike.to_json(offset) for spike in self.spikes.spikes]}

    def check_spikes(self, now: Snapshot, names: list[str]) -> None:
        if self.last_spike_check is not None and now.t - self.last_spike_check < SPIKE_SPAN:
            return
        start = self.last_spike_check if self.last_spike_check is not None else now.t - SPIKE_SPAN
        self.last_spike_check = now.t
        for name in names:
            where = of_backend(name)
            (p99,) = self.history.window_quantiles(P + "first_byte_seconds", now.t - start, (0.99,), where)
            spike = self.spikes.observe(f"first_byte:{name}", start, now.t, p99)
            if spike is None:
                continue
            scrapes = [MetricsSample(snapshot.t, {key: value for key, value in (
                ("waiting", nan_to_none(snapshot.total(P + "backend_waiting", where))),
                ("running", snapshot.total(P + "backend_outstanding", where)),
                ("kv_usage", nan_to_none(snapshot.total(P + "backend_kv_cache_usage", where))),
            ) if value is not None}) for snapshot in self.history.snapshots]
            attribute_live(spike, scrapes, [], None)


def nan_to_none(value: float | None) -> float | None:
    return None if value is None or value != value else value
