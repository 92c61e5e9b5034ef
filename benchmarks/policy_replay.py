"""The scheduler alone on a virtual clock: default_policy.py's cells replayed without a model, over many seeds.

Each cell's requests are the ones `titan bench` sends in default_policy.py (its workload and arrival code, the
same presets, loads and seeds), fed to the real Scheduler, fcfs and the default slo. A step "takes" what a
linear step-cost law says (--cost-law, fitted to this machine's served steps); --noise scatters each step
by that log-normal sigma (served steps scatter about 0.15: actual / predicted P10-P90 0.81-1.19 on an
AVX2 EPYC, where offline on a quiet machine one step shape repeats within 2-4 %), --noise-correlation
carries that share of one step's scatter into the next (served steps' actual / predicted ratios correlate
0.36-0.76 from one step to the next: slow spells, not independent flukes), and the slo policy's cost model
learns the steps online, as in the server.
Calibration is replayed too: the solo request, the suffix prefill and each preset's closed-loop capacity.

No model, no HTTP, no other load: a cell takes about a second, so a policy change is judged over many seeds
in the time one served cell takes, and what differs between two runs is the policy. What it leaves out
(exact token counts, streaming, GC, the machine's drift and the cost model's misfit) is what
default_policy.py measures, which stays the judge; this shows how often the policy itself meets each
target, and by how much, where one served run shows one draw of the arrivals. Each target's passes are also
split by whether the cell's busiest window of arrivals stayed within the machine's capacity
(`busiest_load`): a Poisson draw at 0.7x load on average can hold seconds above 1x.

    .venv/bin/python benchmarks/policy_replay.py [--presets steady,burst,storm,shared] [--loads 0.7,1.5]
        [--seeds 10] [--noise 0] [--noise-correlation 0] [--output benchmarks/results/policy_replay.json]
"""

from __future__ import annotations

import argparse
import itertools
import math
import statistics
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
from common import cpu_description, write_result
from default_policy import (
    BURST_INTERVAL,
    LOADS,
    PRESETS,
    SHORT_IN,
    SUFFIX_LEN,
    Calibration,
    cell_number,
    closed_loop_args,
    evaluate,
    results_stats,
    workload_args,
)

from titan.bench.analysis import Slo
from titan.bench.cli import add_arguments, setup_run
from titan.bench.client import RequestResult
from titan.config import SchedulerConfig
from titan.engine.block_manager import BlockManager
from titan.engine.cost_model import StepCostModel, StepShape, shape_of
from titan.engine.sampling_params import SamplingParams
from titan.engine.scheduler import Scheduler
from titan.engine.scheduler_output import RunnerOutput
from titan.engine.sequence import Sequence

# ms: per step, per token, per sequence, per 1000 attention pairs. A least-squares fit of 15,842 steps the
# default server took in two full default_policy.py runs (stop 42; AMD EPYC Zen 4, one thread, SmolLM2-135M
# Q4_1); attention is too small at these lengths for that fit to see.
DEFAULT_COST_LAW = "2.9,1.65,1.33,0"
CLOSED_LOOP_IN_FLIGHT = 8
# A draw's arrivals are judged over their busiest window of this many seconds: a Poisson draw at 0.7x load
# on average can offer more than the machine serves for as long, and no work-conserving step keeps the
# token gap flat while the batch it decodes grows.
BUSIEST_WINDOW_S = 10.0


@dataclass(frozen=True)
class Replayed:
    """One request to replay: when it is due (seconds from the cell's start), its prompt and its length."""

    index: int
    due: float
    prompt: list[int]
    max_tokens: int


