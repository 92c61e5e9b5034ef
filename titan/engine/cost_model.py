"""Predicts an engine step's duration from its shape, fitted online to measured step times.

A step's time is close to linear in three quantities: tokens through the linear layers, sequences
(per-sequence overhead: sampling, metadata) and attention work (query × key pairs). Exponentially
weighted least squares keeps the fit current when the machine's speed drifts (other tenants, thermal).

The fit is robust both ways. Once fitted, a step more than OUTLIER_RATIO x off its prediction (a stall, a
fluke) is learned only up to that ratio. And when the median of the last `min_observations` steps'
measured/predicted ratios is off by more than STALE_RATIO, the fit is stale or was poisoned (an offline
LLM runs no warm-up, so its first, cold prefill can be 100x the next steps and the first fit explains it
with a huge attention cost) and is rebuilt from those recent steps, the old fit kept as a weak prior.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from titan.config import AUTO_ITL_FACTOR
from titan.engine.scheduler_output import ScheduledSequence

OUTLIER_RATIO = 2.0
STALE_RATIO = 1.5
HISTORY_KEPT = 0.01  # weight left on the old observations when the fit is rebuilt from recent steps
# A prediction is float arithmetic, and 0.1 + 5 x 0.01 is not exactly 0.15: as a numpy dot it came out at most
# 0.15 on an AVX-512 machine and just over it on an AVX2-only one, a token fewer in a chunk sized to 0.15. A
# prediction this close to a bound counts as within it, so neither the rounding nor the machine decides.
ROUNDING = 1e-9


def within(value: float, bound: float) -> bool:
    """`value` <= `bound`, up to float rounding (ROUNDING, relative to the bound)."""
    return value <= bound + ROUNDING * abs(bound)


@dataclass(frozen=True)
class StepShape:
    """What a step computes. Counts are floats: an average of steps' shapes (a typical step) is one too."""

    num_tokens: float = 0
    num_sequences: float = 0
    attention_pairs: float = 0.0  # Σ new tokens × the context each attends to

    def plus(self, num_new_tokens: int, start_position: int) -> StepShape:
        """This shape with one more sequence computing `num_new_tokens` tokens from `start_position`."""
        pairs = num_new_tokens * (start_position + (num_new_tokens + 1) / 2)
        return StepShape(self.num_tokens + num_new_tokens, self.num_sequences + 1, self.attention_pairs + pairs)


