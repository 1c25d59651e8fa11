"""`dspark bench`: measure decoding methods side by side and print one JSON object.

The offline benchmark (one process, no server) is the default mode: ``dspark bench --methods hf,ar``.
The measurement itself lives in :mod:`dspark.bench.offline`. Three sub-modes:
``dspark bench serve`` drives a running server over HTTP (:mod:`dspark.bench.serve`) and
``dspark bench plot`` overlays saved serving reports (:mod:`dspark.bench.plot`); ``dspark bench roofline``
times decode and verification passes of a random model against the bandwidth roofline.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from collections.abc import Callable

from dspark.bench.offline import METHODS
from dspark.bench.roofline import add_roofline_parser
from dspark.bench.serve_cli import add_plot_parser, add_serve_bench_parser


def add_bench_parser(subparsers: argparse._SubParsersAction,
                     add_engine_args: Callable[[argparse.ArgumentParser], None]) -> argparse.ArgumentParser:
    """Add the ``bench`` subcommand to ``subparsers`` and return its parser."""
    p = subparsers.add_parser(
        "bench", help="measure decode speed, TTFT and acceptance of several methods side by side",
        description="Run methods side by side on a prompts file in one process and print one JSON "
                    f"object. Methods: {', '.join(METHODS)}. Decode speed excludes prefill. llamacpp: "
                    "llama.cpp on the same GGUF (pip install llama-cpp-python), requests one at a time. "
                    "`dspark bench serve --help`: benchmark a running server over HTTP instead; "
                    "`dspark bench plot --help`: overlay saved serving reports; "
                    "`dspark bench roofline --help`: passes of a random model vs the bandwidth roofline.")
    add_engine_args(p)
    p.add_argument("--prompts", default=None,
                   help="jsonl with a 'prompt' string or 'turns' list per row "
                        "(default: ../shared/data/dev_prompts.jsonl next to the repository)")
    p.add_argument("--num-prompts", type=int, default=16, help="how many prompts to run (default 16)")
    p.add_argument("--category", default=None, help="only rows whose 'category' field equals this")
    p.add_argument("--batch-size", type=int, default=1, help="prompts generated together (default 1)")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens to generate per prompt")
    p.add_argument("--methods", default="hf,ar", help=f"comma list of {', '.join(METHODS)} (default hf,ar)")
    p.add_argument("--no-chat", dest="chat", action="store_false",
                   help="feed prompts as raw text instead of a user chat message")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sample at this temperature, request i seeded --seed + i in every method (default 0: "
                        "greedy); speculative outputs still equal ar's")
    p.add_argument("--seed", type=int, default=0, help="first request's seed when sampling (default 0)")
    p.add_argument("--warmup", type=int, default=1, help="prompts run once before timing each method")
    p.add_argument("--output", default=None, help="also write the JSON report to this file")
    p.add_argument("--sequential", action="store_true",
                   help="run one method after another with one model in memory (default: all methods "
                        "loaded, taking turns per prompt group, so machine drift hits them alike)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads, and llama.cpp's for --methods llamacpp (default: torch's choice; "
                        "1 is steadier on a busy machine)")
    p.set_defaults(func=cmd_bench)
    modes = p.add_subparsers(dest="bench_mode", metavar="{serve,plot,roofline}",
                             help="optional sub-mode (none: the offline benchmark)")
    add_serve_bench_parser(modes)
    add_plot_parser(modes)
    add_roofline_parser(modes)
    return p


def parse_methods(text: str) -> list[str]:
    """``"hf, ar"`` -> ``["hf", "ar"]``; raises ValueError on unknown or repeated names."""
    methods = [m.strip() for m in text.split(",") if m.strip()]
    if not methods:
        raise ValueError("--methods is empty")
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ValueError(f"unknown method {unknown[0]!r}: choose from {', '.join(METHODS)}")
    if len(set(methods)) != len(methods):
        raise ValueError("--methods names a method twice")
    return methods


RATIOS = (("vs ar", "speedup_vs_ar"), ("vs hf", "speedup_vs_hf"), ("vs llama.cpp", "vs_llamacpp"))


def format_methods(report: dict) -> str:
    """The offline report's methods as a short aligned table (decode tok/s, TTFT, ratios present)."""
    methods = report["methods"]
    ratios = [(t, k) for t, k in RATIOS if any(k in m for m in methods.values())]
    heads = ["method", "decode tok/s", "TTFT ms", "tokens"] + [t for t, _ in ratios]
    rows = [[name, *(("error", "", "") if "error" in m else (m["decode_tok_s"], m["ttft_ms"], m["tokens"])),
             *(m.get(k, "") for _, k in ratios)] for name, m in methods.items()]
    cells = [heads] + [["-" if v is None else str(v) for v in row] for row in rows]
    width = [max(len(r[i]) for r in cells) for i in range(len(heads))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, width))) for r in cells]
    if "llamacpp" in methods and report.get("batch_size", 1) > 1:
        lines.append("(llamacpp runs a batch's requests one after another: llama-cpp-python has no batched generate)")
    return "\n".join(lines)


def cmd_bench(args: argparse.Namespace) -> int:
    """Run the offline benchmark; print the JSON report to stdout (and --output)."""
    from dspark.bench.offline import default_prompts_path, load_prompts, run_bench
    from dspark.cli import check_at_least, check_output_path, engine_config

    methods = parse_methods(args.methods)
    check_at_least(args, num_prompts=1, batch_size=1, max_tokens=1, warmup=0, threads=1)
    check_output_path(args.output)
    if not 0 <= args.temperature < float("inf"):
        raise ValueError(f"--temperature must be a finite number >= 0, got {args.temperature}")
    if not -(2**63) <= args.seed < 2**64:  # the HTTP API's range
        raise ValueError(f"--seed must be in [-2**63, 2**64), got {args.seed}")
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    path = args.prompts or default_prompts_path()
    if path is None:
        raise FileNotFoundError("no default prompts file (../shared/data/dev_prompts.jsonl); pass --prompts")
    prompts = load_prompts(path, args.num_prompts, args.category)
    # load-aware by default, as `dspark serve`: the bench shows what serving delivers
    cfg = engine_config(args, default_policy="load-aware", tree_by_method="dspark-tree" in methods)
    report = run_bench(cfg, methods, prompts, batch_size=args.batch_size,
                       max_tokens=args.max_tokens, warmup=args.warmup, chat=args.chat,
                       interleave=not args.sequential, temperature=args.temperature, seed=args.seed)
    report["prompts"] = str(path)
    report["category"] = args.category
    text = json.dumps(report, indent=2)
    print(text)
    print(format_methods(report), file=sys.stderr)
    if args.output:
        pathlib.Path(args.output).write_text(text + "\n", encoding="utf-8")
    failed = [m for m, r in report["methods"].items() if "error" in r]
    if failed:  # the report still has every method that ran; the status tells a script (as bench serve's does)
        print(f"[bench] failed methods: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0
