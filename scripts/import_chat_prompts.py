#!/usr/bin/env python3
"""Chat prompts from a registry package: the BYU PCC Chit-Chat dataset (PyPI `chitchat-dataset`,
MIT licence) -> data/train_chat/registry-chitchat.jsonl. Standard library only.

Get the package without installing it (do not commit the wheel):

    pip download --no-deps chitchat-dataset==0.9.0 -d /tmp/pkgs
    python3 scripts/import_chat_prompts.py --wheel /tmp/pkgs/chitchat_dataset-0.9.0-py3-none-any.whl

(an installed `chitchat_dataset` module is used when --wheel is not given). The script stops
unless the wheel carries its MIT licence file (chitchat_dataset-*.dist-info/LICENSE).

What it keeps: the dataset is 7,168 typed conversations between two people (students, in
2018), each started from a topic question. Rows written:
  category `chitchat_topic`: the distinct topic questions themselves (5 words or more);
  category `chitchat`: per conversation, the first turn (one person's consecutive messages,
      joined with newlines) of 8-300 words that passes the filters below.
Lines that only greet or check the partner is there ("Hello?", "Are you still there?") are
removed from a turn first. Filters: English (>= 95% of letters ASCII and a common English function word), no URL,
e-mail address, @handle, long digit run or "my name is", no word from a short profanity list,
no talk about the chat site, the study or the university (BYU),
at most a third of the words laughter/filler; prompts unique within the file (exact and first
60 normalized characters). Then every prompt that overlaps data/heldout_chat.jsonl,
data/select_chat.jsonl, docs/bench/everyday_chat.jsonl, ../shared/data/train_prompts.jsonl,
../shared/data/dev_prompts.jsonl or data/train_chat/part*.jsonl (exact after lowercasing and
collapsing whitespace, first 60 normalized characters, or a shared 8-word run; see
scripts/chat_overlap.py) is dropped. Rows are shuffled with seed 0 so any prefix of the file
(e.g. train-drafter's --limit) is a random sample.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import importlib.util
import json
import random
import re
import sys
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import chat_overlap  # noqa: E402  (scripts/chat_overlap.py)

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "data" / "train_chat" / "registry-chitchat.jsonl"
SOURCE = "BYU PCC Chit-Chat dataset (PyPI chitchat-dataset 0.9.0), MIT licence"
MIN_WORDS, MAX_WORDS, MIN_TURN_WORDS = 5, 300, 8

ENGLISH = {"the", "a", "i", "you", "is", "to", "and", "of", "it", "that", "what", "do", "my", "in", "that's",
           "it's", "i'm", "be", "have", "are", "was", "for", "so", "but", "like", "would", "if", "me", "we"}
FILLER = {"haha", "hahaha", "hahahaha", "lol", "lmao", "hehe", "ha", "oh", "ok", "okay", "yeah", "yes", "no",
          "hmm", "hi", "hello", "hey", "wow", "cool", "nice", "omg", "k", "ya", "yep", "nope", "xd"}
PROFANITY = re.compile(r"\b(fuck\w*|shit\w*|bitch\w*|cunt\w*|dick\w*|asshole\w*|bastard\w*|damn\w*|"
                       r"crap\w*|sex\w*|porn\w*|nigg\w*|fag\w*|retard\w*|slut\w*|whore\w*|rape\w*|kill myself|"
                       r"suicid\w*|penis\w*|vagina\w*|boob\w*|drunk\w*|weed)\b", re.I)
PRIVATE = re.compile(r"(https?://|www\.|\.com\b|\.org\b|\.net\b|\S+@\S+|(?<!\w)@\w|\d[\d\- ]{6,}\d|"
                     r"my name is|snapchat|instagram|facebook|phone number)", re.I)


def load_package(wheel: Path | None) -> tuple[dict, str, str]:
    """(dataset, licence text, sha256 of dataset.json) from the wheel or the installed module."""
    if wheel is not None:
        with zipfile.ZipFile(wheel) as z:
            names = z.namelist()
            lic = [n for n in names if re.fullmatch(r"chitchat_dataset-[^/]+\.dist-info/LICENSE(\.txt)?", n)]
            if not lic:
                sys.exit(f"{wheel}: no licence file in the wheel's dist-info; refusing to import")
            licence = z.read(lic[0]).decode("utf-8")
            raw = z.read("chitchat_dataset/dataset.json")
    else:
        spec = importlib.util.find_spec("chitchat_dataset")
        if spec is None or spec.origin is None:
            sys.exit("chitchat_dataset is not installed; pass --wheel (see the docstring)")
        pkg = Path(spec.origin).parent
        lic = sorted(pkg.parent.glob("chitchat_dataset-*.dist-info/LICENSE*"))
        if not lic:
            sys.exit(f"no licence file next to {pkg}; refusing to import")
        licence = lic[0].read_text(encoding="utf-8")
        raw = (pkg / "dataset.json").read_bytes()
    if not licence.lstrip().startswith("MIT License") or "Permission is hereby granted, free of charge" not in licence:
        sys.exit("the package's licence file is not the MIT licence; refusing to import")
    return json.loads(raw), licence, hashlib.sha256(raw).hexdigest()


PING = re.compile(r"(h+i+|he+y+|hello+|yo|hey there|hi there|hello there|(are )?you (still )?there|still there|"
                  r"(is )?(any|some)(one|body) (in )?there|bye|goodbye|good bye|see ya|ttyl|lol|haha\w*)")
META = re.compile(r"chit.?chat|prompt|promt|username|disconnect|reconnect|the chat|this chat|this app|"
                  r"this website|the website|the site|my screen|refresh|glitch|\bbot\b|the other person|"
                  r"my partner|research|experiment|survey|\bbyu\b", re.I)


def clean(text: str) -> str:
    """Collapse spaces; drop empty lines and lines that only check the partner is there."""
    lines = [re.sub(r"[ \t]+", " ", ln).strip() for ln in text.splitlines()]
    return "\n".join(ln for ln in lines if ln and not PING.fullmatch(re.sub(r"[^\w\s]", "", ln.lower()).strip()))


def why_not(text: str, min_words: int) -> str | None:
    """None when the text is kept, else the reason it is dropped."""
    w = text.split()
    if not min_words <= len(w) <= MAX_WORDS:
        return "length"
    letters = [c for c in text if c.isalpha()]
    if not letters or sum(c.isascii() for c in letters) / len(letters) < 0.95:
        return "not English"
    low = [re.sub(r"[^\w']", "", x.lower()) for x in w]
    if not ENGLISH & set(low):
        return "not English"
    if PRIVATE.search(text):
        return "personal data / link"
    if PROFANITY.search(text):
        return "profanity / sensitive"
    if META.search(text):
        return "talks about the chat site or study"
    if sum(x in FILLER or re.fullmatch(r"(ha)+h?|(he)+|l+o+l+", x or "") is not None for x in low) > len(w) / 3:
        return "filler"
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--wheel", type=Path, help="chitchat_dataset-0.9.0-py3-none-any.whl from pip download")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()

    data, _licence, digest = load_package(a.wheel)
    print(f"dataset.json sha256 {digest}: {len(data)} conversations; licence file: MIT")
    dropped = collections.Counter()
    cands = []  # (category, key, text)
    topics = sorted({clean(c["prompt"]) for c in data.values() if isinstance(c.get("prompt"), str)})
    for t in topics:
        r = why_not(t, MIN_WORDS)
        if r:
            dropped[f"chitchat_topic: {r}"] += 1
        else:
            cands.append(("chitchat_topic", hashlib.sha1(t.encode()).hexdigest()[:10], t))
    for cid in sorted(data):
        for turn in data[cid].get("messages") or []:
            text = clean("\n".join(m.get("text", "") for m in turn if isinstance(m.get("text"), str)))
            r = why_not(text, MIN_TURN_WORDS)
            if r is None:
                cands.append(("chitchat", cid.split("-")[0], text))
                break
        else:
            dropped["chitchat: no qualifying turn"] += 1

    seen_exact, seen_prefix, uniq = set(), set(), []
    for cat, key, text in cands:
        n = chat_overlap.norm(text)
        if n in seen_exact or n[:chat_overlap.PREFIX] in seen_prefix:
            dropped[f"{cat}: duplicate within file"] += 1
            continue
        seen_exact.add(n)
        seen_prefix.add(n[:chat_overlap.PREFIX])
        uniq.append((cat, key, text))

    idx = chat_overlap.build_index([t for _, _, t in uniq], [ROOT / "data" / "train_chat"],
                                   {a.out.resolve()} | set((ROOT / "data" / "train_chat").glob("registry-*.jsonl")))
    for path, n in idx.counts.items():
        print(f"reference {path}: {n} rows")
    rows = []
    for cat, key, text in uniq:
        h = idx.hits(text)
        if h:
            dropped[f"{cat}: overlap ({h[0].split(' ')[0]})"] += 1
            continue
        rows.append({"id": f"chitchat-{'topic-' if cat == 'chitchat_topic' else ''}{key}", "category": cat,
                     "source": SOURCE, "prompt": text})
    random.Random(a.seed).shuffle(rows)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    with open(a.out, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    counts = collections.Counter(r["category"] for r in rows)
    wc = sorted(len(r["prompt"].split()) for r in rows)
    print(f"wrote {a.out}: {len(rows)} rows ({', '.join(f'{k}={v}' for k, v in sorted(counts.items()))}); "
          f"words min {wc[0]}, median {wc[len(wc) // 2]}, max {wc[-1]}")
    print("dropped:", ", ".join(f"{k}={v}" for k, v in sorted(dropped.items())))
    assert len({r["id"] for r in rows}) == len(rows), "duplicate ids"
    return 0


if __name__ == "__main__":
    sys.exit(main())
