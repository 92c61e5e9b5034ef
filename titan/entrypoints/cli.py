"""`titan` command line: `titan generate` (offline) — more subcommands join as they land."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

from titan.config_flags import add_engine_arguments, engine_config_from_args
from titan.server.args import add_server_arguments
from titan.version import titan_version


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=64)
    group.add_argument("--min-tokens", type=int, default=0)
    group.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    group.add_argument("--top-p", type=float, default=1.0)
    group.add_argument("--top-k", type=int, default=0)
    group.add_argument("--min-p", type=float, default=0.0)
    group.add_argument("--repetition-penalty", type=float, default=1.0)
    group.add_argument("--presence-penalty", type=float, default=0.0)
    group.add_argument("--frequency-penalty", type=float, default=0.0)
    group.add_argument("--sampling-seed", type=int, default=None, help="per-request seed")
    group.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    group.add_argument("--ignore-eos", action="store_true")


def generate(args: argparse.Namespace) -> int:
    from titan.engine.sampling_params import SamplingParams
    from titan.entrypoints.llm import LLM

    params = SamplingParams(
        max_tokens=args.max_tokens, min_tokens=args.min_tokens, temperature=args.temperature,
        top_p=args.top_p, top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
        seed=args.sampling_seed, stop=args.stop, ignore_eos=args.ignore_eos,
    )
    started = time.perf_counter()
    llm = LLM.from_config(args.engine_config)
    ready = time.perf_counter()
    prompts = args.prompt or ["What is the capital of France?"]
    if args.chat:
        prompts = [llm.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in prompts]
    outputs = llm.generate(prompts, params)
    finished = time.perf_counter()
    for prompt, output in zip(args.prompt or prompts, outputs, strict=True):
        if args.json:
            print(json.dumps({"prompt": prompt if isinstance(prompt, str) else None, "text": output.text,
                              "token_ids": output.token_ids, "finish_reason": output.finish_reason}))
        else:
            print(output.text)
    generated = sum(len(o.token_ids) for o in outputs)
    print(f"[titan] load {ready - started:.2f} s, generate {finished - ready:.2f} s, "
          f"{generated} tokens ({generated / max(finished - ready, 1e-9):.1f} tok/s)", file=sys.stderr)
    return 0


def serve(args: argparse.Namespace) -> int:
    from titan.server.serve import run_server

    return run_server(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="titan", description="Titan LLM inference server")
    parser.add_argument("--log-level", default="WARNING")
    parser.add_argument("--version", action="version", version=f"titan {titan_version()}")
    commands = parser.add_subparsers(dest="command", required=True)
    # Every engine and server flag shows its default in --help.
    defaults_shown = argparse.ArgumentDefaultsHelpFormatter
    gen = commands.add_parser("generate", help="generate text offline (no server)", formatter_class=defaults_shown)
    gen.add_argument("--prompt", action="append", default=[], help="prompt text (repeatable)")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    gen.add_argument("--json", action="store_true", help="one JSON object per output line")
    add_engine_arguments(gen)
    add_sampling_arguments(gen)
    gen.set_defaults(handler=generate)
    srv = commands.add_parser("serve", help="OpenAI-compatible HTTP server", formatter_class=defaults_shown)
    # `titan serve MODEL`, as `vllm serve MODEL`; --model still works.
    srv.add_argument("model_tag", nargs="?", metavar="MODEL", help="the model to serve (same as --model)")
    add_engine_arguments(srv)
    add_server_arguments(srv)
    srv.set_defaults(handler=serve)
    from titan.bench.cli import add_arguments as add_bench_arguments  # light: argparse only

    add_bench_arguments(commands.add_parser("bench", help="load-test any OpenAI-compatible server"))
    from titan.autoscale.cli import add_arguments as add_autoscale_arguments  # light: argparse only

    add_autoscale_arguments(commands.add_parser("autoscale", help="simulate Kubernetes autoscaling policies"))
    from titan.router.args import add_arguments as add_router_arguments  # light: argparse only

    add_router_arguments(commands.add_parser("router", help="OpenAI-compatible gateway across Titan replicas"))
    from titan.chaos.cli import add_arguments as add_chaos_arguments  # light: argparse only

    add_chaos_arguments(commands.add_parser("chaos", help="fault scenarios against a local router and replicas"))
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parsed and validated: engine commands carry their typed `engine_config` (a bad value exits 2)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "model_tag", None):
        args.model = args.model_tag
    if args.command in ("generate", "serve"):
        try:  # the config validates every value: a bad one is a usage error, not a traceback
            args.engine_config = engine_config_from_args(args)
        except ValueError as error:
            parser.error(str(error))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
