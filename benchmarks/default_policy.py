"""Is `slo` fit to be the default policy? The no-flag server against `--scheduling-policy fcfs`, side by side.

One build, two servers loaded at once but driven one at a time (interleaved per cell, which goes first alternating
along presets and along loads, so drift in the machine's other load hits both alike). The candidate is the server
with no scheduling flags (slo, auto ITL and TTFT targets; `--scheduling-policy slo` is added should the default
ever be another). Both run with OMP_NUM_THREADS=1 and --threads 1 (two OpenMP threads stall at barriers on a shared
2-core machine).

Calibration, against fcfs: a lone short request gives the solo TTFT and token gap (the goodput SLO is
ttft = max(1 s, 10 x solo TTFT), itl = 5 x solo gap, every gap, unless --slo is given) and a lone
suffix-sized prompt one suffix prefill (medians of three); a closed-loop run per preset (8 in flight)
gives its capacity in requests/s. Each preset is then offered at --loads x that capacity (default 0.7
and 1.5) for --duration seconds.

Targets for the candidate (PASS/FAIL): ITL P99 <= 2 x P50 on steady and storm, storm ITL max <= 3 x P50,
burst output tok/s >= 0.9 x fcfs and TTFT P99 <= 1.1 x fcfs, goodput (requests meeting the SLO, of the
same requests sent to both) >= fcfs in every cell, shared-prefix
TTFT P99 <= 1.2 x P50 + one suffix prefill.

    .venv/bin/python benchmarks/default_policy.py [--quick] [--presets steady,burst,storm,shared]
        [--loads 0.7,1.5] [--duration 40] [--output benchmarks/results/default_policy.json]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from common import cpu_description, write_result
from transients import git_head, run_bench, source_digest, warm_up

from harness.server import ServerProcess
from titan.bench.analysis import Slo, goodput, itl_samples, summarize
from titan.bench.client import RequestResult
from titan.bench.uncertainty import Interval, tail_ratio_interval
from titan.config import SchedulerConfig

SHORT_IN, SHORT_OUT = 150, 64  # steady and burst requests (the burst shape)
STORM_LONG_IN, STORM_LONG_FRACTION = 800, 0.1
PREFIX_LEN, SUFFIX_LEN, PREFIX_OUT = 512, 64, 32
BURST_INTERVAL = 10.0
PRESETS = ("steady", "burst", "storm", "shared")
LOADS = (0.7, 1.5)  # offered load, as fractions of the measured capacity


@dataclass(frozen=True)
class Calibration:
    solo_ttft: float  # seconds, a lone SHORT_IN prompt
    solo_itl: float
    suffix_prefill: float  # a lone SUFFIX_LEN prompt's TTFT: one prefill of the shared-prefix suffix
    capacity: dict[str, float]  # requests/s per preset, closed loop with 8 in flight


def cell_number(preset: str, load: float) -> int:
    """A cell's place in the full default grid (PRESETS x LOADS, 1-based), which fixes its seed: a run of some presets
    or loads (`--presets storm`) draws the same arrivals as the full run's cell of that name. Numbered by
    position in the run instead, a steady + storm run's storm@0.7 drew the full run's steady@1.5 seed. A load
    outside LOADS numbers past the grid, 100 per preset plus 10x the load."""
    row = PRESETS.index(preset)
    if load in LOADS:
        return 1 + row * len(LOADS) + LOADS.index(load)
    return 100 * (row + 1) + round(10 * load)


def server_order(preset: str, load: float) -> tuple[str, str]:
    """Which server a cell drives first: a checkerboard over the grid, alternating along presets and along
    loads, so each load has both orders. By the parity of the cell number (until stop 49) every 0.7x cell ran
    the candidate first and every 1.5x cell ran it second: the order went with the load."""
    row = PRESETS.index(preset)
    column = LOADS.index(load) if load in LOADS else round(10 * load)
    return ("candidate", "fcfs") if (row + column) % 2 == 0 else ("fcfs", "candidate")


def workload_args(preset: str, rate: float, duration: float, seed: int) -> list[str]:
    """`titan bench` flags for one preset offered at `rate` requests/s on average."""
    common = ["--seed", str(seed), "--ignore-eos", "--duration", f"{duration:g}"]
    if preset == "steady":
        return ["--preset", "steady", "--request-rate", f"{rate:.3f}", "--input-len", str(SHORT_IN),
                "--output-len", str(SHORT_OUT), *common]
    if preset == "burst":
        # A fifth of the rate as background, the rest in simultaneous bursts every BURST_INTERVAL seconds.
        size = max(2, round(0.8 * rate * BURST_INTERVAL))
        return ["--preset", "burst", "--request-rate", f"{0.2 * rate:.3f}", "--burst-size", str(size),
                "--burst-interval", f"{BURST_INTERVAL:g}", "--input-len", str(SHORT_IN), "--output-len",
                str(SHORT_OUT), *common]
    if preset == "storm":
        return ["--preset", "prefill-storm", "--request-rate", f"{rate:.3f}", "--input-len", "64:128",
                "--output-len", "32", "--long-input-len", str(STORM_LONG_IN), "--long-output-len", "16",
                "--long-fraction", f"{STORM_LONG_FRACTION:g}", *common]
    # A hot prefix (a system prompt in use): the target is about the tail while it is shared, not the one
    # request that computes it first.
    return ["--preset", "shared-prefix", "--request-rate", f"{rate:.3f}", "--prefix-len", str(PREFIX_LEN),
            "--input-len", str(SUFFIX_LEN), "--output-len", str(PREFIX_OUT), "--warm-prefixes", *common]


def closed_loop_args(preset: str, requests: int, seed: int) -> list[str]:
    """The preset's requests with 8 in flight at all times (burst's requests are steady's)."""
    args = workload_args("steady" if preset == "burst" else preset, 1.0, 1.0, seed)
    cut = args.index("--duration")
    args = args[:cut] + args[cut + 2:]
    args[args.index("--request-rate") + 1] = "inf"
    return args + ["--max-concurrency", "8", "--num-requests", str(requests)]


