"""Would a lookup into the target's own past responses draft chat well? (SuffixDecoding's idea:
a cache of earlier outputs shared across requests, here primed with every committed
self-distillation response.)

    .venv/bin/python scripts/corpus_lookup.py --prompts data/select_chat.jsonl --max-tokens 192

Generates the target's greedy responses to the prompts, builds a backoff n-gram table (8 down
to 2 tokens of context -> the most frequent next token, with its count) over the committed
responses in drafters/data/<model>/, and replays each response as speculation would: at each
step a chain of up to 8 tokens is read off the table while the longest matching context has
been seen at least --min-count times with a share of at least --min-share for its most frequent
next token; the step accepts the chain's prefix the target wrote, plus one token. Prints tau per
category for each (min-count, min-share).
"""

from __future__ import annotations

import argparse
import glob
import json
from collections import defaultdict

import numpy as np
from safetensors.numpy import load_file

CONTEXTS = (8, 6, 5, 4, 3, 2)
_MUL = np.uint64(1000003)


def _hashes(seq: np.ndarray, n: int) -> np.ndarray:
    """A 64-bit hash of every n-token window of seq but the last (each has a next token)."""
    s = seq.astype(np.uint64)
    h = np.zeros(len(seq) - n, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for j in range(n):
            h = h * _MUL + s[j:len(seq) - n + j] + np.uint64(1)
    return h


def ngram_table(seqs: list[np.ndarray], n: int) -> tuple[np.ndarray, ...]:
    """(sorted context hashes, most frequent next token, its count, all counts) for n-token contexts."""
    h = np.concatenate([_hashes(s, n) for s in seqs if len(s) > n])
    nxt = np.concatenate([s[n:] for s in seqs if len(s) > n]).astype(np.int64)
    order = np.lexsort((nxt, h))
    h, nxt = h[order], nxt[order]
    starts = np.flatnonzero(np.r_[True, (h[1:] != h[:-1]) | (nxt[1:] != nxt[:-1])])
    count = np.diff(np.r_[starts, len(h)])
    pair_h, pair_next = h[starts], nxt[starts]
    first = np.flatnonzero(np.r_[True, pair_h[1:] != pair_h[:-1]])
    total, best = np.add.reduceat(count, first), np.maximum.reduceat(count, first)
    group = np.repeat(np.arange(len(first)), np.diff(np.r_[first, len(pair_h)]))
    is_best = np.flatnonzero(count == best[group])
    mode = pair_next[is_best[np.r_[True, group[is_best][1:] != group[is_best][:-1]]]]
    return pair_h[first], mode, best, total


def next_token(tables: dict, ctx: list[int], min_count: int, min_share: float) -> int | None:
    """The table's next token for ctx from its longest context seen min_count times, if confident."""
    for n in CONTEXTS:
        if len(ctx) < n:
            continue
        keys, mode, best, total = tables[n]
        h = _hashes(np.asarray(ctx[-n:] + [0]), n)[0]
        i = int(np.searchsorted(keys, h))
        if i < len(keys) and keys[i] == h and total[i] >= min_count:
            return int(mode[i]) if best[i] / total[i] >= min_share else None
    return None


def replay(tables: dict, prompt: list[int], ids: list[int], min_count: int, min_share: float) -> int:
    """Steps speculation with the table alone would take to produce ids (greedy, chains of 8)."""
    t = steps = 0
    while t < len(ids):
        ctx, chain = prompt + ids[:t], []
        while len(chain) < 8 and (tok := next_token(tables, ctx + chain, min_count, min_share)) is not None:
            chain.append(tok)
        a = 0
        while a < len(chain) and t + a < len(ids) and chain[a] == ids[t + a]:
            a += 1
        t, steps = t + a + 1, steps + 1
    return steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--max-tokens", type=int, default=192)
    ap.add_argument("--data", default="drafters/data/smollm2-135m")
    args = ap.parse_args()

    from dspark.config import SamplingParams
    from dspark.llm import LLM

    rows = [json.loads(line) for line in open(args.prompts)]
    outs = LLM(drafter="none").chat([[{"role": "user", "content": r["prompt"]}] for r in rows],
                                    SamplingParams(temperature=0.0, max_tokens=args.max_tokens))
    corpus = []
    for f in sorted(glob.glob(f"{args.data}/**/shard_*.safetensors", recursive=True)):
        d = load_file(f)
        off, plen = d["offsets"], d["prompt_lens"]
        corpus += [d["tokens"][off[j] + max(0, plen[j] - 8):off[j + 1]] for j in range(len(plen))]
    print(f"{len(corpus)} responses, {sum(map(len, corpus))} tokens")
    tables = {n: ngram_table(corpus, n) for n in CONTEXTS}
    for min_count, min_share in ((2, 0.5), (3, 0.6), (4, 0.7), (8, 0.8)):
        tokens, steps = defaultdict(int), defaultdict(int)
        for r, o in zip(rows, outs):
            tokens[r["category"]] += len(o.token_ids)
            steps[r["category"]] += replay(tables, o.prompt_token_ids, list(o.token_ids), min_count, min_share)
        per = ", ".join(f"{c} {tokens[c] / steps[c]:.2f}" for c in sorted(tokens))
        tau = sum(tokens.values()) / sum(steps.values())
        print(f"min count {min_count}, min share {min_share}: tau {tau:.3f} ({per})")


if __name__ == "__main__":
    main()
