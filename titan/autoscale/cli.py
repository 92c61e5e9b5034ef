"""`titan autoscale simulate`: arguments and handler (argparse only at import; the handler loads the rest)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

DEFAULT_OUTPUT_DIR = "autoscale-results"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`titan autoscale` and its `simulate` subcommand on an existing (sub)parser."""
    commands = parser.add_subparsers(dest="autoscale_command", required=True, metavar="{simulate}")
    simulate = commands.add_parser(
        "simulate", help="compare HPA policies on a simulated fleet",
        description="Discrete-event simulation of Titan replicas under Kubernetes' HPA algorithm.")
    traffic = simulate.add_argument_group("traffic")
    traffic.add_argument("--trace", default=None,
                         help="CSV: 'time_s,rate_rps' (rate curve) or 'arrival_s[,work]' "
                              "(one row per request)")
    traffic.add_argument("--pattern", choices=["constant", "diurnal", "bursty", "step"], default="diurnal",
                         help="generated traffic when no --trace is given (default diurnal)")
    traffic.add_argument("--duration", type=float, default=7200.0, help="seconds of generated traffic")
    traffic.add_argument("--base-rate", type=float, default=2.0,
                         help="req/s at the trough (diurnal/bursty/step)")
    traffic.add_argument("--peak-rate", type=float, default=30.0,
                         help="req/s at the peak (constant: the rate)")
    traffic.add_argument("--period", type=float, default=3600.0,
                         help="seconds per diurnal cycle / between bursts (default 3600)")
    traffic.add_argument("--burst-length", type=float, default=300.0, help="seconds per burst (bursty)")
    traffic.add_argument("--work-cv", type=float, default=0.5,
                         help="variation of request sizes (gamma, mean 1; 0 = all equal)")
    traffic.add_argument("--seed", type=int, default=0)

    replica = simulate.add_argument_group("replica")
    replica.add_argument("--capacity", action="append", default=[],
                         help="titan-capacity/1 JSON, or titan bench result.json files / result folders "
                              "(repeatable); default: a built-in example profile")
    replica.add_argument("--max-concurrency", type=int, default=None,
                         help="requests one replica batches at once (the server's --max-num-seqs)")
    replica.add_argument("--cold-start", type=float, default=None,
                         help="seconds from pod creation to ready (default: the capacity file's, else 60)")
    replica.add_argument("--drain-timeout", type=float, default=25.0, help="titan serve --drain-timeout")
    replica.add_argument("--routing", choices=["least-load", "random"], default="least-load")
    replica.add_argument("--cpu-model", choices=["batch", "busy"], default="batch",
                         help="what CPU utilization tracks: the share of the batch in use (CPU server) "
                              "or the share of time anything runs (GPU server)")

    scaler = simulate.add_argument_group("autoscaler")
    scaler.add_argument("--policy", action="append", default=[],
                        help="preset (repeatable): cpu, queue, queue-running, queue-fast, inflight "
                             "(default: cpu, queue, queue-running, queue-fast)")
    scaler.add_argument("--policies", action="append", default=[],
                        help="YAML/JSON file of HorizontalPodAutoscaler manifests (e.g. kubectl kustomize "
                             "output) or {'policies': [...]} (repeatable)")
    scaler.add_argument("--min-replicas", type=int, default=1, help="for presets")
    scaler.add_argument("--max-replicas", type=int, default=20, help="for presets")
    scaler.add_argument("--sync-period", type=float, default=15.0,
                        help="--horizontal-pod-autoscaler-sync-period of the controller")
    scaler.add_argument("--scrape-interval", type=float, default=15.0, help="Prometheus scrape interval")

    outcome = simulate.add_argument_group("SLO and output")
    outcome.add_argument("--slo-queue", type=float, default=1.0,
                         help="seconds a request may wait before entering a batch (<= 0: no queue SLO)")
    outcome.add_argument("--slo-e2e", type=float, default=None, help="seconds from arrival to the last token")
    outcome.add_argument("--flap-window", type=float, default=600.0,
                         help="a scale reversal within this many seconds of the previous one is a flap")
    outcome.add_argument("--flap-threshold", type=int, default=3, help="flaps that make a policy 'flapping'")
    outcome.add_argument("--output-dir", default=DEFAULT_OUTPUT_DIR)
    outcome.add_argument("--no-plots", action="store_true")
    outcome.add_argument("--json", action="store_true", help="print the summary as JSON instead of a table")
    simulate.set_defaults(handler=simulate_command)


