"""`titan bench` and `titan bench compare`: arguments and handlers.

Imports stay light at module level (argparse only) so that `titan --help` never pays for httpx, numpy or
matplotlib; the handlers import what they need.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_BASE_URL = "http://127.0.0.1:8000"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `titan bench` (and its `compare` subcommand) on an existing (sub)parser."""
    from titan.bench.workload import PRESETS

    target = parser.add_argument_group("target")
    target.add_argument("--base-url", default=DEFAULT_BASE_URL,
                        help=f"server root, with or without /v1 (default {DEFAULT_BASE_URL})")
    target.add_argument("--model", default=None, help="model name to request (default: the server's first)")
    target.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    target.add_argument("--api-key", default=None, help="sent as a bearer token")
    target.add_argument("--request-timeout", type=float, default=300.0,
                        help="seconds to wait for a connection or for the next bytes of a response")
    target.add_argument("--wait-for-server", type=float, default=0.0,
                        help="seconds to wait for /v1/models to answer before starting (a server still loading)")

    load = parser.add_argument_group("load")
    load.add_argument("--preset", choices=list(PRESETS), default="steady",
                      help="; ".join(f"{p.name}: {p.description}" for p in PRESETS.values()))
    load.add_argument("--request-rate", type=float, default=None,
                      help="mean arrivals per second; inf sends all at once (default: the preset's, "
                           "or inf with --max-concurrency)")
    load.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps: 1 = Poisson, "
                      "<1 clumped, >1 regular")
    load.add_argument("--max-concurrency", type=int, default=None,
                      help="at most this many requests in flight (closed loop when the rate is inf)")
    stop = load.add_mutually_exclusive_group()
    stop.add_argument("--num-requests", type=int, default=None, help="requests to send (default 100)")
    stop.add_argument("--duration", type=float, default=None, help="seconds to keep sending")
    load.add_argument("--ramp-up", type=float, default=0.0, help="seconds of linear ramp from 0 to the rate")
    load.add_argument("--burst-size", type=int, default=None, help="requests per burst (burst preset)")
    load.add_argument("--burst-interval", type=float, default=None, help="seconds between bursts (burst)")
    load.add_argument("--seed", type=int, default=0, help="seed for prompts, lengths and arrivals")

    work = parser.add_argument_group("workload")
    work.add_argument("--input-len", default=None,
                      help="prompt tokens of the preset's main class: N, LO:HI or exp:MEAN")
    work.add_argument("--output-len", default=None,
                      help="max_tokens of the preset's main class: N, LO:HI or exp:MEAN")
    work.add_argument("--long-input-len", default=None, help="prompt tokens of prefill-storm's long requests")
    work.add_argument("--long-output-len", default=None, help="max_tokens of prefill-storm's long requests")
    work.add_argument("--long-fraction", type=float, default=None, help="share of long requests (prefill-storm)")
    work.add_argument("--batch-input-len", default=None, help="prompt tokens of batch requests (mixed-priority)")
    work.add_argument("--batch-output-len", default=None, help="max_tokens of batch requests (mixed-priority)")
    work.add_argument("--batch-fraction", type=float, default=None, help="share of batch requests (mixed-priority)")
    work.add_argument("--prefix-len", type=int, default=None, help="shared prefix tokens (shared-prefix)")
    work.add_argument("--num-prefixes", type=int, default=1, help="distinct shared prefixes (shared-prefix)")
    work.add_argument("--warm-prefixes", action="store_true",
                      help="before the run, send one 1-token request per shared prefix, so the run measures a "
                           "hot shared prefix (a system prompt in use) rather than its first computation")
    work.add_argument("--dataset", default=None, help="JSONL of {'prompt'} / {'messages'} / ShareGPT lines")
    work.add_argument("--tokenizer", default=None,
                      help="the served model's tokenizer.json for exact token counts (else synthetic "
                           "filler counts one token per word and dataset text ~4 characters per token)")
    work.add_argument("--ignore-eos", action="store_true",
                      help="fixed output lengths: send ignore_eos and min_tokens = max_tokens (vLLM extension)")
    work.add_argument("--temperature", type=float, default=0.0)
    work.add_argument("--send-priority", action="store_true",
                      help="send each class's 'priority' (mixed-priority; the server must support it)")
    work.add_argument("--no-usage", action="store_true",
                      help="do not ask for stream_options.include_usage (count text chunks instead)")

    analysis = parser.add_argument_group("analysis and output")
    analysis.add_argument("--slo", default=None, help="per-request SLO in ms, e.g. ttft=500,itl=100,e2e=10000 "
                          "(itl bounds every gap; tpot=MS bounds the mean)")
    analysis.add_argument("--sweep", default=None,
                          help="comma-separated rates, or 'auto' (doubling from --request-rate): find the "
                               "highest rate meeting the SLO")
    analysis.add_argument("--slo-attainment", type=float, default=0.9,
                          help="share of requests that must meet the SLO in a sweep (default 0.9)")
    analysis.add_argument("--window", type=float, default=1.0, help="seconds per window for transient analysis")
    analysis.add_argument("--spike-factor", type=float, default=3.0,
                          help="a window spikes when its P99 exceeds this x the run's median")
    analysis.add_argument("--stall-threshold-ms", type=float, default=None,
                          help="token gaps above this are stalls (default 5x the median ITL)")
    analysis.add_argument("--scrape-interval", type=float, default=1.0, help="seconds between /metrics scrapes")
    analysis.add_argument("--no-scrape", action="store_true", help="do not read the server's /metrics")
    analysis.add_argument("--output-dir", default=None, help="where result.json and the PNGs go "
                          "(default bench-results/<time>-<preset>)")
    analysis.add_argument("--save-requests", action="store_true", help="include per-request detail in the JSON")
    analysis.add_argument("--no-plots", action="store_true")
    analysis.add_argument("--quiet", action="store_true", help="no progress bar and no console tables")
    parser.set_defaults(handler=run_command)

    commands = parser.add_subparsers(dest="bench_command", metavar="{compare}")
    compare = commands.add_parser("compare", help="print runs side by side with ratios to the first")
    compare.add_argument("results", nargs="+", help="result.json files (or their directories)")
    compare.set_defaults(handler=compare_command)


