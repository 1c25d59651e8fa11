"""What each verified row costs the target at batch 1: the decoder stack's and the LM head's
wall time per call, by the rows in the pass, from engines verifying fixed chains of K drafts
(K+1 rows a step) and from plain decoding (1 row), on the embedded model with the shipped drafter.

    .venv/bin/python scripts/row_costs.py --prompts 3 --tokens 64

Prints, per (part, rows), the calls and their median and fastest milliseconds. The decoder stack
of the drafter's block (two layers) is listed apart from the target's.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import time

from dspark.config import SamplingParams
from dspark.llm import LLM
from dspark.models import cpu_ops, llama


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--chains", default="1,2,3,5", help="draft tokens K of the fixed-chain engines")
    ap.add_argument("--prompts-file", default="data/heldout_chat.jsonl")
    a = ap.parse_args()
    ops = cpu_ops.load()
    if ops is None or not hasattr(ops, "decode_stack"):
        raise SystemExit("the CPU kernels (decode_stack) are not built here")
    times = collections.defaultdict(list)
    stack, logits = ops.decode_stack, llama.LlamaModel.logits

    def timed_stack(h, weights, *rest):  # noqa: ANN001, ANN002, ANN202
        t = time.perf_counter()
        out = stack(h, weights, *rest)
        # the target's 30 layers carry far more weight tensors than the drafter's 2
        times["target stack" if len(weights) > 100 else "drafter stack", h.shape[0]].append(time.perf_counter() - t)
        return out

    def timed_logits(self, hidden):  # noqa: ANN001, ANN202
        t = time.perf_counter()
        out = logits(self, hidden)
        times["LM head", hidden.shape[0]].append(time.perf_counter() - t)
        return out

    ops.decode_stack, llama.LlamaModel.logits = timed_stack, timed_logits
    with open(a.prompts_file, encoding="utf-8") as f:
        prompts = [json.loads(line)["prompt"] for line in f][:a.prompts]
    sp = SamplingParams(max_tokens=a.tokens, temperature=0, ignore_eos=True)
    engines = [LLM(kv_cache_tokens=8192, policy="fixed", block_size=int(k), ngram_assist=0)
               for k in a.chains.split(",")] + [LLM(drafter="none", kv_cache_tokens=8192)]
    for llm in engines:
        for p in prompts:
            llm.generate([[{"role": "user", "content": p}]], sp)
    for (part, rows), v in sorted(times.items()):
        if len(v) >= 20 and rows <= 16:  # decode and verification passes, not prefill
            print(f"{part:14} {rows:2d} rows: {len(v):4d} calls, median {1e3 * statistics.median(v):.3f} ms, "
                  f"fastest {1e3 * min(v):.3f} ms")


if __name__ == "__main__":
    main()
