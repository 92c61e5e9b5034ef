"""The block-bootstrap interval of a run's ITL P99 / P50 (titan.bench.uncertainty): wide when the tail is one
stretch of the run, narrow when every stretch has it."""

from __future__ import annotations

import pytest

from titan.bench.analysis import LatencySample
from titan.bench.uncertainty import BLOCK_SECONDS, MIN_BLOCKS, tail_ratio_interval


def stretch(block: int, gaps: list[float]) -> list[LatencySample]:
    """Gaps observed inside block number `block`, evenly spread over it."""
    start, step = block * BLOCK_SECONDS, BLOCK_SECONDS / (len(gaps) + 1)
    return [LatencySample(start + (i + 1) * step, gap, 0) for i, gap in enumerate(gaps)]


def test_a_flat_run_reads_one_with_no_spread() -> None:
    samples = [s for block in range(20) for s in stretch(block, [0.010] * 100)]
    interval = tail_ratio_interval(samples)
    assert interval is not None
    assert (interval.estimate, interval.low, interval.high) == pytest.approx((1.0, 1.0, 1.0))
    assert not interval.straddles(2.0)


def test_a_tail_from_one_stretch_could_vanish_on_another_draw() -> None:
    # 20 stretches of 100 gaps of 10 ms; one stretch has 30 gaps of 50 ms among them: 1.5 % of the run, so the
    # P99 is 50 ms. A draw without that stretch (about a third of them) reads 1.0, one with it twice 5.0.
    samples = [s for block in range(20)
               for s in stretch(block, [0.050] * 30 + [0.010] * 70 if block == 7 else [0.010] * 100)]
    interval = tail_ratio_interval(samples)
    assert interval is not None
    assert interval.estimate == pytest.approx(5.0)
    assert interval.low == pytest.approx(1.0) and interval.high == pytest.approx(5.0)
    assert interval.straddles(2.0)


def test_a_tail_in_every_stretch_is_certain() -> None:
    # 2 slow gaps in each stretch of 100: every draw holds 2 % slow gaps, so its P99 is a slow gap
    samples = [s for block in range(20) for s in stretch(block, [0.010] * 98 + [0.050] * 2)]
    interval = tail_ratio_interval(samples)
    assert interval is not None
    assert (interval.estimate, interval.low, interval.high) == pytest.approx((5.0, 5.0, 5.0))
    assert not interval.straddles(2.0)


def test_draws_are_reproducible_and_too_short_a_run_has_no_interval() -> None:
    samples = [s for block in range(20) for s in stretch(block, [0.010 + 0.001 * (block % 7)] * 50)]
    assert tail_ratio_interval(samples, seed=3) == tail_ratio_interval(samples, seed=3)
    short = [s for block in range(MIN_BLOCKS - 1) for s in stretch(block, [0.010] * 100)]
    assert tail_ratio_interval(short) is None


def test_a_median_of_chunked_reads_gives_no_interval() -> None:
    # in three stretches of four, tokens mostly arrive several to a chunk (gaps of 0): 45 % of the run's gaps, so
    # its own median is 10 ms, but a redrawn run with few of the other stretches has a median of 0
    chunked = [0.0] * 60 + [0.010] * 40
    samples = [s for block in range(20) for s in stretch(block, chunked if block % 4 else [0.010] * 100)]
    assert tail_ratio_interval(samples) is None