def compare_command(args: argparse.Namespace) -> int:
    from titan.bench.report import load_report, print_compare, run_name

    if len(args.results) < 2:
        print("titan bench compare: give at least two results", file=sys.stderr)
        return 2
    try:
        reports = [load_report(path) for path in args.results]
    except (OSError, ValueError) as error:
        print(f"titan bench compare: {error}", file=sys.stderr)
        return 2
    print_compare(reports, [run_name(path) for path in args.results])
    return 0


@dataclass
class RunSetup:
    """What one `titan bench` command line asks for: the requests, their arrival times, how to send them.
    benchmarks/policy_replay.py builds the same requests from default_policy.py's command lines."""

    workload: Any
    run_config: Any
    arrivals: Any
    options: Any
    output_dir: Path
    rates: list[float] | None  # sweep rates; None: one run (empty list: auto)


def setup_run(args: argparse.Namespace) -> RunSetup:
    from titan.bench.analysis import Slo
    from titan.bench.arrivals import ArrivalProcess
    from titan.bench.report import AnalysisOptions
    from titan.bench.runner import RunConfig
    from titan.bench.workload import PRESETS, LengthDistribution, TokenCounter, Workload, WorkloadOptions

    def length(text: str | None) -> LengthDistribution | None:
        return LengthDistribution.parse(text) if text else None

    preset = PRESETS[args.preset]
    workload = Workload(WorkloadOptions(
        preset=args.preset, endpoint=args.endpoint, seed=args.seed, input_len=length(args.input_len),
        output_len=length(args.output_len), long_input_len=length(args.long_input_len),
        long_output_len=length(args.long_output_len), long_fraction=args.long_fraction,
        batch_input_len=length(args.batch_input_len), batch_output_len=length(args.batch_output_len),
        batch_fraction=args.batch_fraction, prefix_len=args.prefix_len,
        num_prefixes=args.num_prefixes, dataset=args.dataset,
    ), TokenCounter(args.tokenizer))
    rate = args.request_rate
    if rate is None:
        rate = math.inf if args.max_concurrency else preset.request_rate
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError("--max-concurrency must be >= 1")
    if args.duration is not None and math.isinf(rate) and not args.max_concurrency:
        raise ValueError("--duration with an infinite --request-rate needs --max-concurrency")
    arrivals = ArrivalProcess(
        rate=rate, burstiness=args.burstiness, ramp_up=args.ramp_up,
        burst_size=args.burst_size if args.burst_size is not None else preset.burst_size,
        burst_interval=args.burst_interval if args.burst_interval is not None else preset.burst_interval,
        seed=args.seed,
    )
    num_requests = args.num_requests if args.duration is None else None
    if num_requests is None and args.duration is None:
        num_requests = 100
    if (num_requests is not None and num_requests < 1) or (args.duration is not None and args.duration <= 0):
        raise ValueError("--num-requests and --duration must be positive")
    slo = Slo.parse(args.slo) if args.slo else None
    rates: list[float] | None = None
    if args.sweep:
        if slo is None:
            raise ValueError("--sweep needs --slo to know which rates are good")
        rates = [] if args.sweep == "auto" else [float(part) for part in args.sweep.split(",") if part.strip()]
        if args.sweep == "auto" and math.isinf(rate):
            raise ValueError("--sweep auto needs a finite starting --request-rate")
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return RunSetup(
        workload=workload,
        run_config=RunConfig(
            base_url=args.base_url, model=args.model or "", endpoint=args.endpoint, num_requests=num_requests,
            duration=args.duration, max_concurrency=args.max_concurrency, request_timeout=args.request_timeout,
            temperature=args.temperature, ignore_eos=args.ignore_eos, include_usage=not args.no_usage,
            send_priority=args.send_priority, api_key=args.api_key, scrape_metrics=not args.no_scrape,
            scrape_interval=args.scrape_interval, progress=not args.quiet and sys.stderr.isatty(),
            warm_prefixes=args.warm_prefixes,
        ),
        arrivals=arrivals,
        options=AnalysisOptions(
            window=args.window, spike_factor=args.spike_factor, slo=slo,
            stall_threshold=args.stall_threshold_ms / 1000 if args.stall_threshold_ms else None,
        ),
        output_dir=Path(args.output_dir or f"bench-results/{stamp}-{args.preset}"),
        rates=rates,
    )


