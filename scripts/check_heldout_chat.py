#!/usr/bin/env python3
"""Sanity and overlap check for data/heldout_chat.jsonl (stdlib only).

Checks: valid JSON per line, exact key set, 240 rows, 40 per category,
unique ids, unique prompts, 10-250 words per prompt, and no overlap with
the training/dev/bench prompt files: exact match after lowercasing and
collapsing whitespace, or equal first 60 normalized characters.

Usage: python3 scripts/check_heldout_chat.py   (exit code 1 on any problem)
"""
import collections
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HELDOUT = ROOT / "data" / "heldout_chat.jsonl"
OTHERS = [
    ROOT.parent / "shared" / "data" / "train_prompts.jsonl",
    ROOT.parent / "shared" / "data" / "dev_prompts.jsonl",
    ROOT / "docs" / "bench" / "everyday_chat.jsonl",
]
CATEGORIES = ["general", "writing", "reasoning", "extraction", "summarization", "chat"]
PER_CATEGORY = 40
KEYS = {"id", "category", "source", "prompt"}
SOURCE = "written for dspark (CC0)"
PREFIX = 60


def norm(s):
    return re.sub(r"\s+", " ", s.lower()).strip()


def load(path):
    rows, bad = [], []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                bad.append((n, str(e)))
    return rows, bad


def main():
    problems = []
    rows, bad = load(HELDOUT)
    for n, err in bad:
        problems.append(f"line {n}: invalid JSON ({err})")
    print(f"{HELDOUT.relative_to(ROOT)}: {len(rows)} rows, {len(bad)} invalid JSON lines")

    if len(rows) != PER_CATEGORY * len(CATEGORIES):
        problems.append(f"expected {PER_CATEGORY * len(CATEGORIES)} rows, got {len(rows)}")
    for r in rows:
        if set(r) != KEYS:
            problems.append(f"{r.get('id')}: keys {sorted(r)}")
        if r.get("source") != SOURCE:
            problems.append(f"{r.get('id')}: source {r.get('source')!r}")
        if r.get("category") not in CATEGORIES:
            problems.append(f"{r.get('id')}: unknown category {r.get('category')!r}")
        elif not re.fullmatch(rf"heldout-{r['category']}-\d\d", str(r.get("id"))):
            problems.append(f"{r.get('id')}: id does not match heldout-<category>-<nn>")
        words = len(str(r.get("prompt", "")).split())
        if not 10 <= words <= 250:
            problems.append(f"{r.get('id')}: {words} words (want 10-250)")

    counts = collections.Counter(r.get("category") for r in rows)
    print("per category:", ", ".join(f"{c}={counts.get(c, 0)}" for c in CATEGORIES))
    for c in CATEGORIES:
        if counts.get(c, 0) != PER_CATEGORY:
            problems.append(f"category {c}: {counts.get(c, 0)} rows, want {PER_CATEGORY}")

    for what, key in (("id", lambda r: r.get("id")), ("prompt", lambda r: norm(r.get("prompt", "")))):
        dup = [k for k, v in collections.Counter(map(key, rows)).items() if v > 1]
        if dup:
            problems.append(f"duplicate {what}s: {dup[:5]}")
    own_pref = collections.Counter(norm(r["prompt"])[:PREFIX] for r in rows)
    for p, v in own_pref.items():
        if v > 1:
            problems.append(f"{v} held-out prompts share the first {PREFIX} chars: {p!r}")

    wc = sorted(len(r["prompt"].split()) for r in rows)
    print(f"words per prompt: min {wc[0]}, median {wc[len(wc) // 2]}, max {wc[-1]}")

    exact, prefix = {}, {}
    n_other = 0
    for path in OTHERS:
        other, obad = load(path)
        n_other += len(other)
        print(f"reference {path}: {len(other)} rows" + (f", {len(obad)} unparsable" if obad else ""))
        for o in other:
            p = norm(str(o.get("prompt", "")))
            exact.setdefault(p, f"{path.name}:{o.get('id')}")
            prefix.setdefault(p[:PREFIX], f"{path.name}:{o.get('id')}")
    n_exact = n_prefix = 0
    for r in rows:
        p = norm(r["prompt"])
        if p in exact:
            n_exact += 1
            problems.append(f"{r['id']}: exact match with {exact[p]}")
        elif p[:PREFIX] in prefix:
            n_prefix += 1
            problems.append(f"{r['id']}: first {PREFIX} chars match {prefix[p[:PREFIX]]}")
    print(f"overlap vs {n_other} reference prompts: {n_exact} exact, {n_prefix} first-{PREFIX}-char matches")

    if problems:
        print(f"FAIL: {len(problems)} problem(s)")
        for p in problems:
            print("  -", p)
        return 1
    print("OK: all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
