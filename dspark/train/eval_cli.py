"""`dspark eval-drafter` (tau of a drafter on a prompts file) and `dspark average-drafters`."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dspark.cli import check_at_least, check_output_path


def add_eval_parsers(sub) -> None:
    e = sub.add_parser("eval-drafter", help="tau per category, acceptance per position, confidence savings")
    e.add_argument("--drafter", required=True)
    e.add_argument("--prompts", required=True)
    e.add_argument("--num-prompts", type=int, default=None)
    e.add_argument("--per-category", type=int, default=None, help="at most N prompts of each category")
    e.add_argument("--max-tokens", type=int, default=256)
    e.add_argument("--temperature", type=float, default=0.0)
    e.add_argument("--block-size", type=int, default=None)
    e.add_argument("--tree-budget", type=int, default=None,
                   help="verify draft trees of this many nodes instead of chains")
    e.add_argument("--ngram-assist", type=int, default=None,
                   help="look up chains after suffix matches of this many tokens (0: the drafter alone; "
                        "default: the engine's, 2)")
    e.add_argument("--ngram-assist-max-len", type=int, default=None,
                   help="longest looked-up chain (default and most: 32)")
    e.add_argument("--model", default=None)
    e.add_argument("--device", default="auto")
    e.add_argument("--dtype", default="auto")
    e.add_argument("--max-num-seqs", type=int, default=16)
    e.add_argument("--out", default=None, help="also write the JSON here")
    e.set_defaults(func=cmd_eval)

    a = sub.add_parser("average-drafters", help="the weighted element-wise mean of drafters of one architecture")
    a.add_argument("drafters", nargs="+", metavar="DRAFTER_DIR", help="exported drafter folders (two or more)")
    a.add_argument("--out", required=True, help="a new (or empty) folder for the averaged drafter")
    a.add_argument("--weights", default=None, metavar="W1,W2,...", help="one per drafter, scaled to sum to 1 "
                   "(default: equal)")
    a.set_defaults(func=cmd_average)


def cmd_eval(args: argparse.Namespace) -> int:
    from dspark.config import SamplingParams
    from dspark.train.evaluate import evaluate

    check_at_least(args, num_prompts=1, per_category=1, max_tokens=1, block_size=1, tree_budget=1, max_num_seqs=1,
                   ngram_assist=0, ngram_assist_max_len=1)
    SamplingParams(temperature=args.temperature).validate()  # before the model loads
    if args.drafter in ("ngram", "none"):
        raise ValueError(f"--drafter {args.drafter}: eval-drafter measures a drafter folder "
                         "(DSpark, DFlash or EAGLE-3)")
    check_output_path(args.out)
    res = evaluate(args.drafter, args.prompts, num_prompts=args.num_prompts, per_category=args.per_category,
                   max_tokens=args.max_tokens, temperature=args.temperature, model=args.model,
                   device=args.device, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
                   block_size=args.block_size, tree_budget=args.tree_budget, ngram_assist=args.ngram_assist,
                   ngram_assist_max_len=args.ngram_assist_max_len)
    text = json.dumps(res, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


def cmd_average(args: argparse.Namespace) -> int:
    from dspark.train.average import average_drafters, parse_weights

    record = average_drafters(args.drafters, args.out, parse_weights(args.weights, len(args.drafters)))
    print(json.dumps(record))
    return 0
