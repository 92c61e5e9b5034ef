"""Garbage-collector discipline: the collector must not pause a busy engine.

CPython's cyclic collector runs whenever allocation counters cross thresholds; a full (generation 2)
collection over a large heap takes tens of milliseconds and lands on a random engine step — a
transient. After warm-up we freeze everything alive (models, tokenizer, caches never need scanning),
raise the thresholds, and run full collections ourselves only while the engine is idle. Every pause
is measured through `gc.callbacks`.
"""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Callable

# Young generations still collect (cheap: few objects); generation 2 only when we ask for it.
BUSY_THRESHOLDS = (50_000, 50, 1_000_000)
IDLE_COLLECTION_INTERVAL_SECONDS = 30.0

PauseListener = Callable[[int, float], None]  # (generation, seconds)


class GcMonitor:
    """Times every collection; one per process (`gc.callbacks` is process-wide)."""

    _instance: GcMonitor | None = None
    _lock = threading.Lock()

    def __init__(self) -> None:
        self.total_pause_seconds = 0.0
        self.num_collections = 0
        self.listeners: list[PauseListener] = []
        self._started: float | None = None
        self._last_full_collection = time.monotonic()

    @classmethod
    def install(cls) -> GcMonitor:
        with cls._lock:
            if cls._instance is None:
                cls._instance = cls()
                gc.callbacks.append(cls._instance._callback)
            return cls._instance

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        if self._started is None:
            return
        pause = time.perf_counter() - self._started
        self._started = None
        self.total_pause_seconds += pause
        self.num_collections += 1
        for listener in self.listeners:
            listener(info.get("generation", -1), pause)

    def settle_after_warmup(self) -> None:
        """Collect once, freeze the survivors and keep full collections for idle time."""
        gc.collect()
        gc.freeze()
        gc.set_threshold(*BUSY_THRESHOLDS)
        self._last_full_collection = time.monotonic()

    def collect_if_idle_and_due(self) -> bool:
        """Called when the engine has nothing to do: a full collection costs no request anything now."""
        if time.monotonic() - self._last_full_collection < IDLE_COLLECTION_INTERVAL_SECONDS:
            return False
        gc.collect()
        self._last_full_collection = time.monotonic()
        return True
