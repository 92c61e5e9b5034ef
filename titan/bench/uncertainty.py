"""How far a run's tail ratio (ITL P99 / P50) could move on another draw of the same traffic.

Token gaps are not independent samples: the gaps of one engine step are shared by every stream in it, and a
stretch of paced or draining steps lasts as long as a prompt's prefill. Resampling single gaps would call a
40 s run far more certain than it is. A block bootstrap keeps that structure: the timeline is cut into
blocks of `block_s`, whole blocks are drawn with replacement, and the ratio is recomputed on each draw.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from titan.bench.analysis import MIN_BASELINE_S, LatencySample

# Longer than a paced stretch (one prompt's prefill, ~1 s here) so that one stays in one block, short enough
# that a 40 s cell still has ~20 blocks to draw from.
BLOCK_SECONDS = 2.0
MIN_BLOCKS = 8  # with fewer, a redrawn run has too few stretches to vary


@dataclass(frozen=True)
class Interval:
    estimate: float  # the run's own ratio
    low: float
    high: float
    level: float  # e.g. 0.9: the central 90 % of the draws

    def straddles(self, bound: float) -> bool:
        """Whether another draw of the same traffic could fall on either side of `bound`."""
        return self.low <= bound < self.high

    def to_dict(self) -> dict[str, float]:
        return {"estimate": self.estimate, "low": self.low, "high": self.high, "level": self.level}


def tail_ratio_interval(samples: Sequence[LatencySample], percentile: float = 99.0, block_s: float = BLOCK_SECONDS,
                        draws: int = 1000, level: float = 0.9, seed: int = 0) -> Interval | None:
    """The P`percentile` / P50 ratio of the samples' values, with a block-bootstrap interval. None when the
    run spans fewer than MIN_BLOCKS non-empty blocks, or when its P50, or a redrawn run's, is under
    MIN_BASELINE_S (tokens read several to a chunk: such a median measures the reads). Percentiles interpolate as
    `titan.bench.analysis.summarize`'s do, so the estimate is the ITL rule's own ratio."""
    if not samples:
        return None
    values = np.fromiter((sample.value for sample in samples), np.float64, len(samples))
    _, block_of = np.unique(np.fromiter((sample.at // block_s for sample in samples), np.float64, len(samples)),
                            return_inverse=True)
    num_blocks = int(block_of.max()) + 1
    if num_blocks < MIN_BLOCKS:
        return None
    # A redrawn run holds each block as often as it was drawn: rather than concatenate copies, weigh the run's
    # sorted gaps by their block's count and read percentiles off the running total (the same numbers as
    # np.percentile of the concatenation, a few times faster: a 1-hour run has ~10^6 gaps).
    order = np.argsort(values, kind="stable")
    values, block_of = values[order], block_of[order]

    def ratio(counts: np.ndarray) -> float:
        ends = np.cumsum(counts[block_of])  # the sorted concatenation holds values[i] up to position ends[i] - 1
        low, high = (_percentile(values, ends, q) for q in (50.0, percentile))
        return high / low if low >= MIN_BASELINE_S else float("inf")

    estimate = ratio(np.ones(num_blocks, dtype=np.int64))
    if not np.isfinite(estimate):
        return None
    rng = np.random.default_rng(seed)
    ratios = [ratio(np.bincount(rng.integers(0, num_blocks, num_blocks), minlength=num_blocks))
              for _ in range(draws)]
    if not np.all(np.isfinite(ratios)):
        return None
    low, high = np.percentile(ratios, [50 * (1 - level), 50 * (1 + level)])
    return Interval(estimate, float(low), float(high), level)


def _percentile(values: np.ndarray, ends: np.ndarray, q: float) -> float:
    """np.percentile's linear interpolation over `values` (sorted), value i repeated up to position ends[i] - 1."""
    position = (ends[-1] - 1) * q / 100.0
    below = int(np.floor(position))
    at = np.searchsorted(ends, [below, min(below + 1, ends[-1] - 1)], side="right")
    return float(values[at[0]] + (position - below) * (values[at[1]] - values[at[0]]))
