"""The native kernels' chunk-claiming pool (csrc/pool.cpp): a job runs each chunk once and returns only then."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from titan.kernels.build import native

# Alternates a job of a few chunks with one of many, and counts the indices of the many-chunk jobs not run
# exactly once by the time the job returned. TITAN_POOL_RACE_PROBE_US brings a worker that finished a job's
# last chunk back to claim only once the next job's fields are out: before the fix it then claimed under
# the old ticket, ran chunks of the next job twice and counted them done before they were (unprobed: a
# product's last rows unwritten in ~2 jobs of a million on a loaded 2-core machine).
SCRIPT = """
import sys, torch
from titan.kernels.build import native
torch.set_num_threads(int(sys.argv[1]))
module, wrong = native(), 0
for _ in range(int(sys.argv[2])):
    module.pool_run_counts(16, 2)
    wrong += int((module.pool_run_counts(256, 2) != 1).sum())
print(wrong)
"""


@pytest.mark.skipif(native() is None, reason="native kernels could not be built")
@pytest.mark.parametrize("threads", [2, 3])
def test_a_worker_late_from_the_last_job_cannot_claim_the_next(threads: int) -> None:
    env = {**os.environ, "TITAN_POOL_RACE_PROBE_US": "200"}
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(threads), "300"], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "0"


@pytest.mark.skipif(native() is None, reason="native kernels could not be built")
def test_every_index_runs_once_without_the_probe() -> None:
    for total, chunk in ((1, 1), (7, 2), (100, 1), (1000, 37)):
        assert native().pool_run_counts(total, chunk).eq(1).all()


@pytest.mark.skipif(native() is None, reason="native kernels could not be built")
def test_a_job_started_from_a_worker_runs_inline() -> None:
    """A body that starts a job of its own, on a worker: it runs inline. It used to wait for the call lock,
    which the caller holds until its job ends: a deadlock (no body does this yet)."""
    script = ("import torch\nfrom titan.kernels.build import native\ntorch.set_num_threads(3)\n"
              "print(int((native().pool_run_counts(64, 1, 5) != 5).sum()))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "0"

