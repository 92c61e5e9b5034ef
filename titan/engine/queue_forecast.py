"""When each queued prompt gets its first token, if every step from now on prefills a given chunk.

The slo policy's budget rule (titan.engine.prefill_budget) asks this of its whole queue for a dozen chunk
sizes a step, and under an overload the queue holds hundreds of prompts. So the queue's columns are arrays,
built once a step, and a forecast is a few vector operations: looped over in Python, 250 prompts cost
~0.1 ms per chunk size, every step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from titan.engine.cost_model import StepCostModel, StepShape


@dataclass(frozen=True)
class QueuedPrefill:
    """Prefill work waiting for the budget: tokens still to compute, seconds since arrival, its TTFT target, and
    the position its next chunk starts at (a prefix-cache hit or the chunks already computed)."""

    remaining_tokens: int
    waited_seconds: float
    ttft_target: float
    start_position: int = 0


class QueueForecast:
    """A queue of prefills, in service order, and what each prefilled request's decode adds to every later
    step (`growth`: `decode_growth`; none if not given)."""

    def __init__(self, queue: Sequence[QueuedPrefill], growth: Sequence[float] = ()) -> None:
        self.size = len(queue)
        self._ahead = np.cumsum(np.array([item.remaining_tokens for item in queue], dtype=np.int64))
        self._waited = np.array([item.waited_seconds for item in queue], dtype=np.float64)
        self._targets = np.array([item.ttft_target for item in queue], dtype=np.float64)
        self._growth = np.array(list(growth) or [0.0] * self.size, dtype=np.float64)
        if len(self._growth) != self.size:
            raise ValueError(f"{len(self._growth)} decode costs for a queue of {self.size}")
        # Σ decode seconds of the requests ahead of each one: they are prefilled by the time it is
        self._decoding_ahead = np.concatenate(([0.0], np.cumsum(self._growth)[:-1]))[:self.size]

    def first_token_seconds(self, tokens_per_step: int, step_seconds: float, whole_steps: bool = True) -> np.ndarray:
        """Seconds from now to each request's first token, every step computing `tokens_per_step` of the queue's
        tokens in `step_seconds`, plus the decode of each request already prefilled: a burst's first requests
        decode in every step their followers prefill in, and a drain planned without them got its last
        requests late. `whole_steps`: a request waits for the end of the step its last token is in; else steps
        count as a fraction (tokens ahead / tokens per step), for a search over the chunk size: rounded, a
        bigger chunk can need as many steps as a smaller one and be later."""
        steps = self._ahead / tokens_per_step
        if whole_steps:
            steps = np.ceil(steps)
        # request j decodes from the step after its last one (steps[j]) on: Σ over those ahead of each request
        decoded_since = np.concatenate(([0.0], np.cumsum(self._growth * steps)[:-1]))[:self.size]
        return steps * (step_seconds + self._decoding_ahead) - decoded_since

    def met(self, tokens_per_step: int, step_seconds: float, share: float = 1.0, whole_steps: bool = True) -> int:
        """Requests predicted to reach their first token within `share` x their target of arrival."""
        if tokens_per_step <= 0:
            return 0
        finishes = self.first_token_seconds(tokens_per_step, step_seconds, whole_steps)
        return int(np.count_nonzero(self._waited + finishes <= share * self._targets))


def decode_growth(cost_model: StepCostModel, queue: Sequence[QueuedPrefill]) -> list[float]:
    """What each queued request's decode adds to a step once it is prefilled: a token and a sequence attending
    to its prompt. A step's predicted cost is linear in that context, so three predictions price the whole
    queue rather than a prediction per request, every step, on a queue that can hold hundreds."""
    empty = cost_model.predict(StepShape())
    at_start = cost_model.predict(StepShape().plus(1, 0)) - empty
    per_position = cost_model.predict(StepShape().plus(1, 1)) - empty - at_start
    return [at_start + per_position * (item.start_position + item.remaining_tokens) for item in queue]


def queued_start(queue: Sequence[QueuedPrefill]) -> int:
    """The position the queue's remaining prompt tokens start at, on average over them. Behind a hot system
    prompt every token attends to it and costs more; priced at position 0 the same suffix came out at a tenth
    of its cost where all traffic shares the prefix (the fit then cannot tell a token's cost from its
    attention's). An average rather than the first prefill's position: a long prompt's last chunks would
    price the short prompts queued behind it at its depth, and the queue would read as a backlog."""
    tokens = sum(item.remaining_tokens for item in queue)
    if tokens <= 0:
        return 0
    return round(sum(item.remaining_tokens * item.start_position for item in queue) / tokens)