def solo(url: str, model: str, words: int, max_tokens: int, seed: int) -> RequestResult:
    """One request alone, streamed, through the bench client's timing (its own seed: no prefix-cache hit)."""
    runs_dir = Path("benchmarks/results/default_policy/calibration")
    _, _, report = run_bench(url, ["--preset", "steady", "--num-requests", "1", "--request-rate", "inf",
                                   "--input-len", str(words), "--output-len", str(max_tokens), "--ignore-eos",
                                   "--seed", str(100 + seed)], runs_dir / f"solo-{words}-{seed}")
    return RequestResult.from_dict(report["requests"][0])


def calibrate(server: ServerProcess, model: str, presets: tuple[str, ...], requests: int) -> Calibration:
    # Medians of three: one lone request is at the mercy of the machine's other load.
    shorts = [solo(server.url, model, SHORT_IN, 32, seed) for seed in range(3)]
    suffixes = [solo(server.url, model, SUFFIX_LEN, 4, seed) for seed in range(3, 6)]
    capacity: dict[str, float] = {}
    for preset in presets:
        if preset == "burst" and "steady" in capacity:
            capacity[preset] = capacity["steady"]
            continue
        _, _, report = run_bench(server.url, closed_loop_args(preset, requests, seed=1),
                                 Path("benchmarks/results/default_policy/calibration") / f"capacity-{preset}")
        capacity[preset] = report["summary"]["request_throughput"]
        print(f"  capacity {preset}: {capacity[preset]:.3f} req/s", flush=True)
    return Calibration(statistics.median(r.ttft or 0.0 for r in shorts),
                       statistics.median(gap for r in shorts for gap in r.itls),
                       statistics.median(r.ttft or 0.0 for r in suffixes), capacity)


def cell_stats(report: dict[str, Any], slo: Slo) -> dict[str, Any]:
    summary = report["summary"]
    return results_stats([RequestResult.from_dict(data) for data in report["requests"]], slo,
                         summary["duration_s"], summary["output_token_throughput"])


