"""Test-only fault injection: make engine steps fail on purpose (`titan chaos --scenario step-failure`).

Off unless the environment variable TITAN_TEST_FAIL_STEP_EVERY is a positive N: then every Nth step that
has work raises InjectedStepFailure after the scheduler decided and before the runner computes, the point
where a real kernel or allocation error would strike. The server must fail that step's requests with an
error and keep serving.
"""

from __future__ import annotations

import os

ENV = "TITAN_TEST_FAIL_STEP_EVERY"


class InjectedStepFailure(RuntimeError):
    pass


class StepFaults:
    def __init__(self, every: int) -> None:
        self.every = every
        self.steps = 0

    def check(self, has_work: bool) -> None:
        if self.every <= 0 or not has_work:
            return
        self.steps += 1
        if self.steps % self.every == 0:
            raise InjectedStepFailure(f"injected failure of step {self.steps} ({ENV}={self.every})")


def from_environment() -> StepFaults:
    try:
        every = int(os.environ.get(ENV, "0") or 0)
    except ValueError as error:
        raise ValueError(f"{ENV} must be an integer") from error
    return StepFaults(every)
