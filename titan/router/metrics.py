"""The router's own Prometheus metrics, `titan_router:*`, one `backend` label (the backend's name).

- requests_total: attempts sent to a backend (a retried request counts once on each backend it tried)
- errors_total{reason}: failed attempts — connect, timeout, disconnect (closed before the first byte),
  http_502/503/504 (answers that send the request elsewhere), stream (failed after the first byte)
- retries_total: requests sent elsewhere after failing on this backend before their first byte
- first_byte_seconds / request_duration_seconds: attempt start to the first byte passed on (for a stream,
  the first event with output: about the time to first token) and to the last byte
- backend_ready, backend_outstanding, backend_waiting, backend_kv_cache_usage: the routing state
- unrouted_total{reason}: requests the router answered itself (no_backend: none ready; failed: every
  attempt failed before its first byte)

A backend that leaves the pool (discovery) takes its series with it once its last open request ends:
pod addresses churn under autoscaling, and series kept for each would grow without bound.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

PREFIX = "titan_router:"

FIRST_BYTE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0,
                      7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
DURATION_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 45.0,
                    60.0, 120.0, 240.0, 480.0, 960.0)


class RouterMetrics:
    def __init__(self, backend_names: list[str]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        backend = ["backend"]
        self.requests = Counter(PREFIX + "requests_total", "Attempts sent to a backend.", backend,
                                registry=self.registry)
        self.errors = Counter(PREFIX + "errors_total", "Failed attempts by reason.", ["backend", "reason"],
                              registry=self.registry)
        self.retries = Counter(PREFIX + "retries_total",
                               "Requests sent elsewhere after failing here before their first byte.", backend,
                               registry=self.registry)
        self.first_byte = Histogram(PREFIX + "first_byte_seconds", "Attempt start to the first body byte.",
                                    backend, buckets=FIRST_BYTE_BUCKETS, registry=self.registry)
        self.duration = Histogram(PREFIX + "request_duration_seconds", "Attempt start to the last byte.",
                                  backend, buckets=DURATION_BUCKETS, registry=self.registry)
        self.ready = Gauge(PREFIX + "backend_ready", "1 while the backend is in the pool.", backend,
                           registry=self.registry)
        self.outstanding = Gauge(PREFIX + "backend_outstanding", "Requests open on the backend.", backend,
                                 registry=self.registry)
        self.waiting = Gauge(PREFIX + "backend_waiting", "Scraped num_requests_waiting.",
                             backend, registry=self.registry)
        self.kv_cache_usage = Gauge(PREFIX + "backend_kv_cache_usage",
                                    "Scraped kv_cache_usage_perc, 0 to 1.", backend,
                                    registry=self.registry)
        self.unrouted = Counter(PREFIX + "unrouted_total", "Requests the router answered itself.", ["reason"],
                                registry=self.registry)
        for name in backend_names:
            self.add_backend(name)
        for reason in ("no_backend", "failed"):
            self.unrouted.labels(reason)

    def add_backend(self, name: str) -> None:
        """A backend's series exist from the moment it is in the pool, at 0."""
        self.requests.labels(name)
        self.retries.labels(name)
        self.ready.labels(name).set(0)
        self.outstanding.labels(name).set(0)

    def forget_backend(self, name: str) -> None:
        for metric in (self.requests, self.retries, self.first_byte, self.duration, self.ready, self.outstanding,
                       self.waiting, self.kv_cache_usage, self.errors):
            metric.remove_by_labels({"backend": name})

    def render(self) -> bytes:
        return generate_latest(self.registry)