def results_stats(results: list[RequestResult], slo: Slo, duration_s: float, output_tok_s: float) -> dict[str, Any]:
    """One server's numbers for a cell: TTFT and gaps of the requests that succeeded, goodput of all sent."""
    ok = [r for r in results if r.success]
    itl = summarize([gap for r in ok for gap in r.itls])
    # How far ITL P99 / P50 could move on another draw of the same traffic (titan.bench.uncertainty)
    interval = tail_ratio_interval(itl_samples(ok))
    ttft = summarize([r.ttft for r in ok if r.ttft is not None])
    good = goodput(results, slo, duration_s)
    return {"requests": len(results), "ok": len(ok), "errors": len(results) - len(ok),
            "output_tok_s": output_tok_s, "ttft_ms": ttft, "itl_ms": itl,
            "itl_p99_over_p50": interval.to_dict() if interval else None,
            "goodput_rps": good["goodput_rps"], "good": good["good"], "attainment": good["attainment"]}


def budget_evidence(url: str, since_wall: float, keep: Path) -> dict[str, Any]:
    """A server's /debug/steps over the cell: why steps got their budget, and predicted vs actual. The steps
    themselves are kept in `keep` (steps.json), for attributing the cell's gaps to steps."""
    data = httpx.get(url + "/debug/steps", params={"limit": 2048}, timeout=30).json()["data"]
    steps = [s for s in data if s["time"] >= since_wall]
    keep.mkdir(parents=True, exist_ok=True)
    (keep / "steps.json").write_text(json.dumps(steps))
    reasons = collections.Counter((s.get("budget") or {}).get("reason", "none") for s in steps)
    ratios = [s["duration"] / s["predicted_duration"] for s in steps if s.get("predicted_duration")]
    return {"steps": len(steps), "reasons": dict(reasons),
            "actual_over_predicted_p50": statistics.median(ratios) if ratios else None,
            "actual_over_predicted_p90": statistics.quantiles(ratios, n=10)[-1] if len(ratios) >= 10 else None,
            **gap_sources(steps)}


def gap_sources(steps: list[dict[str, Any]]) -> dict[str, float | None]:
    """Where a cell's token gaps come from: the share made by decode-only steps (each step's gaps are its
    decodes), and those steps' own P99 / P50 duration (the host's scatter of one kind of step). Near a 50 %
    share the ITL P50 sits at the boundary between decode-only steps and steps that also prefill, so a cell's
    ITL P99 / P50 flips between draws (stop 48, docs/scheduling-history.md)."""
    total = sum(s["num_decodes"] for s in steps)
    alone = [s["duration"] for s in steps if s["num_prefill_tokens"] == 0 for _ in range(s["num_decodes"])]
    # the ITL rule's own percentiles (titan.bench.analysis.summarize)
    spread = summarize(alone) if len(alone) >= 20 else None
    return {"decode_only_gap_share": len(alone) / total if total else None,
            "decode_only_p99_over_p50": spread["p99"] / spread["p50"] if spread else None}


def evaluate(cells: dict[str, dict[str, Any]], calibration: Calibration) -> list[dict[str, Any]]:
    targets: list[dict[str, Any]] = []

    def add(name: str, passed: bool, detail: str) -> None:
        targets.append({"target": name, "pass": passed, "detail": detail})

    for key, cell in cells.items():
        preset, load = key.split("@")
        cand, base = cell["candidate"], cell["fcfs"]
        itl, ttft = cand["itl_ms"], cand["ttft_ms"]
        if preset in ("steady", "storm") and itl["p50"]:
            add(f"{key}: ITL P99 <= 2 x P50", itl["p99"] <= 2 * itl["p50"],
                f"{itl['p99']:.0f} / {itl['p50']:.0f} ms = {itl['p99'] / itl['p50']:.2f}"
                + interval_note(cand.get("itl_p99_over_p50"), 2.0))
        if preset == "storm" and itl["p50"]:
            add(f"{key}: ITL max <= 3 x P50", itl["max"] <= 3 * itl["p50"],
                f"{itl['max']:.0f} / {itl['p50']:.0f} ms = {itl['max'] / itl['p50']:.2f}")
        if preset == "burst":
            ratio = cand["output_tok_s"] / base["output_tok_s"] if base["output_tok_s"] else float("inf")
            add(f"{key}: output tok/s >= 0.9 x fcfs", ratio >= 0.9,
                f"{cand['output_tok_s']:.1f} vs {base['output_tok_s']:.1f} = {ratio:.2f}")
            if base["ttft_ms"]["p99"]:
                ratio = ttft["p99"] / base["ttft_ms"]["p99"]
                add(f"{key}: TTFT P99 <= 1.1 x fcfs", ratio <= 1.1,
                    f"{ttft['p99']:.0f} vs {base['ttft_ms']['p99']:.0f} ms = {ratio:.2f}")
        if preset == "shared" and ttft["p50"]:
            bound = 1.2 * ttft["p50"] + 1000 * calibration.suffix_prefill
            add(f"{key}: TTFT P99 <= 1.2 x P50 + one suffix prefill", ttft["p99"] <= bound,
                f"{ttft['p99']:.0f} vs {bound:.0f} ms (P50 {ttft['p50']:.0f}, suffix "
                f"{1000 * calibration.suffix_prefill:.0f})")
        # Both were sent the same requests; the rate's denominator includes the drain, so compare counts.
        add(f"{key}: goodput >= fcfs", cand["good"] >= base["good"],
            f"{cand['good']} vs {base['good']} of {cand['requests']} good ({cand['goodput_rps']:.3f} vs "
            f"{base['goodput_rps']:.3f} req/s)")
    return targets


