"""Command-line arguments and entry points of `dspark bench serve` and `dspark bench plot`."""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import random
import sys

from dspark.bench.client import CHAT, COMPLETIONS

ENDPOINTS = {"chat": CHAT, "completions": COMPLETIONS}


def parse_concurrencies(text: str) -> list[int | None]:
    """``"1,4,16"`` -> ``[1, 4, 16]``; ``max`` (or ``inf``) means no cap."""
    out: list[int | None] = []
    for part in (p.strip().lower() for p in text.split(",") if p.strip()):
        if part in ("max", "inf", "none"):
            out.append(None)
            continue
        try:
            value = int(part)
        except ValueError:
            raise ValueError(f"--concurrency: {part!r} is not a whole number") from None
        if value < 1:
            raise ValueError(f"--concurrency values must be >= 1, got {value}")
        out.append(value)
    if not out:
        raise ValueError("--concurrency is empty")
    return out


def parse_rates(text: str) -> list[float]:
    """``"0.5,2,inf"`` -> request rates in requests/s (``inf``: all requests at once)."""
    try:
        rates = [float(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise ValueError(f"--request-rate: {text!r} is not a comma list of numbers") from None
    if not rates or any(not r > 0 for r in rates):
        raise ValueError("--request-rate values must be > 0 (inf: all at once)")
    return rates


def add_serve_bench_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``serve`` to the subcommands of ``dspark bench``."""
    p = subparsers.add_parser(
        "serve", help="benchmark a running server over HTTP (like `vllm bench serve`)",
        description="Send streaming requests to a running OpenAI-compatible server at one or several "
                    "concurrencies (or Poisson request rates) and report throughput, TTFT, TPOT, ITL and "
                    "tau (from the server's /metrics). The table goes to stderr, the JSON to stdout.")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL (default %(default)s)")
    p.add_argument("--endpoint", default="chat", choices=sorted(ENDPOINTS),
                   help="chat: /v1/chat/completions (prompt as a user message); completions: /v1/completions")
    p.add_argument("--model", default=None, help="model name to request (default: the server's first)")
    p.add_argument("--api-key", default=None, help="bearer token (default: $DSPARK_API_KEY or $OPENAI_API_KEY)")
    p.add_argument("--prompts", default=None,
                   help="jsonl with a 'prompt' string or 'turns' list per row (default: ../shared/data/"
                        "dev_prompts.jsonl next to the repository)")
    p.add_argument("--category", default=None, help="only rows whose 'category' field equals this")
    p.add_argument("--num-prompts", type=int, default=32,
                   help="requests per load level, each level the file's next ones, so that no level replays "
                        "an earlier one's prompts to the server's prompt cache; they wrap around when the "
                        "file has too few (default 32)")
    p.add_argument("--same-prompts", action="store_true",
                   help="every load level sends the file's first --num-prompts prompts")
    p.add_argument("--first-level", type=int, default=0,
                   help="the first load level sends the prompts of level N of a longer sweep (0-based), so a "
                        "sweep split into one call per level sends what one call would (default 0)")
    p.add_argument("--prompt-order", default="shuffled", choices=["shuffled", "file"],
                   help="shuffled (default): the file's prompts in an order drawn with --seed, so that every "
                        "level gets a like mix of a file sorted by category (as vLLM's benchmark samples "
                        "its dataset); file: the file's own order")
    p.add_argument("--concurrency", default=None,
                   help="comma list of concurrency caps, one run each, e.g. 1,4,16; 'max' for no cap "
                        "(default: 1, or no cap with --request-rate)")
    p.add_argument("--request-rate", default="inf",
                   help="comma list of Poisson request rates in req/s, one run each (default inf: all at once)")
    p.add_argument("--max-tokens", type=int, default=128, help="max_tokens of every request (default 128)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0: greedy)")
    p.add_argument("--ignore-eos", action="store_true", help="always generate max_tokens tokens")
    p.add_argument("--warmup", type=int, default=2, help="unmeasured requests sent first (default 2)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take (default 600)")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompt order and the Poisson arrivals")
    p.add_argument("--label", default=None, help="this run's name in plots (default: the server's drafter/policy)")
    p.add_argument("--output", default=None, help="also write the JSON report to this file")
    p.add_argument("--plot", default=None, help="draw throughput and TTFT against concurrency into this image")
    p.add_argument("--compare", nargs="+", default=[], metavar="JSON",
                   help="saved reports drawn as further lines of --plot")
    p.set_defaults(func=cmd_bench_serve)
    return p


def add_plot_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``plot`` to the subcommands of ``dspark bench``."""
    p = subparsers.add_parser("plot", help="overlay saved `dspark bench serve` reports in one image",
                              description="Draw output throughput and TTFT against concurrency, one line per "
                                          "report (named by its label). Needs matplotlib (the 'plot' extra).")
    p.add_argument("reports", nargs="+", help="JSON files written by `dspark bench serve --output`")
    p.add_argument("--output", "-o", required=True, help="image to write (.png, .svg, .pdf)")
    p.add_argument("--title", default=None, help="figure title")
    p.set_defaults(func=cmd_bench_plot)
    return p


def _config(args: argparse.Namespace):
    from dspark.bench.prompts import default_prompts_path, load_prompts
    from dspark.bench.serve import ServeBenchConfig
    from dspark.cli import check_at_least, check_output_path

    check_at_least(args, num_prompts=1, max_tokens=1, warmup=0, first_level=0)
    check_output_path(args.output)
    check_output_path(args.plot)
    rates = parse_rates(args.request_rate)
    if args.concurrency is not None:
        concurrencies = parse_concurrencies(args.concurrency)
    else:
        concurrencies = [1] if all(math.isinf(r) for r in rates) else [None]
    path = args.prompts or default_prompts_path()
    if path is None:
        raise FileNotFoundError("no default prompts file (../shared/data/dev_prompts.jsonl); pass --prompts")
    levels = 1 if args.same_prompts else args.first_level + len(concurrencies) * len(rates)
    if args.prompt_order == "shuffled":  # drawn from the whole file, then each level's in turn
        prompts = load_prompts(path, sys.maxsize, args.category)
        random.Random(args.seed).shuffle(prompts)
        prompts = prompts[:args.num_prompts * levels]
    else:
        prompts = load_prompts(path, args.num_prompts * levels, args.category)  # levels wrap around a short file
    api_key = args.api_key or os.environ.get("DSPARK_API_KEY") or os.environ.get("OPENAI_API_KEY")
    cfg = ServeBenchConfig(base_url=args.url.rstrip("/"), prompts=prompts, concurrencies=concurrencies,
                           num_prompts=args.num_prompts, same_prompts=args.same_prompts,
                           first_level=0 if args.same_prompts else args.first_level,
                           rates=rates, endpoint=ENDPOINTS[args.endpoint], max_tokens=args.max_tokens,
                           temperature=args.temperature, ignore_eos=args.ignore_eos, warmup=args.warmup,
                           model=args.model, api_key=api_key, timeout=args.timeout, seed=args.seed,
                           label=args.label, prompt_order=args.prompt_order)
    return cfg, str(path)


def cmd_bench_serve(args: argparse.Namespace) -> int:
    """Run the serving benchmark: table to stderr, JSON to stdout (and --output), optional plot."""
    from dspark.bench.plot import PlotUnavailable, load_report, plot_reports
    from dspark.bench.serve import run_serve_bench
    from dspark.bench.table import format_table

    cfg, path = _config(args)
    compare = [load_report(p) for p in args.compare]  # fail on a bad file before the long run
    report = run_serve_bench(cfg)
    report["prompts"] = path
    report["category"] = args.category
    print(format_table(report["runs"], f"Serving Benchmark Result: {report['label']}"), file=sys.stderr)
    text = json.dumps(report, indent=2)
    print(text)
    if args.output:
        pathlib.Path(args.output).write_text(text + "\n", encoding="utf-8")
    if args.plot:
        try:
            plot_reports([report, *compare], args.plot)
        except PlotUnavailable as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(f"[bench serve] plot written to {args.plot}", file=sys.stderr)
    return 1 if any(r["failed"] for r in report["runs"]) else 0


def cmd_bench_plot(args: argparse.Namespace) -> int:
    """Overlay saved serving reports in one image."""
    from dspark.bench.plot import PlotUnavailable, load_report, plot_reports

    reports = [load_report(p) for p in args.reports]
    try:
        plot_reports(reports, args.output, args.title)
    except PlotUnavailable as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"[bench plot] {len(reports)} report(s) drawn into {args.output}", file=sys.stderr)
    return 0