def _config_dict(args: argparse.Namespace, setup: RunSetup, rate: float) -> dict[str, Any]:
    arrivals = setup.arrivals
    return {
        "request_rate": None if math.isinf(rate) else rate, "burstiness": arrivals.burstiness,
        "max_concurrency": args.max_concurrency, "num_requests": setup.run_config.num_requests,
        "duration_s": args.duration, "ramp_up_s": arrivals.ramp_up, "burst_size": arrivals.burst_size,
        "burst_interval_s": arrivals.burst_interval, "seed": args.seed, "ignore_eos": args.ignore_eos,
        "temperature": args.temperature, "send_priority": args.send_priority, "include_usage": not args.no_usage,
        "slo": args.slo, "window_s": args.window, "spike_factor": args.spike_factor,
        "stall_threshold_ms": args.stall_threshold_ms, "warm_prefixes": args.warm_prefixes,
    }


async def _one_run(args: argparse.Namespace, setup: RunSetup, rate: float) -> tuple[dict[str, Any], Any]:
    from dataclasses import replace
    from importlib.metadata import PackageNotFoundError, version

    from titan.bench.report import build_report
    from titan.bench.runner import run_load

    run = await run_load(setup.run_config, setup.workload, replace(setup.arrivals, rate=rate))
    try:
        titan_version = version("titan")
    except PackageNotFoundError:
        titan_version = "unknown"
    meta = {"tool": "titan bench", "version": titan_version, "base_url": args.base_url,
            "model": setup.run_config.model, "endpoint": args.endpoint, "command": sys.argv[1:]}
    report = build_report(run, meta=meta, config=_config_dict(args, setup, rate),
                          workload=setup.workload.describe(), options=setup.options,
                          scrape_interval=args.scrape_interval, include_requests=args.save_requests)
    return report, run


