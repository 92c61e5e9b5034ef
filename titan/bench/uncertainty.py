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

from titan.bench.analysis import LatencySample

# Longer than a paced stretch (one prompt's prefill, ~1 s here) so that one stays in one block, short enough
# that a 40 s cell still has ~20 blocks to draw from.
BLOCK_SECONDS = 2.0
MIN_BLOCKS = 8  # fewer and the draws hardly differ from the run itself


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
    """The P`percentile` / P50 ratio of the samples' values, with a block-bootstrap interval (None when the
    run spans fewer than MIN_BLOCKS non-empty blocks or its P50 is zero). Percentiles interpolate as
    `titan.bench.analysis.summarize`'s do, so the estimate is the ITL rule's own ratio."""
    blocks: dict[int, list[float]] = {}
    for sample in samples:
        blocks.setdefault(int(sample.at // block_s), []).append(sample.value)
    if len(blocks) < MIN_BLOCKS:
        return None
    values = [np.asarray(block, dtype=np.float64) for block in blocks.values()]

    def ratio(array: np.ndarray) -> float:
        low, high = np.percentile(array, [50.0, percentile])
        return float(high / low) if low > 0 else float("inf")

    estimate = ratio(np.concatenate(values))
    if not np.isfinite(estimate):
        return None
    rng = np.random.default_rng(seed)
    ratios = [ratio(np.concatenate([values[i] for i in rng.integers(0, len(values), len(values))]))
              for _ in range(draws)]
    low, high = np.percentile(ratios, [50 * (1 - level), 50 * (1 + level)])
    return Interval(estimate, float(low), float(high), level)
