#!/usr/bin/env python3
"""Overlap check for chat prompt files against the held-out, selection, bench and shared files
(stdlib only). The same three tests data/README.md describes:

  exact    the whole text matches after lowercasing and collapsing whitespace
  prefix   the first 60 normalized characters match
  8-gram   the texts share a run of 8 consecutive words (lowercased, punctuation stripped)

A row's texts are its `prompt`, or every string in `turns` or `messages` (user and assistant alike); each is
checked on its own, and the first text of each row must also be unique within the file
(exact and first 60 characters).

Usage:
  python3 scripts/chat_overlap.py FILE [FILE...] [--also data/train_chat]   (exit 1 on any hit)
--also adds every part*.jsonl / *.jsonl in that folder to the references (the checked files
themselves are skipped), as the README asks for new train_chat files.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REFERENCES = [
    ROOT / "data" / "heldout_chat.jsonl",
    ROOT / "data" / "select_chat.jsonl",
    ROOT / "docs" / "bench" / "everyday_chat.jsonl",
    ROOT.parent / "shared" / "data" / "train_prompts.jsonl",
    ROOT.parent / "shared" / "data" / "dev_prompts.jsonl",
]
PREFIX = 60
RUN = 8


def norm(s: str) -> str:
    return re.sub(r"\s+", " ", s.lower()).strip()


def words(s: str) -> list[str]:
    return re.sub(r"[^\w\s]", "", s.lower()).split()


def shingles(s: str, n: int = RUN) -> set[str]:
    w = words(s)
    return {" ".join(w[i:i + n]) for i in range(len(w) - n + 1)}


def row_texts(row: dict) -> list[str]:
    if isinstance(row.get("prompt"), str):
        return [row["prompt"]]
    out = []
    for t in (row.get("turns") or []) + (row.get("messages") or []):
        t = t.get("content") if isinstance(t, dict) else t
        if isinstance(t, str):
            out.append(t)
    return out


def read_jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


class Index:
    """Reference texts, indexed for the three tests. Only the 8-grams that some candidate has are
    kept (``wanted``), so the 25k-row shared train file costs little memory."""

    def __init__(self, paths: list[Path], wanted: set[str]):
        self.exact: dict[str, str] = {}
        self.prefix: dict[str, str] = {}
        self.grams: dict[str, str] = {}
        self.counts: dict[str, int] = {}
        for path in paths:
            rows = read_jsonl(path)
            self.counts[str(path)] = len(rows)
            for r in rows:
                where = f"{path.name}:{r.get('id')}"
                for t in row_texts(r):
                    p = norm(t)
                    self.exact.setdefault(p, where)
                    self.prefix.setdefault(p[:PREFIX], where)
                    for g in shingles(t) & wanted:
                        self.grams.setdefault(g, where)

    def hits(self, text: str) -> list[str]:
        p = norm(text)
        out = []
        if p in self.exact:
            out.append(f"exact match with {self.exact[p]}")
        elif p[:PREFIX] in self.prefix:
            out.append(f"first {PREFIX} chars match {self.prefix[p[:PREFIX]]}")
        for g in sorted(shingles(text)):
            if g in self.grams:
                out.append(f"8-word run {g!r} shared with {self.grams[g]}")
                break
        return out


def reference_paths(also: list[Path], skip: set[Path]) -> list[Path]:
    paths = [p for p in REFERENCES if p.is_file()]
    missing = [p for p in REFERENCES if not p.is_file()]
    for m in missing:
        print(f"warning: reference {m} is missing", file=sys.stderr)
    for folder in also:
        for p in sorted(folder.glob("*.jsonl")):
            if p.resolve() not in skip:
                paths.append(p)
    return paths


def build_index(candidate_texts: list[str], also: list[Path] = (), skip: set[Path] = frozenset()) -> Index:
    wanted: set[str] = set()
    for t in candidate_texts:
        wanted |= shingles(t)
    return Index(reference_paths(list(also), {Path(s).resolve() for s in skip}), wanted)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("--also", action="append", type=Path, default=[],
                    help="a folder whose *.jsonl files are references too (e.g. data/train_chat)")
    a = ap.parse_args()
    rows = {f: read_jsonl(f) for f in a.files}
    texts = [t for rs in rows.values() for r in rs for t in row_texts(r)]
    idx = build_index(texts, a.also, {f.resolve() for f in a.files})
    for path, n in idx.counts.items():
        print(f"reference {path}: {n} rows")
    problems = []
    for f, rs in rows.items():
        seen_exact, seen_prefix = {}, {}
        for r in rs:
            for t in row_texts(r):
                for h in idx.hits(t):
                    problems.append(f"{f.name}:{r.get('id')}: {h}")
            first = norm(row_texts(r)[0]) if row_texts(r) else ""
            for seen, key in ((seen_exact, first), (seen_prefix, first[:PREFIX])):
                if key in seen:
                    problems.append(f"{f.name}:{r.get('id')}: duplicates {seen[key]} (first text, exact or prefix)")
                    break
                seen[key] = r.get("id")
        print(f"{f}: {len(rs)} rows checked")
    if problems:
        print(f"FAIL: {len(problems)} hit(s)")
        for p in problems:
            print("  -", p)
        return 1
    print("OK: no exact, first-60-character or 8-word-run overlap")
    return 0


if __name__ == "__main__":
    sys.exit(main())