def _finish(args: argparse.Namespace, report: dict[str, Any], run: Any, directory: Path, plots: bool) -> None:
    from titan.bench.report import RESULT_FILE, print_report, write_json

    written = [write_json(report, directory / RESULT_FILE)]
    if plots:
        from titan.bench.plots import write_plots

        written += write_plots(report, run.results, directory)
    if not args.quiet:
        print_report(report)
        print("wrote " + ", ".join(str(path) for path in written))


async def _sweep(args: argparse.Namespace, setup: RunSetup) -> int:
    from titan.bench.report import write_json

    target = args.slo_attainment
    points: list[dict[str, Any]] = []

    async def measure(rate: float) -> bool:
        report, run = await _one_run(args, setup, rate)
        _finish(args, report, run, setup.output_dir / f"rate-{rate:g}", plots=False)
        good = report["goodput"]
        points.append({"request_rate": rate, "request_throughput": report["summary"]["request_throughput"],
                       "goodput_rps": good["goodput_rps"], "attainment": good["attainment"],
                       "failed": report["summary"]["failed"], "interrupted": run.interrupted})
        print(f"rate {rate:g} req/s: attainment {good['attainment']:.1%}, goodput {good['goodput_rps']:.2f} req/s")
        return good["attainment"] >= target and not run.interrupted

    if setup.rates:
        for rate in setup.rates:
            await measure(rate)
            if points[-1]["interrupted"]:
                break
    else:  # auto: double until the SLO breaks, then bisect twice between the last good and first bad rate
        rate, good_rate, bad_rate = setup.arrivals.rate, None, None
        for _ in range(8):
            if await measure(rate):
                good_rate, rate = rate, rate * 2
            else:
                bad_rate = rate
                break
        for _ in range(2):
            if good_rate is None or bad_rate is None or points[-1]["interrupted"]:
                break
            middle = (good_rate + bad_rate) / 2
            if await measure(middle):
                good_rate = middle
            else:
                bad_rate = middle
    meeting = [p["request_rate"] for p in points if p["attainment"] >= target and not p["interrupted"]]
    knee = max(meeting) if meeting else None
    summary = {"schema": "titan-bench-sweep/1", "slo": args.slo, "attainment_target": target,
               "knee_request_rate": knee, "points": sorted(points, key=lambda p: p["request_rate"])}
    write_json(summary, setup.output_dir / "sweep.json")
    if not args.no_plots and points:
        from titan.bench.plots import sweep_plot

        sweep_plot(summary["points"], setup.output_dir / "sweep.png")
    if knee is None:
        print(f"goodput knee: no tested rate met the SLO for {target:.0%} of requests")
    else:
        print(f"goodput knee: {knee:g} req/s (highest tested rate with >= {target:.0%} of requests in SLO)")
    return 0


async def _main(args: argparse.Namespace, setup: RunSetup) -> int:
    from titan.bench.client import make_client, wait_for_model

    if not setup.run_config.model or args.wait_for_server > 0:
        async with make_client(10.0, args.api_key) as client:
            try:
                listed = await wait_for_model(client, args.base_url, args.wait_for_server)
            except RuntimeError as error:
                print(f"titan bench: {error}", file=sys.stderr)
                return 2
        setup.run_config.model = setup.run_config.model or listed
    if setup.rates is not None:
        return await _sweep(args, setup)
    report, run = await _one_run(args, setup, setup.arrivals.rate)
    _finish(args, report, run, setup.output_dir, plots=not args.no_plots)
    if args.quiet:
        print(json.dumps({"result": str(setup.output_dir), "succeeded": report["summary"]["succeeded"],
                          "failed": report["summary"]["failed"]}))
    return 0 if report["summary"]["succeeded"] else 1


def run_command(args: argparse.Namespace) -> int:
    try:
        setup = setup_run(args)
    except (ValueError, OSError) as error:
        print(f"titan bench: {error}", file=sys.stderr)
        return 2
    return asyncio.run(_main(args, setup))