def bench_requests(bench_argv: list[str]) -> tuple[list[Replayed], list[Replayed], int | None]:
    """The requests `titan bench` would send for `bench_argv`, the prefix warm-ups (sent before the cell), and
    the closed loop's concurrency. A prompt is token ids: a shared prefix as the same ids, the rest unique."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(bench_argv)
    setup = setup_run(args)
    workload, config = setup.workload, setup.run_config
    fresh = itertools.count(1_000_000)
    prefix_ids = [[next(fresh) for _ in range(length)] for length in workload.prefix_tokens]

    def prompt(text: str | None, tokens: int) -> list[int]:
        for group, prefix in enumerate(workload.prefixes):
            if text is not None and text.startswith(prefix):
                return prefix_ids[group] + [next(fresh) for _ in range(tokens - len(prefix_ids[group]))]
        return [next(fresh) for _ in range(tokens)]

    offsets = [0.0] * config.num_requests if config.num_requests else list(
        itertools.takewhile(lambda due: due < config.duration, setup.arrivals.offsets()))
    timed = []
    for index, due in enumerate(offsets):
        spec = workload.request(index)
        timed.append(Replayed(index, due, prompt(spec.prompt, spec.input_tokens), spec.max_tokens))
    warm = [Replayed(-1 - n, 0.0, prompt(spec.prompt, spec.input_tokens), 1)
            for n, spec in enumerate(workload.warm_up_requests())] if config.warm_prefixes else []
    return warm, timed, config.max_concurrency


class Replay:
    """One server's scheduler, stepped on a virtual clock: a step lasts what the cost law gives it."""

    def __init__(self, policy: str, law: tuple[float, ...], noise: float, kv_blocks: int, seed: int,
                 noise_correlation: float = 0.0) -> None:
        self.now = 0.0
        self.law = np.array(law) / 1000.0
        self.noise = noise
        self.noise_correlation = noise_correlation
        self.log_scatter = 0.0  # the last step's, which the next one's follows by `noise_correlation`
        self.rng = np.random.default_rng(seed)
        self.cost_model = StepCostModel()  # fitted online, as the engine's
        # The served cells start on a warm server (warm-up, calibration, earlier cells): so does the fit here.
        for decodes, chunk in itertools.product((1, 4, 16), (0, 64, 256)):
            shape = StepShape()
            for _ in range(decodes):
                shape = shape.plus(1, 200)
            shape = shape.plus(chunk, 0) if chunk else shape
            self.cost_model.observe(shape, self.seconds(shape))
        self.scheduler = Scheduler(SchedulerConfig(policy=policy), BlockManager(kv_blocks, 16), 1 << 20,
                                   frozenset(), self.cost_model, clock=lambda: self.now)

    def seconds(self, shape: StepShape) -> float:
        features = np.array([1.0, shape.num_tokens, shape.num_sequences, shape.attention_pairs / 1000.0])
        if not self.noise:
            return float(features @ self.law)
        # AR(1) in log space: each step keeps `noise_correlation` of the last one's scatter, the sigma stays `noise`
        rho = self.noise_correlation
        self.log_scatter = rho * self.log_scatter + math.sqrt(1.0 - rho * rho) * self.rng.normal(0.0, self.noise)
        return float(features @ self.law) * math.exp(self.log_scatter)

    def run(self, requests: list[Replayed], in_flight: int | None = None) -> list[RequestResult]:
        """Send `requests` when due (or `in_flight` at a time, as the closed loop does) and step until all are
        done. Times in the results are seconds from the first request's due time."""
        start = self.now
        results: dict[int, RequestResult] = {}
        pending = sorted(requests, key=lambda r: r.due)
        active: dict[int, RequestResult] = {}
        while pending or self.scheduler.has_unfinished:
            while pending and start + pending[0].due <= self.now and (in_flight is None or len(active) < in_flight):
                request = pending.pop(0)
                # Sent when due (the server stamps a request when its HTTP request comes in, also while a step
                # runs); a closed loop sends the next one when a slot frees.
                sent = self.now - start if in_flight is not None else request.due
                seq = Sequence(request.prompt, SamplingParams(max_tokens=request.max_tokens, ignore_eos=True),
                               arrival_time=start + sent)
                self.scheduler.add(seq)
                active[seq.seq_id] = results[request.index] = RequestResult(
                    request.index, "default", len(request.prompt), request.max_tokens, request.due,
                    sent_at=sent, status=200, prompt_tokens=len(request.prompt))
            if not self.scheduler.has_unfinished:
                self.now = start + pending[0].due
                continue
            decision = self.scheduler.schedule()
            shape = shape_of(decision.scheduled)
            duration = self.seconds(shape)
            self.now += duration
            self.cost_model.observe(shape, duration)
            sampled = [s.seq_id for s in decision.scheduled if s.sample]
            for item in self.scheduler.commit(decision, RunnerOutput(sampled, [7] * len(sampled),
                                                                     [None] * len(sampled))):
                result = active[item.seq.seq_id]
                result.token_times.append(self.now - start)
                if item.seq.is_finished:
                    result.finished_at, result.completion_tokens = self.now - start, item.seq.num_output_tokens
                    del active[item.seq.seq_id]
        return [results[index] for index in sorted(results)]