def interval_note(interval: dict[str, float] | None, bound: float) -> str:
    """A rule's verdict in words of its block-bootstrap interval: whether another draw could flip it."""
    if interval is None:
        return ""
    spread = f"; {interval['level']:.0%} interval {interval['low']:.2f}-{interval['high']:.2f}"
    if Interval(**interval).straddles(bound):
        return spread + f", either side of {bound:g}: another draw could flip it"
    return spread


def print_table(cells: dict[str, dict[str, Any]]) -> None:
    rows = (("output tok/s", lambda c: f"{c['output_tok_s']:.1f}"),
            ("TTFT P50/P99 ms", lambda c: f"{c['ttft_ms']['p50'] or 0:.0f}/{c['ttft_ms']['p99'] or 0:.0f}"),
            ("ITL P50/P99/max ms", lambda c: f"{c['itl_ms']['p50'] or 0:.0f}/{c['itl_ms']['p99'] or 0:.0f}/"
                                             f"{c['itl_ms']['max'] or 0:.0f}"),
            ("ITL P99/P50 (90 %)", lambda c: "-" if not c.get("itl_p99_over_p50") else
             "{estimate:.2f} ({low:.2f}-{high:.2f})".format(**c["itl_p99_over_p50"])),
            ("goodput req/s (good/n)", lambda c: f"{c['goodput_rps']:.3f} ({c['good']}/{c['requests']})"),
            ("errors", lambda c: str(c["errors"])))
    print(f"{'cell':<14}{'metric':<24}{'candidate':>20}{'fcfs':>20}")
    for key, cell in cells.items():
        for label, value in rows:
            print(f"{key:<14}{label:<24}{value(cell['candidate']):>20}{value(cell['fcfs']):>20}")
        steps = cell["candidate_steps"]
        print(f"{'':<14}{'candidate budgets':<24}{steps['reasons']}  actual/predicted P50 "
              f"{steps['actual_over_predicted_p50']}")
        if steps.get("decode_only_gap_share") is not None:
            scatter = steps["decode_only_p99_over_p50"]
            print(f"{'':<14}{'candidate gaps':<24}{steps['decode_only_gap_share']:.0%} from decode-only steps"
                  + (f" (their P99 / P50 duration {scatter:.2f})" if scatter else ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--presets", default=",".join(PRESETS))
    parser.add_argument("--loads", default=",".join(f"{load:g}" for load in LOADS),
                        help="offered load as fractions of measured capacity")
    parser.add_argument("--duration", type=float, default=40.0, help="seconds of sending per cell")
    parser.add_argument("--calibration-requests", type=int, default=24)
    parser.add_argument("--slo", default=None, help="goodput SLO, e.g. ttft=4000,itl=300 (default: from calibration)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--candidate-flags", default="", help="extra flags for the candidate only, e.g. "
                        "'--min-prefill-chunk 4' (space-separated)")
    parser.add_argument("--quick", action="store_true", help="about 10 minutes: 15 s cells, 12-request calibration")
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/default_policy.json"))
    args = parser.parse_args()
    presets = tuple(p.strip() for p in args.presets.split(",") if p.strip())
    if set(presets) - set(PRESETS):
        parser.error(f"--presets: choose from {', '.join(PRESETS)}")
    loads = tuple(float(x) for x in args.loads.split(","))
    duration, calibration_requests = args.duration, args.calibration_requests
    if args.quick:
        duration, calibration_requests = min(duration, 15.0), min(calibration_requests, 12)

    env = {"OMP_NUM_THREADS": "1"}
    base_flags = ["--model", "default", "--device", "cpu", "--threads", "1"]
    slo_is_default = SchedulerConfig().policy == "slo"
    flags = {"candidate": base_flags + ([] if slo_is_default else ["--scheduling-policy", "slo"])
             + args.candidate_flags.split(),
             "fcfs": base_flags + ["--scheduling-policy", "fcfs"]}
    load_start = os.getloadavg()
    started = time.perf_counter()
    print(f"load average at start: {' '.join(f'{v:.2f}' for v in load_start)}; {os.cpu_count()} cpus, "
          f"{cpu_description()}; candidate flags: {flags['candidate'][len(base_flags):] or 'none'}", flush=True)
    cells: dict[str, dict[str, Any]] = {}
    with ServerProcess(flags["candidate"], env=env) as candidate, ServerProcess(flags["fcfs"], env=env) as fcfs:
        servers = {"candidate": candidate, "fcfs": fcfs}
        model = httpx.get(fcfs.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        for server in servers.values():
            warm_up(server.url, model)
        calibration = calibrate(fcfs, model, presets, calibration_requests)
        slo_text = args.slo or (f"ttft={max(1000.0, 10_000 * calibration.solo_ttft):.0f},"
                                f"itl={5000 * calibration.solo_itl:.0f}")
        slo = Slo.parse(slo_text)
        print(f"solo TTFT {1000 * calibration.solo_ttft:.0f} ms, gap {1000 * calibration.solo_itl:.0f} ms, suffix "
              f"prefill {1000 * calibration.suffix_prefill:.0f} ms; goodput SLO {slo_text}", flush=True)
        for preset in presets:
            for load in loads:
                key = f"{preset}@{load:g}"
                rate = load * calibration.capacity[preset]
                number = cell_number(preset, load)
                order = server_order(preset, load)
                cell: dict[str, Any] = {"rate_rps": rate}
                for name in order:
                    server = servers[name]
                    since = time.time()
                    before = os.getloadavg()[0]
                    # A seed per cell, the same for both servers: no cell hits the prefix cache of another's prompts.
                    seed = args.seed + 1000 * number
                    run_dir = Path("benchmarks/results/default_policy") / f"{name}-{key}"
                    _, code, report = run_bench(server.url, workload_args(preset, rate, duration, seed), run_dir)
                    cell[name] = cell_stats(report, slo) | {"bench_exit": code, "load_1min": before}
                    # both servers': a step's duration is compared shape for shape (the machine's noise or the policy)
                    cell[f"{name}_steps"] = budget_evidence(server.url, since, run_dir)
                    got = cell[name]
                    print(f"  {key} {name}: tok/s {got['output_tok_s']:.1f}, TTFT P99 {got['ttft_ms']['p99'] or 0:.0f}"
                          f" ms, ITL P50/P99 {got['itl_ms']['p50'] or 0:.0f}/{got['itl_ms']['p99'] or 0:.0f} ms, "
                          f"goodput {got['goodput_rps']:.3f}, load {before:.1f}", flush=True)
                cells[key] = cell
    load_end = os.getloadavg()
    print()
    print_table(cells)
    targets = evaluate(cells, calibration)
    print()
    for target in targets:
        print(f"{'PASS' if target['pass'] else 'FAIL'}  {target['target']}: {target['detail']}")
    print(f"load average at start {' '.join(f'{v:.2f}' for v in load_start)}, at end "
          f"{' '.join(f'{v:.2f}' for v in load_end)}; {time.perf_counter() - started:.0f} s in all")
    write_result(args.output, {
        "command": sys.argv, "git_head": git_head(), "source_digest": source_digest(), "flags": flags,
        "load_average": {"start": load_start, "end": load_end}, "cpu": cpu_description(),
        "calibration": calibration.__dict__, "slo": slo_text, "duration_s": duration, "cells": cells,
        "targets": targets, "total_seconds": time.perf_counter() - started,
    })


if __name__ == "__main__":
    main()