def _traffic(args: argparse.Namespace) -> tuple[list[Any], float, str]:
    from titan.autoscale.traces import RateTrace, generate, load_trace_csv, sample_arrivals

    if args.trace:
        loaded = load_trace_csv(args.trace)
        if isinstance(loaded, RateTrace):
            arrivals = sample_arrivals(loaded, args.seed, args.work_cv)
            return arrivals, loaded.duration, f"{args.trace} (rate curve)"
        duration = max((arrival.time for arrival in loaded), default=0.0)
        return loaded, duration, f"{args.trace} ({len(loaded)} arrivals)"
    trace = generate(args.pattern, args.base_rate, args.peak_rate, args.duration, args.period,
                     args.burst_length)
    return sample_arrivals(trace, args.seed, args.work_cv), trace.duration, trace.name


def simulate_command(args: argparse.Namespace) -> int:
    from titan.autoscale.capacity import EXAMPLE_PROFILE, load_capacity
    from titan.autoscale.policies import DEFAULT_COMPARISON, load_policies, presets
    from titan.autoscale.report import Slo, format_table, summarize
    from titan.autoscale.simulator import SimulationConfig, simulate

    try:
        if args.capacity:
            capacity = load_capacity(args.capacity, args.max_concurrency, args.cold_start)
        else:
            from dataclasses import replace

            capacity = replace(EXAMPLE_PROFILE,
                               max_concurrency=args.max_concurrency or EXAMPLE_PROFILE.max_concurrency)
        arrivals, duration, traffic_name = _traffic(args)
        named = presets(capacity.max_concurrency, args.min_replicas, args.max_replicas)
        unknown = [name for name in args.policy if name not in named]
        if unknown:
            raise ValueError(f"unknown policy {', '.join(unknown)}; presets: {', '.join(named)}")
        policies = [named[name] for name in args.policy]
        for path in args.policies:
            policies += load_policies(path)
        if not policies:
            policies = [named[name] for name in DEFAULT_COMPARISON]
    except (OSError, ValueError, KeyError) as error:
        print(f"titan autoscale simulate: {error}", file=sys.stderr)
        return 2
    cold_start = args.cold_start if args.cold_start is not None else (capacity.cold_start_s or 60.0)
    config = SimulationConfig(cold_start_s=cold_start, sync_period_s=args.sync_period,
                              scrape_interval_s=args.scrape_interval, drain_timeout_s=args.drain_timeout,
                              routing=args.routing, cpu_model=args.cpu_model, seed=args.seed)
    slo = Slo(args.slo_queue if args.slo_queue and args.slo_queue > 0 else None, args.slo_e2e)
    results = [simulate(arrivals, capacity, policy, config, duration) for policy in policies]
    summaries = [summarize(result, slo, args.flap_window, args.flap_threshold) for result in results]
    output = Path(args.output_dir)
    output.mkdir(parents=True, exist_ok=True)
    report = {
        "schema": "titan-autoscale/1",
        "traffic": {"source": traffic_name, "duration_s": duration, "requests": len(arrivals),
                    "seed": args.seed},
        "capacity": capacity.to_dict(),
        "simulation": {"cold_start_s": cold_start, "sync_period_s": args.sync_period,
                       "scrape_interval_s": args.scrape_interval, "drain_timeout_s": args.drain_timeout,
                       "routing": args.routing, "cpu_model": args.cpu_model},
        "slo": {"queue_s": slo.queue_s, "e2e_s": slo.e2e_s},
        "policies": summaries,
    }
    (output / "summary.json").write_text(json.dumps(report, indent=1), encoding="utf-8")
    written = [output / "summary.json"]
    if not args.no_plots:
        from titan.autoscale.plots import plot_comparison

        written.append(plot_comparison(results, arrivals, slo, output / "autoscale.png"))
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print(f"traffic: {traffic_name}, {len(arrivals)} requests over {duration / 60:.0f} min; replica: "
              f"{capacity.max_throughput:.2f} req/s at most, batch {capacity.max_concurrency}, cold start "
              f"{cold_start:g} s ({capacity.source})")
        print(format_table(summaries, slo))
        print("wrote " + ", ".join(str(path) for path in written))
    return 0
