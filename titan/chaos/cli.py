"""`titan chaos [--scenario NAME ...]`: run the scenarios, print the verdict table, exit 1 if any request was
lost (or a scenario's own check failed)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

SCENARIO_NAMES = ("replica-kill", "replica-freeze", "slow-link", "kv-exhaustion", "step-failure", "slow-client")
COLUMNS = ("scenario", "sent", "completed", "failed before first byte", "failed mid-stream (error event)", "lost",
           "recovery s", "P99 before / during (ms)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = ("Start a router and local replicas on 127.0.0.1, run fault scenarios under a bounded "
                          "load, print a verdict table; exit 1 if any request was lost.")
    parser.add_argument("--scenario", action="append", choices=SCENARIO_NAMES, dest="scenarios", default=None,
                        help="a scenario to run (repeatable; default: all)")
    parser.add_argument("--requests", type=int, default=30, help="requests per scenario (default 30)")
    parser.add_argument("--clients", type=int, default=3, help="concurrent closed-loop clients (default 3)")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens per streamed request (default 16)")
    parser.add_argument("--output", type=Path, default=None, help="also write the verdicts as JSON here")
    parser.set_defaults(handler=run_command)


def cell(value: object) -> str:
    if value is None:
        return "—"
    return f"{value:g}" if isinstance(value, float) else str(value)


def table(rows: list[dict[str, object]]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for row in rows:
        values = [row["scenario"], row["sent"], row["completed"], row["failed_before_first_byte"],
                  row["failed_mid_stream"], row["lost"], cell(row["recovery_s"]),
                  f"{cell(row['p99_before_ms'])} / {cell(row['p99_during_ms'])}"]
        lines.append("| " + " | ".join(str(value) for value in values) + " |")
    return "\n".join(lines)


def run_command(args: argparse.Namespace) -> int:
    from titan.chaos.scenarios import SCENARIOS, Settings

    if args.requests < 3 or args.clients < 1 or args.max_tokens < 1:
        print("titan chaos: need --requests >= 3, --clients >= 1, --max-tokens >= 1", file=sys.stderr)
        return 2
    settings = Settings(args.requests, args.clients, args.max_tokens)
    rows: list[dict[str, object]] = []
    failed = False
    for name in args.scenarios or SCENARIO_NAMES:
        print(f"[chaos] {name} ...", file=sys.stderr, flush=True)
        try:
            result = SCENARIOS[name](settings).to_json()
        except Exception as error:  # noqa: BLE001 - a scenario that cannot run is a failed verdict, not a crash
            print(f"[chaos] {name} could not run: {error}", file=sys.stderr, flush=True)
            failed = True
            continue
        rows.append(result)
        for note in result["notes"]:  # type: ignore[union-attr]
            print(f"[chaos] {name}: {note}", file=sys.stderr, flush=True)
        failed = failed or bool(result["lost"]) or not result["ok"]
        if not result["ok"]:
            print(f"[chaos] {name}: its own check failed", file=sys.stderr, flush=True)
    print(table(rows), flush=True)
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(rows, indent=2) + "\n")
    lost = sum(int(row["lost"]) for row in rows)  # type: ignore[call-overload]
    print(f"lost requests: {lost}" + ("" if not failed else " — FAILED"), flush=True)
    return 1 if failed else 0
