"""Fresh engines at one request at a time, as a fresh server's first load level: each variant
decodes the same prompts in turn (the order rotating every prompt, so a drifting machine slows
all alike), and prints its output tok/s, ratio to the first variant and tau.

    .venv/bin/python scripts/fresh_engines_c1.py plain,old,default,steady 0 32

Variants (scripts/draft_depth_ab.py's engines): plain (--drafter none); default; old (the default
without trial passes on new text: HOPEFUL_ACCEPTANCE 0, so hopeful_gain never pays); steady (the
default never pausing). Arguments: variants, the first prompt's index in data/heldout_chat.jsonl,
the number of prompts (64 tokens each, greedy).
"""

from __future__ import annotations

import json
import sys

import draft_depth_ab  # this folder: run as a script, it is on sys.path

from dspark.config import SamplingParams
from dspark.llm import LLM

# the variant names draft_depth_ab.make knows them by
VARIANTS = {"old": "default:HOPEFUL_ACCEPTANCE=0"}


def make(name: str) -> LLM:
    """One engine variant (see the module docstring)."""
    if name not in ("plain", "default", "old", "steady"):
        raise SystemExit(f"unknown variant {name!r}")
    return draft_depth_ab.make(VARIANTS.get(name, name))


def main() -> None:
    names = sys.argv[1].split(",")
    start, count = int(sys.argv[2]), int(sys.argv[3])
    engines = {n: make(n) for n in names}
    with open("data/heldout_chat.jsonl", encoding="utf-8") as f:
        prompts = [json.loads(line)["prompt"] for line in f][start:start + count]
    sp = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    # one prompt a wave, every one measured: the engines stay fresh for the first
    draft_depth_ab.measure(engines, [[p] for p in prompts], sp, warm_up=False, rotate=True)


if __name__ == "__main__":
    main()
