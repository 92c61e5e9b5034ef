"""Compute threads: `--threads N` (llama.cpp's -t), by default the physical cores this process may use."""

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


def configure_threads(threads: int | None) -> int:
    """Set torch's intra-op pool (which the quantized kernels share) and return the count in use."""
    count = threads or physical_cores()
    if torch.get_num_threads() != count:
        torch.set_num_threads(count)
    logger.info("compute threads: %d%s", count, "" if threads else " (physical cores)")
    return count