class StepCostModel:
    """seconds ≈ w0 + w1·tokens + w2·sequences + w3·attention_pairs/1000."""

    def __init__(self, forgetting: float = 0.98, min_observations: int = 8, ridge: float = 1e-6) -> None:
        self.forgetting = forgetting
        self.min_observations = min_observations
        self.ridge = ridge
        self.gram = np.zeros((4, 4))
        self.moment = np.zeros(4)
        self.num_observations = 0
        self._weights: np.ndarray | None = None
        self._terms: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)  # the weights as Python floats
        self.recent: deque[tuple[np.ndarray, float]] = deque(maxlen=min_observations)  # unclamped
        self.ratios: deque[float] = deque(maxlen=min_observations)  # measured / predicted since the last refit
        self.num_resets = 0

    @staticmethod
    def _features(shape: StepShape) -> np.ndarray:
        return np.array([1.0, shape.num_tokens, shape.num_sequences, shape.attention_pairs / 1000.0])

    @property
    def weights(self) -> np.ndarray | None:
        return self._weights

    @weights.setter
    def weights(self, weights: np.ndarray | None) -> None:
        self._weights = weights
        if weights is not None:
            self._terms = (float(weights[0]), float(weights[1]), float(weights[2]), float(weights[3]) / 1000.0)

    @property
    def ready(self) -> bool:
        return self._weights is not None

    def observe(self, shape: StepShape, seconds: float) -> None:
        x = self._features(shape)
        self.recent.append((x, seconds))
        if self.weights is not None:
            predicted = max(self.predict(shape), 1e-4)
            self.ratios.append(seconds / predicted)
            if len(self.ratios) == self.ratios.maxlen:
                bias = statistics.median(self.ratios)  # 8 floats: numpy's median costs ~50 us here
                if not 1.0 / STALE_RATIO <= bias <= STALE_RATIO:
                    self._refit_from_recent()
                    return
            # A one-off stall (GC, another tenant) or fluke is not the cost of the work: learn it only partly.
            seconds = min(max(seconds, predicted / OUTLIER_RATIO), OUTLIER_RATIO * predicted)
        self.gram = self.forgetting * self.gram + np.outer(x, x)
        self.moment = self.forgetting * self.moment + seconds * x
        self.num_observations += 1
        if self.num_observations >= self.min_observations:
            self.weights = self._solve_non_negative()

    def _refit_from_recent(self) -> None:
        """Rebuild the fit from the recent steps, which disagreed with it the same way. The old fit stays as a
        weak prior (HISTORY_KEPT of the recent steps' weight, pulling towards its own predictions, not its raw
        data), so what the recent steps did not exercise, such as a window of decodes saying nothing of a
        prefill's per-token cost, is still known from before, and no old outlier outweighs them."""
        gram, moment = np.zeros((4, 4)), np.zeros(4)
        for x, seconds in self.recent:
            gram = self.forgetting * gram + np.outer(x, x)
            moment = self.forgetting * moment + seconds * x
        if self.weights is not None and self.gram[0, 0] > 0:
            # gram[0, 0] sums the (forgotten) weights of the observations: the prior weighs as much as
            # HISTORY_KEPT x the recent window's count of them.
            prior = HISTORY_KEPT * gram[0, 0] / self.gram[0, 0] * self.gram
            gram, moment = gram + prior, moment + prior @ self.weights
        self.gram, self.moment = gram, moment
        self.num_observations = len(self.recent)
        self.ratios.clear()
        self.num_resets += 1
        self.weights = self._solve_non_negative()

    def _solve_non_negative(self) -> np.ndarray:
        """Least squares with every weight ≥ 0 (costs only grow with work): drop the most negative
        feature and solve again until none is negative."""
        # Scale-aware ridge keeps the solve stable while a feature has not varied yet.
        system = self.gram + self.ridge * (np.diag(self.gram.diagonal()) + np.eye(4))
        active = [0, 1, 2, 3]
        weights = np.zeros(4)
        while active:
            weights = np.zeros(4)
            weights[active] = np.linalg.solve(system[active][:, active], self.moment[active])
            if weights.min() >= 0:
                break
            active.remove(int(np.argmin(weights)))
        return np.maximum(weights, 0.0)

    def predict(self, shape: StepShape) -> float:
        # Plain float arithmetic, not a numpy dot: the scheduler predicts hundreds of shapes a step under a long
        # queue (an array per call cost ~3 us), and a dot's last bit depends on the CPU's kernels.
        if self._weights is None:
            return 0.0
        per_step, per_token, per_sequence, per_pair = self._terms
        return (per_step + per_token * shape.num_tokens + per_sequence * shape.num_sequences
                + per_pair * shape.attention_pairs)

    def marginal_token_cost(self, context_length: int) -> float:
        """Seconds one more token of an already scheduled sequence adds, attending to `context_length`."""
        if self.weights is None:
            return 0.0
        return float(self.weights[1] + self.weights[3] * context_length / 1000.0)

    def max_chunk(self, base: StepShape, start_position: int, limit: int, target_seconds: float) -> int:
        """The largest chunk (≤ limit) of one more sequence that keeps the step within the target."""
        if self.weights is None or within(self.predict(base.plus(limit, start_position)), target_seconds):
            return limit
        low, high = 0, limit  # predict is monotonic in the chunk size
        while low < high:
            middle = (low + high + 1) // 2
            if within(self.predict(base.plus(middle, start_position)), target_seconds):
                low = middle
            else:
                high = middle - 1
        return low


def smallest_passing(low: int, high: int, passes: Callable[[int], bool]) -> int:
    """The smallest integer in [low, high] that `passes`, for a test that once passed stays passed as the
    integer grows, and that `high` passes."""
    while low < high:
        middle = (low + high) // 2
        if passes(middle):
            high = middle
        else:
            low = middle + 1
    return low


def step_target_seconds(itl_slo_ms: float | str | None, cost_model: StepCostModel,
                        decodes: StepShape) -> float | None:
    """The slo policy's step target for a step whose decodes alone have shape `decodes`: the given number,
    or with auto AUTO_ITL_FACTOR x their predicted duration (None until the model is fitted)."""
    if itl_slo_ms is None:
        return None
    if itl_slo_ms != "auto":
        return float(itl_slo_ms) / 1000.0
    if not cost_model.ready or decodes.num_sequences == 0:
        return None
    return AUTO_ITL_FACTOR * cost_model.predict(decodes)


def shape_of(scheduled: list[ScheduledSequence]) -> StepShape:
    shape = StepShape()
    for item in scheduled:
        shape = shape.plus(item.num_new_tokens, item.start_position)
    return shape
