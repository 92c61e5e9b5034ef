"""`titan bench` arrival processes: rate, gamma shape, ramp-up, bursts, seeds."""

import itertools
import math
import statistics

import pytest

from titan.bench.arrivals import ArrivalProcess


def take(process: ArrivalProcess, count: int) -> list[float]:
    return list(itertools.islice(process.offsets(), count))


def gaps(offsets: list[float]) -> list[float]:
    return [later - earlier for earlier, later in zip([0.0, *offsets], offsets, strict=False)]


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_gamma_gaps_have_the_asked_rate_and_shape(burstiness: float) -> None:
    offsets = take(ArrivalProcess(rate=5.0, burstiness=burstiness, seed=3), 40_000)
    intervals = gaps(offsets)
    mean = statistics.fmean(intervals)
    assert mean == pytest.approx(0.2, rel=0.03)
    # A gamma variable of shape k has a coefficient of variation of 1 / sqrt(k).
    assert statistics.pstdev(intervals) / mean == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)
    assert offsets == sorted(offsets)


def test_seed_repeats_and_varies() -> None:
    assert take(ArrivalProcess(2.0, seed=7), 50) == take(ArrivalProcess(2.0, seed=7), 50)
    assert take(ArrivalProcess(2.0, seed=7), 50) != take(ArrivalProcess(2.0, seed=8), 50)


def test_linear_ramp_up_follows_the_expected_count() -> None:
    process = ArrivalProcess(rate=100.0, ramp_up=100.0, seed=1)
    offsets = take(process, 12_000)
    in_ramp = sum(t < 100.0 for t in offsets)
    first_half = sum(t < 50.0 for t in offsets)
    after = sum(100.0 <= t < 150.0 for t in offsets)
    assert in_ramp == pytest.approx(process.expected_count(100.0), rel=0.03)  # 5000
    assert first_half == pytest.approx(process.expected_count(50.0), rel=0.05)  # 1250: a quarter of it
    assert after == pytest.approx(5000, rel=0.05)
    assert process.expected_count(100.0) == 5000 and process.expected_count(50.0) == 1250


def test_bursts_are_simultaneous_and_merge_with_background() -> None:
    only_bursts = take(ArrivalProcess(rate=0.0, burst_size=3, burst_interval=10.0), 7)
    assert only_bursts == [10.0, 10.0, 10.0, 20.0, 20.0, 20.0, 30.0]
    mixed = take(ArrivalProcess(rate=1.0, burst_size=4, burst_interval=5.0, seed=2), 200)
    assert mixed == sorted(mixed)
    assert sum(t == 5.0 for t in mixed) == 4 and sum(t == 10.0 for t in mixed) == 4
    assert ArrivalProcess(rate=1.0, burst_size=4, burst_interval=5.0).expected_count(12.0) == 12 + 8


def test_infinite_rate_sends_everything_at_once() -> None:
    assert take(ArrivalProcess(rate=math.inf), 5) == [0.0] * 5
    assert ArrivalProcess(rate=math.inf).expected_count(3.0) == math.inf


@pytest.mark.parametrize("kwargs", [
    {"rate": -1.0}, {"rate": math.nan}, {"rate": 1.0, "burstiness": 0.0}, {"rate": 1.0, "ramp_up": -1.0},
    {"rate": 1.0, "burst_size": 2}, {"rate": 0.0},
])
def test_invalid_processes_are_refused(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        ArrivalProcess(**kwargs)
