"""The garbage-collector discipline: pauses are measured, full collections wait for idle time."""

import gc

from titan.engine import gc_discipline
from titan.engine.gc_discipline import GcMonitor


def test_pauses_are_measured_and_reported_to_listeners() -> None:
    monitor = GcMonitor.install()
    assert GcMonitor.install() is monitor  # one per process
    seen: list[tuple[int, float]] = []
    monitor.listeners.append(lambda generation, seconds: seen.append((generation, seconds)))
    try:
        before = monitor.num_collections, monitor.total_pause_seconds
        gc.collect()
        assert monitor.num_collections == before[0] + 1
        assert monitor.total_pause_seconds > before[1]
        assert seen and seen[-1][0] == 2 and seen[-1][1] > 0
    finally:
        monitor.listeners.clear()


def test_settling_freezes_and_raises_thresholds_then_collects_only_when_due(monkeypatch) -> None:
    thresholds = gc.get_threshold()
    monitor = GcMonitor.install()
    try:
        monitor.settle_after_warmup()
        assert gc.get_threshold() == gc_discipline.BUSY_THRESHOLDS
        assert gc.get_freeze_count() > 0
        assert not monitor.collect_if_idle_and_due()  # just collected
        monkeypatch.setattr(gc_discipline, "IDLE_COLLECTION_INTERVAL_SECONDS", 0.0)
        collections = monitor.num_collections
        assert monitor.collect_if_idle_and_due()
        assert monitor.num_collections == collections + 1
    finally:
        gc.unfreeze()
        gc.set_threshold(*thresholds)
