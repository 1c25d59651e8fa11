"""Greedy bf16 outputs of the first 24 dev prompts decoded 16 at a time: plain, speculative (the
default drafter and assist), speculative with one-block lookups and the drafter alone verifying
trees of 8 and of 32 nodes, against plain; and the first 6 decoded alone against the same prompts batched.

    .venv/bin/python scripts/batched_vs_solo.py
"""

from __future__ import annotations

import json
from pathlib import Path

from dspark.config import SamplingParams
from dspark.llm import LLM

DEV = Path(__file__).resolve().parents[2] / "shared" / "data" / "dev_prompts.jsonl"


def main() -> None:
    prompts = [json.loads(line)["prompt"] for line in open(DEV, encoding="utf-8")][:24]
    chats = [[{"role": "user", "content": p}] for p in prompts]
    greedy = SamplingParams(max_tokens=256, temperature=0)
    outs: dict[str, list[list[int]]] = {}
    for name, kwargs in (("plain", {"drafter": "none"}), ("speculative", {}),
                         ("speculative, one-block lookups", {"ngram_assist_max_len": 8}),
                         ("drafter alone, trees of 8", {"ngram_assist": 0, "tree": True, "tree_budget": 8}),
                         ("drafter alone, trees of 32", {"ngram_assist": 0, "tree": True, "tree_budget": 32})):
        llm = LLM(max_num_seqs=16, **kwargs)
        outs[name] = [o.token_ids for o in llm.generate(chats, greedy)]
        if name == "plain":
            outs["plain, one at a time"] = [llm.generate([c], greedy)[0].token_ids for c in chats[:6]]
    for name, got in outs.items():
        same = sum(a == b for a, b in zip(got, outs["plain"]))
        print(f"{name:<32} {sum(map(len, got)):6d} tokens, {same} of {len(got)} equal to plain at batch 16")


if __name__ == "__main__":
    main()