def work_seconds(request: Replayed, law: tuple[float, ...]) -> float:
    """What a request asks of the machine under the cost law, the per-step cost left out (its batch shares it):
    each prompt token, and each output token with its sequence's share of a decode step."""
    _, per_token, per_sequence, _ = law
    return (len(request.prompt) * per_token + request.max_tokens * (per_token + per_sequence)) / 1000.0


def busiest_load(requests: list[Replayed], law: tuple[float, ...], capacity: float) -> float:
    """The most work (`work_seconds`) arriving in any BUSIEST_WINDOW_S, over what the machine serves in that
    time (`capacity`: work seconds per second, measured closed loop): above 1 the draw holds an overload."""
    dues = [request.due for request in requests]
    works = [work_seconds(request, law) for request in requests]
    busiest = max((sum(w for due, w in zip(dues, works, strict=True) if start <= due < start + BUSIEST_WINDOW_S)
                   for start in dues), default=0.0)
    return busiest / (BUSIEST_WINDOW_S * capacity)


def cell(results: list[RequestResult], slo: Slo) -> dict[str, Any]:
    """default_policy.py's numbers for a cell, over the replay's span (first due to last finished)."""
    span = max(r.finished_at for r in results) - min(r.scheduled_at for r in results)
    return results_stats(results, slo, span, sum(r.completion_tokens or 0 for r in results) / span)


def calibrate(args: argparse.Namespace, presets: list[str],
              law: tuple[float, ...]) -> tuple[Calibration, dict[str, float]]:
    """As default_policy.py: a lone short request and a lone suffix on an fcfs server, and each preset's
    closed-loop capacity; with it, that capacity as work seconds served per second (`work_seconds`)."""
    def solo(words: int, max_tokens: int) -> RequestResult:
        _, timed, _ = bench_requests(["--num-requests", "1", "--input-len", str(words), "--output-len",
                                      str(max_tokens), "--ignore-eos", "--seed", "100"])
        return Replay("fcfs", law, 0.0, args.kv_blocks, 0).run(timed)[0]

    short, suffix = solo(SHORT_IN, 32), solo(SUFFIX_LEN, 4)
    capacity, work_capacity = {}, {}
    for preset in presets:
        _, timed, in_flight = bench_requests(closed_loop_args(preset, args.calibration_requests, seed=1))
        results = Replay("fcfs", law, 0.0, args.kv_blocks, 0).run(timed, in_flight or CLOSED_LOOP_IN_FLIGHT)
        makespan = max(r.finished_at for r in results)
        capacity[preset] = len(results) / makespan
        work_capacity[preset] = sum(work_seconds(request, law) for request in timed) / makespan
    return Calibration(short.ttft or 0.0, statistics.median(short.itls), suffix.ttft or 0.0, capacity), work_capacity


