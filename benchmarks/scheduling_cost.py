"""What one `Scheduler.schedule()` costs the engine thread as the queue grows, per policy.

Under an overload the waiting queue holds hundreds of prompts (the default bound is derived from the KV
pool), and every step the slo policy orders them, plans each one's prefill and forecasts the queue's first
tokens for a dozen chunk sizes. That time is spent between model steps, on every request's token gap.

No model: the real `Scheduler` with the default `SchedulerConfig` of each policy, a step cost model set to
the AVX2 EPYC's served law (4.4 ms a step + 4.5 ms a token + 1.9 ms a sequence), two requests mid-stream and
N prompts of 150 tokens waiting, one arriving every 0.5 s before now (Poisson-like, not a batch; the oldest
are past their TTFT target, so slo plans a drain, its most expensive path). Each repeat builds a fresh
scheduler and times one schedule(); the median counts.

    .venv/bin/python benchmarks/scheduling_cost.py [--queued 16,64,256] [--repeats 15]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time

import numpy as np
from common import cpu_description, write_result

from titan.config import SchedulerConfig
from titan.engine.block_manager import BlockManager
from titan.engine.cost_model import StepCostModel
from titan.engine.sampling_params import SamplingParams
from titan.engine.scheduler import Scheduler
from titan.engine.scheduler_output import RunnerOutput
from titan.engine.sequence import Sequence

PROMPT_TOKENS = 150
COST_LAW_SECONDS = (0.00442, 0.00448, 0.00192, 0.0)
TOKENS = itertools.count(1000)


def prompt(now: float, age: float) -> Sequence:
    ids = [next(TOKENS) % 40_000 + 100 for _ in range(PROMPT_TOKENS)]  # distinct: no prefix-cache hits
    return Sequence(ids, SamplingParams(max_tokens=64, ignore_eos=True), arrival_time=now - age)


def scheduler_with_queue(policy: str, queued: int) -> Scheduler:
    model = StepCostModel()
    model.weights = np.array(COST_LAW_SECONDS)
    blocks = (queued + 4) * (PROMPT_TOKENS // 16 + 6)
    scheduler = Scheduler(SchedulerConfig(policy=policy), BlockManager(blocks, 16), 4096, frozenset({2}), model)
    now = time.monotonic()
    for _ in range(2):  # arrivals in time order, as the server adds them (a batch is judged on that)
        scheduler.add(prompt(now, 0.5 * queued + 10.0))
    while any(seq.num_computed_tokens < seq.num_tokens - 1 for seq in scheduler.running) or scheduler.waiting:
        output = scheduler.schedule()  # prefill the two, so they decode beside the queue
        sampled = [s.seq_id for s in output.scheduled if s.sample]
        scheduler.commit(output, RunnerOutput(sampled, [7] * len(sampled), [None] * len(sampled)))
    for i in range(queued):
        scheduler.add(prompt(now, 0.5 * (queued - i)))
    return scheduler


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--queued", default="16,64,256", help="waiting prompts, comma-separated")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--output", default="benchmarks/results/scheduling_cost.json")
    args = parser.parse_args()
    print(cpu_description())
    rows = []
    for queued in (int(n) for n in args.queued.split(",")):
        row: dict[str, float | int | str] = {"queued": queued}
        for policy in ("fcfs", "slo"):
            times, reason = [], ""
            for _ in range(args.repeats):
                scheduler = scheduler_with_queue(policy, queued)
                started = time.perf_counter()
                output = scheduler.schedule()
                times.append(time.perf_counter() - started)
                reason = output.budget.reason if output.budget is not None else "-"
            row[f"{policy}_ms"] = 1000 * statistics.median(times)
            row[f"{policy}_reason"] = reason
        rows.append(row)
        print(f"{queued:4d} waiting: fcfs {row['fcfs_ms']:.2f} ms, slo {row['slo_ms']:.2f} ms "
              f"({row['slo_reason']}) per schedule()")
    write_result(args.output, {"cpu": cpu_description(), "prompt_tokens": PROMPT_TOKENS,
                               "cost_law_seconds": COST_LAW_SECONDS, "repeats": args.repeats, "rows": rows})


if __name__ == "__main__":
    main()
