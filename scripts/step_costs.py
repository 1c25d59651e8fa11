"""Where a speculative step's time goes at batch 1: the target's forward, the drafter's proposal
(block forward, draft logits, Markov steps) and its context write, per step and per call.

    .venv/bin/python scripts/step_costs.py [--num-prompts 4] [--max-tokens 128] [--spec-policy fixed]
        [--drafter none] [--ngram-assist 0] [--ngram-assist-max-len 8] [--category tools,code]
        [--block-size 2] [--prompts docs/bench/everyday_chat.jsonl]

Greedy generation on the first dev prompts (of the given categories) with the default model and
drafter, timers wrapped around the engine's and the drafter's methods (nested: the drafter's parts
are inside propose); then the target forward's median time by tokens in the pass.
"""

from __future__ import annotations

import argparse
import collections
import json
import time
from pathlib import Path

from dspark.config import SamplingParams
from dspark.llm import LLM

ORDER = ["step", "target forward", "  target attention plan", "  target embedding", "  target logits",
         "propose", "  block attention plan", "  block forward", "  draft logits",
         "  Markov steps", "  Markov walk", "  confidence", "commit", "  context K/V write"]
DEV = Path(__file__).resolve().parents[2] / "shared" / "data" / "dev_prompts.jsonl"


def timed(totals: dict, counts: collections.Counter, obj, name: str, label: str) -> None:
    """Replace obj.name with a wrapper adding its wall time to totals[label]."""
    inner = getattr(obj, name)

    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            totals[label] += time.perf_counter() - t
            counts[label] += 1

    setattr(obj, name, wrapper)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--spec-policy", default="fixed", choices=["fixed", "threshold", "load-aware"])
    ap.add_argument("--prompts", default=str(DEV))
    ap.add_argument("--drafter", default=None, help="drafter folder, 'ngram' or 'none' (default: the shipped one)")
    ap.add_argument("--ngram-assist", type=int, default=2, help="0: the drafter alone")
    ap.add_argument("--ngram-assist-max-len", type=int, default=32)
    ap.add_argument("--block-size", type=int, default=None, help="draft tokens a step (default: the drafter's)")
    ap.add_argument("--category", default=None, help="comma-separated dev categories (default: all)")
    args = ap.parse_args()
    llm = LLM(drafter=args.drafter, policy=args.spec_policy, ngram_assist=args.ngram_assist,
              ngram_assist_max_len=args.ngram_assist_max_len, block_size=args.block_size)
    engine, spec = llm.engine, llm.engine.spec
    totals: dict[str, float] = collections.defaultdict(float)
    counts: collections.Counter = collections.Counter()
    timed(totals, counts, engine, "step", "step")
    timed(totals, counts, engine.runner, "forward", "target forward")
    timed(totals, counts, engine.runner.attn, "plan", "  target attention plan")
    timed(totals, counts, engine.model.embed_tokens, "forward", "  target embedding")
    timed(totals, counts, engine.model, "logits", "  target logits")
    by_size = collections.defaultdict(list)  # tokens in a target pass -> its wall times
    forward = engine.runner.forward

    def sized(items, *args, **kwargs):
        t = time.perf_counter()
        try:
            return forward(items, *args, **kwargs)
        finally:
            by_size[sum(len(ids) for _, ids in items)].append(time.perf_counter() - t)

    engine.runner.forward = sized
    if spec.name == "dspark":
        for name, label in (("propose", "propose"), ("commit", "commit")):
            timed(totals, counts, spec, name, label)
        timed(totals, counts, spec.proposer, "_block_forward", "  block forward")
        timed(totals, counts, spec.proposer.attn, "plan", "  block attention plan")
        for name, label in (("draft_logits", "  draft logits"), ("step_logits", "  Markov steps"),
                            ("confidence", "  confidence"), ("write_context", "  context K/V write")):
            timed(totals, counts, spec.proposer.drafter, name, label)
        if spec.proposer.drafter.markov_head is not None:
            timed(totals, counts, spec.proposer.drafter.markov_head, "greedy_walk", "  Markov walk")
    rows = [json.loads(line) for line in open(args.prompts, encoding="utf-8")]
    if args.category:
        rows = [r for r in rows if r.get("category") in args.category.split(",")]
    prompts = [r["prompt"] for r in rows][:args.num_prompts]
    greedy = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    llm.generate([[{"role": "user", "content": prompts[0]}]], SamplingParams(max_tokens=8))  # warm-up
    totals.clear()
    counts.clear()
    by_size.clear()
    tokens = 0
    for p in prompts:
        tokens += len(llm.generate([[{"role": "user", "content": p}]], greedy)[0].token_ids)
    steps = counts["step"]
    print(f"{steps} steps, {tokens} tokens ({tokens / steps:.2f} a step), drafter {spec.name}, "
          f"policy {args.spec_policy}")
    for label in sorted(totals, key=ORDER.index):
        per_step = 1000 * totals[label] / steps
        per_call = 1000 * totals[label] / counts[label]
        print(f"{label:<22} {per_step:7.2f} ms/step  {counts[label]:6d} calls  {per_call:7.3f} ms/call")
    print("target forward by tokens in the pass (decode steps only: prefill passes are larger):")
    for n in sorted(by_size):
        if n <= 64:
            times = sorted(by_size[n])
            print(f"  {n:3d} tokens {1000 * times[len(times) // 2]:7.2f} ms median of {len(times)}")


if __name__ == "__main__":
    main()