def short(detail: str) -> str:
    """A target's detail as one number: the ratio, or the good counts ("54 vs 16")."""
    if "=" in detail:
        return detail.split("=")[-1].strip()
    return " ".join(detail.split()[:3])


def pass_counts_by_load(draws: list[dict[str, Any]]) -> dict[str, dict[str, tuple[int, int]]]:
    """Each target's passes over the draws whose cell stayed within capacity in its busiest window, and over
    those where it did not: (passed, draws)."""
    counts: dict[str, dict[str, tuple[int, int]]] = {}
    for draw in draws:
        for target in draw["targets"]:
            key = target["target"].split(":")[0]
            side = "within" if draw["cells"][key]["busiest_load"] <= 1.0 else "overloaded"
            sides = counts.setdefault(target["target"], {"within": (0, 0), "overloaded": (0, 0)})
            passed, total = sides[side]
            sides[side] = (passed + target["pass"], total + 1)
    return counts


def cell_summaries(draws: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per cell, over the draws: each policy's TTFT P50 / P99 (medians of the draws' values, ms), its good
    requests (summed) and slo's output tok/s over fcfs's (summed over the draws). A change that moves pass
    counts can move these the wrong way: stop 52's first drain bound doubled the 0.7x ITL passes while its
    steady@1.5 TTFT P50 went from 2.5 to 8.9 s, a trap the served run then showed."""
    summaries: dict[str, dict[str, Any]] = {}
    for key in draws[0]["cells"] if draws else []:
        cells = [draw["cells"][key] for draw in draws]
        summary: dict[str, Any] = {
            "output_tok_s_vs_fcfs": sum(c["candidate"]["output_tok_s"] for c in cells)
            / max(sum(c["fcfs"]["output_tok_s"] for c in cells), 1e-9)}
        for name in ("candidate", "fcfs"):
            summary[name] = {
                "ttft_p50_ms": statistics.median(c[name]["ttft_ms"]["p50"] for c in cells),
                "ttft_p99_ms": statistics.median(c[name]["ttft_ms"]["p99"] for c in cells),
                "good": sum(c[name]["good"] for c in cells)}
        summaries[key] = summary
    return summaries


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--presets", default=",".join(PRESETS))
    parser.add_argument("--loads", default=",".join(f"{load:g}" for load in LOADS))
    parser.add_argument("--duration", type=float, default=40.0, help="seconds of sending per cell")
    parser.add_argument("--seeds", type=int, default=10, help="arrival draws per cell (seed, seed + 1, ...)")
    parser.add_argument("--seed", type=int, default=0, help="the first draw's offset (default_policy.py's --seed)")
    parser.add_argument("--calibration-requests", type=int, default=24)
    parser.add_argument("--cost-law", default=DEFAULT_COST_LAW,
                        help="step cost in ms: per step, per token, per sequence, per 1000 attention pairs")
    parser.add_argument("--noise", type=float, default=0.0, help="log-normal sigma of each step's duration")
    parser.add_argument("--noise-correlation", type=float, default=0.0,
                        help="share of a step's log scatter the next step keeps (AR(1); 0: independent steps)")
    parser.add_argument("--kv-blocks", type=int, default=8192, help="KV cache blocks of 16 tokens")
    parser.add_argument("--output", default="benchmarks/results/policy_replay.json")
    args = parser.parse_args()
    presets, loads = args.presets.split(","), [float(x) for x in args.loads.split(",")]
    if not 0.0 <= args.noise_correlation < 1.0:
        parser.error("--noise-correlation must be in [0, 1)")
    law = tuple(float(x) for x in args.cost_law.split(","))
    started = time.perf_counter()
    calibration, work_capacity = calibrate(args, presets, law)
    slo_text = (f"ttft={max(1000.0, 10_000 * calibration.solo_ttft):.0f},"
                f"itl={5000 * calibration.solo_itl:.0f}")
    slo = Slo.parse(slo_text)
    capacity = ", ".join(f"{preset} {rate:.2f}" for preset, rate in calibration.capacity.items())
    print(f"{cpu_description()}; cost law {law} ms, noise {args.noise} (correlation {args.noise_correlation}); "
          f"solo TTFT {1000 * calibration.solo_ttft:.0f} ms, gap {1000 * calibration.solo_itl:.1f} ms; "
          f"capacity {capacity} req/s; goodput SLO {slo_text}", flush=True)
    draws: list[dict[str, Any]] = []
    passes: dict[str, list[bool]] = {}
    for draw in range(args.seeds):
        cells: dict[str, dict[str, Any]] = {}
        for preset in presets:
            for load in loads:
                key, rate = f"{preset}@{load:g}", load * calibration.capacity[preset]
                # default_policy.py's seed for this cell, then one more draw per --seeds
                warm, timed, _ = bench_requests(workload_args(preset, rate, args.duration,
                                                              args.seed + 1000 * cell_number(preset, load) + draw))
                cells[key] = {"rate_rps": rate,
                              "busiest_load": busiest_load(timed, law, work_capacity[preset])}
                for policy, name in (("slo", "candidate"), ("fcfs", "fcfs")):
                    replay = Replay(policy, law, args.noise, args.kv_blocks, draw, args.noise_correlation)
                    if warm:
                        replay.run(warm)
                    cells[key][name] = cell(replay.run(timed), slo)
        targets = evaluate(cells, calibration)
        for target in targets:
            passes.setdefault(target["target"], []).append(target["pass"])
        draws.append({"draw": draw, "cells": cells, "targets": targets})
        failed = [f"{t['target'].split(':')[0]} ({t['target'].split(': ')[1]}: {t['detail']})"
                  for t in targets if not t["pass"]]
        print(f"draw {draw}: " + ("every target met" if not failed else "FAIL " + "; ".join(failed)), flush=True)
    print()
    for name, results in passes.items():
        details = [short(next(t["detail"] for t in d["targets"] if t["target"] == name)) for d in draws]
        print(f"{sum(results):3d}/{len(results)} pass  {name:48s} {'  '.join(details)}")
    by_load = pass_counts_by_load(draws)
    print(f"\nBy the draw's busiest {BUSIEST_WINDOW_S:g} s (work arriving / work served, closed loop):")
    for name, counts in by_load.items():
        print(f"  {name:48s} " + "   ".join(f"{side}: {passed}/{total}" for side, (passed, total) in counts.items()))
    summaries = cell_summaries(draws)
    print("\nPer cell over the draws: TTFT P50 / P99 (median ms), good requests (sum), output tok/s vs fcfs:")
    for key, summary in summaries.items():
        slo_cell, fcfs_cell = summary["candidate"], summary["fcfs"]
        print(f"  {key:11s} slo {slo_cell['ttft_p50_ms']:6.0f} / {slo_cell['ttft_p99_ms']:6.0f}  "
              f"fcfs {fcfs_cell['ttft_p50_ms']:6.0f} / {fcfs_cell['ttft_p99_ms']:6.0f}  "
              f"good {slo_cell['good']} vs {fcfs_cell['good']}  tok/s {summary['output_tok_s_vs_fcfs']:.2f}x")
    write_result(args.output, {
        "cpu": cpu_description(), "cost_law_ms": law, "noise": args.noise,
        "noise_correlation": args.noise_correlation, "seeds": args.seeds,
        "burst_interval_s": BURST_INTERVAL, "calibration": calibration.__dict__, "slo": slo_text,
        "pass_counts": {name: sum(results) for name, results in passes.items()}, "pass_counts_by_load": by_load,
        "busiest_window_s": BUSIEST_WINDOW_S, "cells": summaries, "draws": draws,
        "seconds": time.perf_counter() - started})


if __name__ == "__main__":
    main()
