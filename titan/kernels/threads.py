"""Compute threads: `--threads N` (llama.cpp's -t); by default `OMP_NUM_THREADS` when it is set (what
replicas sharing a host, their launchers and the Kubernetes manifests use to split the cores), else the
physical cores this process may use."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

logger = logging.getLogger("titan.kernels")


def physical_cores() -> int:
    """Distinct (package, core) pairs among the CPUs in this process's affinity mask (SMT siblings count
    once, because two threads on one core only fight over its vector units)."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    cores = set()
    for cpu in cpus:
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            package = (topology / "physical_package_id").read_text().strip()
            cores.add((package, (topology / "core_id").read_text().strip()))
        except OSError:
            cores.add(("cpu", str(cpu)))
    return max(1, len(cores))


def environment_threads() -> int | None:
    """OMP_NUM_THREADS as a thread count (its first entry when it lists several levels), or None."""
    value = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    return int(value) if value.isdigit() and int(value) > 0 else None


def configure_threads(threads: int | None) -> int:
    """Set torch's intra-op pool (which the quantized kernels share) and return the count in use."""
    from_environment = environment_threads()
    count = threads or from_environment or physical_cores()
    if torch.get_num_threads() != count:
        torch.set_num_threads(count)
    source = "" if threads else " (OMP_NUM_THREADS)" if from_environment else " (physical cores)"
    logger.info("compute threads: %d%s", count, source)
    return count
