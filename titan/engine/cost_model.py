"""Predicts an engine step's duration from its shape, fitted online to measured step times.

A step's time is close to linear in three quantities: tokens through the linear layers, sequences
(per-sequence overhead: sampling, metadata) and attention work (query × key pairs). Exponentially
weighted least squares keeps the fit current when the machine's speed drifts (other tenants, thermal).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from titan.engine.scheduler_output import ScheduledSequence


@dataclass(frozen=True)
class StepShape:
    num_tokens: int = 0
    num_sequences: int = 0
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
        self.weights: np.ndarray | None = None

    @staticmethod
    def _features(shape: StepShape) -> np.ndarray:
        return np.array([1.0, shape.num_tokens, shape.num_sequences, shape.attention_pairs / 1000.0])

    @property
    def ready(self) -> bool:
        return self.weights is not None

    def observe(self, shape: StepShape, seconds: float) -> None:
        x = self._features(shape)
        if self.weights is not None:
            # A one-off stall (GC, another tenant) is not the cost of the work: learn it only partly.
            seconds = min(seconds, 2.0 * max(self.predict(shape), 1e-4))
        self.gram = self.forgetting * self.gram + np.outer(x, x)
        self.moment = self.forgetting * self.moment + seconds * x
        self.num_observations += 1
        if self.num_observations >= self.min_observations:
            self.weights = self._solve_non_negative()

    def _solve_non_negative(self) -> np.ndarray:
        """Least squares with every weight ≥ 0 (costs only grow with work): drop the most negative
        feature and solve again until none is negative."""
        # Scale-aware ridge keeps the solve stable while a feature has not varied yet.
        system = self.gram + self.ridge * np.diag(np.diag(self.gram) + 1.0)
        active = np.ones(4, dtype=bool)
        weights = np.zeros(4)
        while active.any():
            weights = np.zeros(4)
            weights[active] = np.linalg.solve(system[np.ix_(active, active)], self.moment[active])
            if (weights >= 0).all():
                break
            active[np.argmin(weights)] = False
        return np.maximum(weights, 0.0)

    def predict(self, shape: StepShape) -> float:
        if self.weights is None:
            return 0.0
        return float(self._features(shape) @ self.weights)

    def marginal_token_cost(self, context_length: int) -> float:
        """Seconds one more token of an already scheduled sequence adds, attending to `context_length`."""
        if self.weights is None:
            return 0.0
        return float(self.weights[1] + self.weights[3] * context_length / 1000.0)

    def max_chunk(self, base: StepShape, start_position: int, limit: int, target_seconds: float) -> int:
        """The largest chunk (≤ limit) of one more sequence that keeps the step within the target."""
        if self.weights is None or self.predict(base.plus(limit, start_position)) <= target_seconds:
            return limit
        low, high = 0, limit  # predict is monotonic in the chunk size
        while low < high:
            middle = (low + high + 1) // 2
            if self.predict(base.plus(middle, start_position)) <= target_seconds:
                low = middle
            else:
                high = middle - 1
        return low


def shape_of(scheduled: list[ScheduledSequence]) -> StepShape:
    shape = StepShape()
    for item in scheduled:
        shape = shape.plus(item.num_new_tokens, item.start_position)
    return shape
