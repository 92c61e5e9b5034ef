"""Tail latency under transients: the `fcfs` baseline against `slo` scheduling with admission control.

One build, two servers started one after the other (never together: they would share the cores):
`fcfs` (`--scheduling-policy fcfs`, no admission limits, like vLLM) and `slo` (`--scheduling-policy slo --itl-slo-ms X`,
`--ttft-slo-ms Y` and queue limits). Against each, `titan bench` runs two scenarios:

* storm: short interactive requests well under capacity, plus an ~800-token prompt every few seconds
  (preset prefill-storm; fixed output lengths, fixed seed);
* burst: ~3x the server's capacity of mixed interactive (priority 0) and batch (priority 1) requests
  (preset mixed-priority with --send-priority) for `--burst-duration` seconds, then the backlog drains.

From the bench's per-request data (--save-requests) it computes, for the interactive class: ITL P50/P99/max,
TTFT P50/P99, goodput under `--slo`, 429s by class, 5xx, and whether every accepted request completed;
from the servers' `/debug/steps` and `/metrics`: step times, steps over the ITL target and why, admission
rejections by reason. Then it checks the issue's targets and prints PASS/FAIL for each:

  storm, slo: interactive ITL P99 <= 2 x P50 and max <= 4 x P50
  burst: slo interactive goodput >= 1.5 x fcfs
  every run: no 5xx, every accepted (non-429) request completes

    .venv/bin/python benchmarks/transients.py [--quick] [--scenarios storm,burst] [--burst-rate R]
        [--output benchmarks/results/transients.json]

The default run takes about 5 minutes on a 2-core CPU (--quick: about 2); each bench's own result.json
(per-request data included) goes under benchmarks/results/transients/<policy>-<scenario>/.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from common import write_result

from harness.server import REPO_ROOT, ServerProcess
from titan.bench.analysis import Slo, goodput, summarize
from titan.bench.client import RequestResult
from titan.bench.metrics_scraper import parse_prometheus_text

POLICIES = ("fcfs", "slo")
SCENARIOS = ("storm", "burst")
INTERACTIVE = "interactive"
# Measured here (2 cores, default model, fcfs, this script's burst workload offered at 4.5 req/s): fcfs completed
# 2.5 requests/s over the run (it batches up to 40 streams); the default burst offers 3x that.
CALIBRATED_BURST_RATE = 7.5


@dataclass(frozen=True)
class TransientsConfig:
    """Everything the run depends on; one field per command-line flag."""

    scenarios: tuple[str, ...] = SCENARIOS
    model: str = "default"
    seed: int = 0
    # storm
    storm_duration: float = 75.0  # seconds of sending
    storm_rate: float = 0.8  # requests/s, both classes
    long_every: float = 4.0  # mean seconds between ~800-token prompts
    long_input_len: int = 800
    long_output_len: int = 16
    # burst
    burst_duration: float = 30.0  # seconds of sending; the backlog drains afterwards
    burst_rate: float = CALIBRATED_BURST_RATE
    batch_input_len: int = 256
    batch_output_len: int = 64
    # interactive requests (both scenarios)
    interactive_input_len: str = "32:64"
    interactive_output_len: int = 32
    # the slo server
    itl_slo_ms: float = 120.0  # ~2x a decode step of a few streams here (~60 ms): room for a prefill chunk
    # With --admit-long-prompts, an 800-token prompt is judged by the wait ahead of it: the storm's long
    # prompts are part of the scenario, not load to shed.
    ttft_slo_ms: float = 2000.0
    max_queued_requests: int = 16
    max_queued_tokens: int = 2048
    # goodput: an interactive request is good when its TTFT and every token gap meet these
    slo: str = "ttft=3000,itl=400"
    quick: bool = False
    output: Path = Path("benchmarks/results/transients.json")
    runs_dir: Path = Path("benchmarks/results/transients")

    def __post_init__(self) -> None:
        unknown = set(self.scenarios) - set(SCENARIOS)
        if not self.scenarios or unknown:
            raise ValueError(f"--scenarios: choose from {', '.join(SCENARIOS)} (got {', '.join(self.scenarios)})")
        positive = ("storm_duration", "storm_rate", "long_every", "long_input_len", "long_output_len",
                    "burst_duration", "burst_rate", "batch_input_len", "batch_output_len",
                    "interactive_output_len", "itl_slo_ms", "ttft_slo_ms", "max_queued_requests",
                    "max_queued_tokens")
        for name in positive:
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0")
        if not 0 < self.long_fraction <= 1:
            raise ValueError("--long-every must be at least 1 / --storm-rate (one long prompt per request at most)")
        Slo.parse(self.slo)  # raises ValueError on a malformed SLO

    @property
    def long_fraction(self) -> float:
        return 1.0 / (self.storm_rate * self.long_every)

    def server_flags(self, policy: str) -> list[str]:
        flags = ["--model", self.model, "--device", "cpu", "--scheduling-policy", policy]
        if policy == "slo":
            flags += ["--itl-slo-ms", f"{self.itl_slo_ms:g}",
                      "--ttft-slo-ms", f"{self.ttft_slo_ms:g}", "--admit-long-prompts",
                      "--max-queued-requests", str(self.max_queued_requests),
                      "--max-queued-tokens", str(self.max_queued_tokens)]
        return flags

    def bench_args(self, scenario: str) -> list[str]:
        common = ["--seed", str(self.seed), "--ignore-eos", "--slo", self.slo, "--input-len",
                  self.interactive_input_len, "--output-len", str(self.interactive_output_len)]
        if scenario == "storm":
            return ["--preset", "prefill-storm", "--request-rate", f"{self.storm_rate:g}",
                    "--duration", f"{self.storm_duration:g}", "--long-input-len", str(self.long_input_len),
                    "--long-output-len", str(self.long_output_len), "--long-fraction", f"{self.long_fraction:.4f}",
                    *common]
        return ["--preset", "mixed-priority", "--send-priority", "--request-rate", f"{self.burst_rate:g}",
                "--duration", f"{self.burst_duration:g}", "--batch-input-len", str(self.batch_input_len),
                "--batch-output-len", str(self.batch_output_len), *common]


@dataclass
class RunRecord:
    """One scenario against one server: what was run, what the bench saw, what the server saw."""

    policy: str
    scenario: str
    bench_command: list[str]
    bench_dir: str
    bench_exit_code: int
    started_wall: float
    seconds: float
    load_before: tuple[float, float, float]
    load_after: tuple[float, float, float]
    interactive: dict[str, Any] = field(default_factory=dict)
    overall: dict[str, Any] = field(default_factory=dict)
    server: dict[str, Any] = field(default_factory=dict)
    spikes: list[dict[str, Any]] = field(default_factory=list)


def source_digest() -> str:
    """A hash of titan/'s Python sources: tells whether both servers really ran the same build."""
    digest = hashlib.sha256()
    for path in sorted((REPO_ROOT / "titan").rglob("*.py")):
        digest.update(str(path.relative_to(REPO_ROOT)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def git_head() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def warm_up(url: str, model: str) -> None:
    """A few steps of mixed shapes, unmeasured, so the slo server's step cost model is fitted before the
    scenarios start (it needs a handful of observed steps) and both servers start equally warm."""
    words = "the quick brown fox jumps over a lazy dog while people read books in the old city library".split()
    long_prompt = " ".join(words[i % len(words)] for i in range(400))

    def send(prompt: str, max_tokens: int) -> None:
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
        httpx.post(url + "/v1/completions", json=body, timeout=120).raise_for_status()

    threads = [threading.Thread(target=send, args=(long_prompt, 4))]
    threads += [threading.Thread(target=send, args=(" ".join(words[:20 + 8 * i]), 16)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def run_bench(url: str, args: list[str], output_dir: Path) -> tuple[list[str], int, dict[str, Any]]:
    command = [sys.executable, "-m", "titan.entrypoints.cli", "bench", "--base-url", url, *args,
               "--output-dir", str(output_dir), "--save-requests", "--no-plots", "--quiet"]
    finished = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True)
    result_file = output_dir / "result.json"
    if not result_file.exists():
        raise RuntimeError(f"titan bench wrote no result (exit {finished.returncode}):\n{finished.stderr[-3000:]}")
    return command, finished.returncode, json.loads(result_file.read_text())


def interactive_stats(results: list[RequestResult], slo: Slo, duration: float, ttft_target_ms: float) -> dict[str, Any]:
    ok = [result for result in results if result.success]
    itl = summarize([gap for result in ok for gap in result.itls])
    ttft = summarize([result.ttft for result in ok if result.ttft is not None])
    good = goodput(results, slo, duration)
    p50 = itl["p50"]
    return {
        "requests": len(results), "succeeded": len(ok),
        "itl_ms": itl, "ttft_ms": ttft,
        "itl_p99_over_p50": itl["p99"] / p50 if p50 else None,
        "itl_max_over_p50": itl["max"] / p50 if p50 else None,
        "goodput_rps": good["goodput_rps"], "good": good["good"], "slo_attainment": good["attainment"],
        # Admitted, yet slower to start than the slo server's admission target: how optimistic its prediction was.
        "ttft_over_server_target": sum((r.ttft or 0.0) * 1000 > ttft_target_ms for r in ok),
        "prompt_tokens_mean": float(np.mean([r.prompt_tokens for r in ok if r.prompt_tokens])) if ok else None,
    }


def ttft_behind_other_class(results: list[RequestResult]) -> dict[str, Any]:
    """TTFT of interactive requests sent while an accepted request of the other class (a long prompt, a batch
    job) still waited for its first token, against the rest: head-of-line blocking shows up here."""
    others = [r for r in results if r.request_class != INTERACTIVE and r.status == 200 and r.token_times]
    behind: list[float] = []
    clear: list[float] = []
    for result in results:
        if result.request_class != INTERACTIVE or not result.success or result.ttft is None:
            continue
        blocked = any(other.sent_at < result.sent_at < other.token_times[0] for other in others)
        (behind if blocked else clear).append(result.ttft)
    return {"behind_other_class": summarize(behind), "otherwise": summarize(clear)}


def outcome_stats(results: list[RequestResult], duration: float) -> dict[str, Any]:
    """Rejections, server errors and completeness over all classes."""
    by_class: dict[str, dict[str, int]] = {}
    for result in results:
        counts = by_class.setdefault(result.request_class, {"sent": 0, "ok": 0, "rejected_429": 0})
        counts["sent"] += 1
        counts["ok"] += result.success
        counts["rejected_429"] += result.status == 429
    for name, counts in by_class.items():
        members = [r for r in results if r.request_class == name and r.success]
        ttft = summarize([r.ttft for r in members if r.ttft is not None])
        e2e = summarize([r.e2e for r in members if r.e2e is not None])
        counts |= {"ttft_p50_ms": ttft["p50"], "ttft_p99_ms": ttft["p99"], "e2e_p50_ms": e2e["p50"]}
    accepted = [result for result in results if result.status != 429]
    # Complete: a 200 stream that ended normally with every token asked for (the bench sends ignore_eos).
    incomplete = [result for result in accepted
                  if not result.success or (result.completion_tokens or 0) < result.max_tokens]
    return {
        "requests": len(results), "duration_s": duration,
        "completed_rps": sum(result.success for result in results) / duration if duration > 0 else 0.0,
        "by_class": by_class,
        "rejected_429": sum(counts["rejected_429"] for counts in by_class.values()),
        "server_errors_5xx": sum(result.status >= 500 for result in results),
        "accepted": len(accepted),
        "accepted_not_completed": len(incomplete),
        "incomplete_examples": [{"request": r.index, "class": r.request_class, "status": r.status,
                                 "error": r.error, "tokens": r.completion_tokens, "max_tokens": r.max_tokens}
                                for r in incomplete[:5]],
    }


def admission_rejections(url: str) -> dict[str, float]:
    """`titan:admission_rejections_total` by reason (counts since the server started)."""
    samples = parse_prometheus_text(httpx.get(url + "/metrics", timeout=10).text)
    return {sample.labels.get("reason", ""): sample.value for sample in samples
            if sample.name == "titan:admission_rejections_total"}


def server_evidence(url: str, since_wall: float, itl_target_ms: float,
                    rejections_before: dict[str, float]) -> dict[str, Any]:
    """The server's own view of the run: engine step durations (/debug/steps) and admission counters."""
    evidence: dict[str, Any] = {}
    try:
        steps = httpx.get(url + "/debug/steps", params={"limit": 100_000}, timeout=10).json()["data"]
    except (httpx.HTTPError, ValueError, KeyError) as error:
        steps = []
        evidence["steps_error"] = f"{type(error).__name__}: {error}"
    steps = [step for step in steps if step.get("time", 0.0) >= since_wall]
    if steps:
        durations = [step["duration"] for step in steps]
        over = [step for step in steps if step["duration"] * 1000 > itl_target_ms]
        ratios = [step["duration"] / step["predicted_duration"] for step in over if step.get("predicted_duration")]
        prefill = [step.get("num_prefill_tokens", 0) for step in steps]
        evidence["steps"] = {
            "count": len(steps), "duration_ms": summarize(durations),
            "max_prefill_tokens": max(prefill),
            # Prefill tokens per second of engine time: how fast queued prompts can get their first token.
            "prefill_tokens_per_second": sum(prefill) / sum(durations),
            "prefill_tokens_per_step": summarize([tokens for tokens in prefill if tokens], scale=1.0),
            "over_itl_target": {
                "target_ms": itl_target_ms, "count": len(over),
                "with_prefill": sum(step.get("num_prefill_tokens", 0) > 0 for step in over),
                "decode_only": sum(step.get("num_prefill_tokens", 0) == 0 for step in over),
                "with_gc_pause_over_10ms": sum(step.get("gc_pause", 0.0) > 0.01 for step in over),
                "with_preemptions": sum(step.get("num_preemptions", 0) > 0 for step in over),
                "actual_over_predicted_median": float(np.median(ratios)) if ratios else None,
                "worst": sorted(({key: step.get(key) for key in ("duration", "predicted_duration", "num_tokens",
                                                                  "num_sequences", "num_prefill_tokens",
                                                                  "num_decodes", "num_preemptions", "gc_pause")}
                                 for step in over), key=lambda step: -step["duration"])[:5],
            },
        }
    try:
        after = admission_rejections(url)
        evidence["admission_rejections"] = {reason: count - rejections_before.get(reason, 0.0)
                                            for reason, count in after.items()}
    except httpx.HTTPError as error:
        evidence["metrics_error"] = f"{type(error).__name__}: {error}"
    return evidence


def top_spikes(report: dict[str, Any], count: int = 5) -> list[dict[str, Any]]:
    spikes = sorted(report["transients"]["spikes"], key=lambda spike: -spike["magnitude"])[:count]
    return [{key: spike[key] for key in ("metric", "start_s", "duration_s", "peak_p99_ms", "max_ms", "magnitude",
                                         "causes")} for spike in spikes]


def run_scenario(server: ServerProcess, policy: str, scenario: str, config: TransientsConfig) -> RunRecord:
    output_dir = config.runs_dir / f"{policy}-{scenario}"
    load_before = os.getloadavg()
    rejections_before = admission_rejections(server.url)
    started_wall, started = time.time(), time.perf_counter()
    command, exit_code, report = run_bench(server.url, config.bench_args(scenario), output_dir)
    seconds = time.perf_counter() - started
    results = [RequestResult.from_dict(data) for data in report["requests"]]
    duration = report["summary"]["duration_s"]
    record = RunRecord(policy, scenario, command, str(output_dir), exit_code, started_wall, seconds, load_before,
                       os.getloadavg())
    record.interactive = interactive_stats([r for r in results if r.request_class == INTERACTIVE],
                                           Slo.parse(config.slo), duration, config.ttft_slo_ms)
    record.overall = outcome_stats(results, duration)
    record.interactive["ttft_ms_split"] = ttft_behind_other_class(results)
    record.overall["offered_rps"] = config.storm_rate if scenario == "storm" else config.burst_rate
    record.server = server_evidence(server.url, started_wall, config.itl_slo_ms, rejections_before)
    record.spikes = top_spikes(report)
    itl = record.interactive["itl_ms"]
    print(f"  {policy}/{scenario}: {len(results)} requests in {seconds:.0f} s, interactive ITL p50 "
          f"{_fmt(itl['p50'])} p99 {_fmt(itl['p99'])} max {_fmt(itl['max'])} ms, goodput "
          f"{record.interactive['goodput_rps']:.3f} req/s, 429s {record.overall['rejected_429']}, "
          f"5xx {record.overall['server_errors_5xx']}, load {load_before[0]:.1f}->{record.load_after[0]:.1f}",
          flush=True)
    return record


def _fmt(value: Any, digits: int = 0) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return f"{value:,.{digits}f}" if isinstance(value, float) else str(value)


def evaluate(runs: dict[tuple[str, str], RunRecord]) -> list[dict[str, Any]]:
    """The issue's targets, each with the numbers it was judged on (None: the scenario was not run)."""
    targets: list[dict[str, Any]] = []

    def add(name: str, passed: bool | None, detail: str) -> None:
        targets.append({"target": name, "pass": passed, "detail": detail})

    storm = runs.get(("slo", "storm"))
    if storm:
        itl = storm.interactive["itl_ms"]
        ratio_p99, ratio_max = storm.interactive["itl_p99_over_p50"], storm.interactive["itl_max_over_p50"]
        add("storm/slo: interactive ITL P99 <= 2 x P50", ratio_p99 is not None and ratio_p99 <= 2.0,
            f"P99 {_fmt(itl['p99'], 1)} ms / P50 {_fmt(itl['p50'], 1)} ms = {_fmt(ratio_p99, 2)}")
        add("storm/slo: interactive ITL max <= 4 x P50", ratio_max is not None and ratio_max <= 4.0,
            f"max {_fmt(itl['max'], 1)} ms / P50 {_fmt(itl['p50'], 1)} ms = {_fmt(ratio_max, 2)}")
    base, slo = runs.get(("fcfs", "burst")), runs.get(("slo", "burst"))
    if base and slo:
        fcfs_good, slo_good = base.interactive["goodput_rps"], slo.interactive["goodput_rps"]
        ratio = slo_good / fcfs_good if fcfs_good else math.inf
        add("burst: slo interactive goodput >= 1.5 x fcfs", slo_good >= 1.5 * fcfs_good,
            f"{slo_good:.3f} vs {fcfs_good:.3f} req/s = {_fmt(ratio, 2)}x")
    errors = {f"{p}/{s}": run.overall["server_errors_5xx"] for (p, s), run in runs.items()}
    add("no 5xx (every run)", not any(errors.values()), ", ".join(f"{k} {v}" for k, v in errors.items()))
    incomplete = {f"{p}/{s}": run.overall["accepted_not_completed"] for (p, s), run in runs.items()}
    add("every accepted request completes (every run)", not any(incomplete.values()),
        "accepted but not completed: " + ", ".join(f"{k} {v}" for k, v in incomplete.items()))
    return targets


TABLE_ROWS: tuple[tuple[str, Any], ...] = (
    ("requests sent (all classes)", lambda r: r.overall["requests"]),
    ("offered rate (req/s)", lambda r: r.overall["offered_rps"]),
    ("completed rate (req/s)", lambda r: r.overall["completed_rps"]),
    ("run duration (s)", lambda r: r.overall["duration_s"]),
    ("interactive sent / ok", lambda r: f"{r.interactive['requests']} / {r.interactive['succeeded']}"),
    ("interactive ITL P50 (ms)", lambda r: r.interactive["itl_ms"]["p50"]),
    ("interactive ITL P99 (ms)", lambda r: r.interactive["itl_ms"]["p99"]),
    ("interactive ITL max (ms)", lambda r: r.interactive["itl_ms"]["max"]),
    ("  P99 / P50", lambda r: r.interactive["itl_p99_over_p50"]),
    ("  max / P50", lambda r: r.interactive["itl_max_over_p50"]),
    ("interactive TTFT P50 (ms)", lambda r: r.interactive["ttft_ms"]["p50"]),
    ("interactive TTFT P99 (ms)", lambda r: r.interactive["ttft_ms"]["p99"]),
    ("interactive goodput (req/s)", lambda r: r.interactive["goodput_rps"]),
    ("interactive good / attainment", lambda r: f"{r.interactive['good']} / {r.interactive['slo_attainment']:.0%}"),
    ("429 interactive", lambda r: r.overall["by_class"].get(INTERACTIVE, {}).get("rejected_429", 0)),
    ("429 other class", lambda r: " ".join(f"{name}:{counts['rejected_429']}" for name, counts
                                           in sorted(r.overall["by_class"].items()) if name != INTERACTIVE) or "-"),
    ("other class TTFT P50 (ms)", lambda r: " ".join(_fmt(counts["ttft_p50_ms"]) for name, counts
                                                     in sorted(r.overall["by_class"].items()) if name != INTERACTIVE)),
    ("interactive TTFT > --ttft-slo-ms", lambda r: r.interactive["ttft_over_server_target"]),
    ("  TTFT P50 sent behind other class", lambda r: r.interactive["ttft_ms_split"]["behind_other_class"]["p50"]),
    ("  TTFT P50 otherwise", lambda r: r.interactive["ttft_ms_split"]["otherwise"]["p50"]),
    ("5xx", lambda r: r.overall["server_errors_5xx"]),
    ("accepted, not completed", lambda r: r.overall["accepted_not_completed"]),
    ("engine steps P50 / max (ms)", lambda r: "-" if "steps" not in r.server else
     f"{r.server['steps']['duration_ms']['p50']:.0f} / {r.server['steps']['duration_ms']['max']:.0f}"),
    ("engine prefill tokens/s, max per step", lambda r: "-" if "steps" not in r.server else
     f"{r.server['steps']['prefill_tokens_per_second']:.0f}, {r.server['steps']['max_prefill_tokens']}"),
    ("steps over ITL target (prefill/decode-only)", lambda r: "-" if "steps" not in r.server else
     "{count} ({with_prefill}/{decode_only})".format(**r.server["steps"]["over_itl_target"])),
    ("load avg 1 min (before/after)", lambda r: f"{r.load_before[0]:.1f}/{r.load_after[0]:.1f}"),
)


def print_table(runs: dict[tuple[str, str], RunRecord], config: TransientsConfig) -> None:
    columns = [(policy, scenario) for scenario in config.scenarios for policy in POLICIES if (policy, scenario) in runs]
    width = max(len(label) for label, _ in TABLE_ROWS) + 2
    print("".ljust(width) + "".join(f"{p}/{s}".rjust(16) for p, s in columns))
    for label, value in TABLE_ROWS:
        cells = []
        for key in columns:
            cell = value(runs[key])
            digits = 2 if isinstance(cell, float) and abs(cell) < 10 else 0
            cells.append((_fmt(cell, digits) if isinstance(cell, float) else str(cell)).rjust(16))
        print(label.ljust(width) + "".join(cells))


def parse_config() -> TransientsConfig:
    defaults = TransientsConfig()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scenarios", default=",".join(defaults.scenarios), help="comma-separated: storm,burst")
    parser.add_argument("--model", default=defaults.model)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--storm-duration", type=float, default=defaults.storm_duration,
                        help="seconds of sending in the storm")
    parser.add_argument("--storm-rate", type=float, default=defaults.storm_rate,
                        help="requests/s in the storm, both classes")
    parser.add_argument("--long-every", type=float, default=defaults.long_every,
                        help="mean seconds between long prompts in the storm")
    parser.add_argument("--long-input-len", type=int, default=defaults.long_input_len)
    parser.add_argument("--long-output-len", type=int, default=defaults.long_output_len)
    parser.add_argument("--burst-duration", type=float, default=defaults.burst_duration,
                        help="seconds of sending in the burst (the backlog drains afterwards)")
    parser.add_argument("--burst-rate", type=float, default=defaults.burst_rate,
                        help=f"requests/s offered in the burst (default {CALIBRATED_BURST_RATE:g}: ~3x what "
                             "fcfs completes on a 2-core CPU)")
    parser.add_argument("--batch-input-len", type=int, default=defaults.batch_input_len)
    parser.add_argument("--batch-output-len", type=int, default=defaults.batch_output_len)
    parser.add_argument("--interactive-input-len", default=defaults.interactive_input_len, help="N or LO:HI")
    parser.add_argument("--interactive-output-len", type=int, default=defaults.interactive_output_len)
    parser.add_argument("--itl-slo-ms", type=float, default=defaults.itl_slo_ms, help="slo server's step target")
    parser.add_argument("--ttft-slo-ms", type=float, default=defaults.ttft_slo_ms,
                        help="slo server's admission limit on predicted TTFT")
    parser.add_argument("--max-queued-requests", type=int, default=defaults.max_queued_requests)
    parser.add_argument("--max-queued-tokens", type=int, default=defaults.max_queued_tokens)
    parser.add_argument("--slo", default=defaults.slo, help="goodput SLO passed to titan bench (ms)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 20 s storm, 10 s burst")
    parser.add_argument("--output", type=Path, default=defaults.output)
    parser.add_argument("--runs-dir", type=Path, default=defaults.runs_dir, help="where the bench results go")
    args = parser.parse_args()
    values = vars(args)
    values["scenarios"] = tuple(part.strip() for part in args.scenarios.split(",") if part.strip())
    if args.quick:
        values["storm_duration"] = min(args.storm_duration, 20.0)
        values["burst_duration"] = min(args.burst_duration, 10.0)
    try:
        return TransientsConfig(**values)
    except ValueError as error:
        parser.error(str(error))


def main() -> None:
    config = parse_config()
    os.environ.setdefault("TITAN_CACHE_DIR", str(REPO_ROOT / ".titan-cache"))
    print(f"load before: {' '.join(f'{v:.2f}' for v in os.getloadavg())} (1/5/15 min), {os.cpu_count()} cpus; "
          f"storm: {config.storm_rate:g} req/s, a {config.long_input_len}-token prompt every ~{config.long_every:g} s "
          f"for {config.storm_duration:g} s; burst: {config.burst_rate:g} req/s for {config.burst_duration:g} s",
          flush=True)
    runs: dict[tuple[str, str], RunRecord] = {}
    servers: dict[str, dict[str, Any]] = {}
    started = time.perf_counter()
    for policy in POLICIES:
        flags = config.server_flags(policy)
        with ServerProcess(flags) as server:
            servers[policy] = {"flags": flags, "command": ["python", "-m", "titan.entrypoints.cli", "serve", "--host",
                                                           server.host, "--port", str(server.port), *flags],
                               "git_head": git_head(), "source_digest": source_digest(),
                               "ready_seconds": server.ready_seconds}
            print(f"{policy}: ready in {server.ready_seconds:.1f} s at {server.url}", flush=True)
            warm_up(server.url, model=httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]["id"])
            for scenario in config.scenarios:
                runs[(policy, scenario)] = run_scenario(server, policy, scenario, config)

    print()
    print_table(runs, config)
    targets = evaluate(runs)
    print()
    for target in targets:
        verdict = "PASS" if target["pass"] else "FAIL"
        print(f"{verdict}  {target['target']}: {target['detail']}")
    same_build = len({server["source_digest"] for server in servers.values()}) == 1
    if not same_build:
        print("WARNING: titan/ changed between the two servers' starts; they did not run the same build")
    result = {
        "config": {**asdict(config), "long_fraction": config.long_fraction},
        "servers": servers,
        "same_build": same_build,
        "bench_args": {scenario: config.bench_args(scenario) for scenario in config.scenarios},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "total_seconds": time.perf_counter() - started,
        "targets": targets,
        "runs": {f"{policy}/{scenario}": asdict(run) for (policy, scenario), run in runs.items()},
    }
    write_result(config.output, json.loads(json.dumps(result, default=str)))


if __name__ == "__main__":
    main()
